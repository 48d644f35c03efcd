"""An org's worker on several gloo ranks behind its one gRPC endpoint (issue 28, the endpoint side): launch checks,
the launcher starting torchrun, rank faults failing the reply with one line naming the rank, no rank left alive."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers_fake_workers import FakeTask, FakeWorker, fake_config

from hacrl_fed.coordinator.grpc_transport import GrpcTransport
from hacrl_fed.coordinator.launcher import WorkerProcesses, torchrun_argv
from hacrl_fed.coordinator.loop import Coordinator
from hacrl_fed.sharded.group import ShardingError, check_launch, resolve_backend, torchrun_env
from hacrl_fed.sharded.watchdog import outcome, pid_gone
from hacrl_fed.types import ChatMessage, Prompt, RoundPlan, SamplingParams, StepRequest
from hacrl_fed.wire.grpc_client import WorkerCallError

REPO = Path(__file__).resolve().parents[1]
FAULTY = [sys.executable, str(Path(__file__).with_name("helpers_sharded_faults.py"))]
SMOKE = REPO / "configs" / "smoke.yaml"


def _config(tmp_path: Path, ranks: int = 2, hang_timeout_s: float = 3.0, orgs=("a",)) -> Path:
    data = fake_config(orgs=orgs).model_dump(mode="json")
    data["orgs"][0]["sharding"] = {"ranks": ranks, "backend": "gloo", "hang_timeout_s": hang_timeout_s}
    data["orgs"][0]["trainer"] = {"outcome_guard": {"enabled": False}}  # refused over ranks > 1
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _plan(round_: int = 1) -> StepRequest:
    prompts = tuple(Prompt(i, (ChatMessage("user", f"train question {i}"),), str(i)) for i in range(2))
    return StepRequest(plan=RoundPlan("run-x", round_, "fake", prompts, SamplingParams(num_samples=2, seed=3)))


def _rank_pids(log: Path, ranks: int = 2, within_s: float = 30.0) -> dict[int, int]:
    """``{rank: pid}`` from the stand-in's ``rank R pid P`` lines, waiting up to ``within_s`` for all ``ranks``."""
    deadline = time.monotonic() + within_s
    while True:
        found = {int(m[1]): int(m[2]) for m in re.finditer(r"^rank (\d+) pid (\d+)$", log.read_text(), re.M)}
        if len(found) >= ranks or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _all_gone(pids, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(pid_gone(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _kill_leftovers(pids) -> None:
    for pid in pids:
        if not pid_gone(pid):
            os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------- launch checks


def test_launch_checks_name_the_field_and_the_torchrun_command(tmp_path):
    cfg = yaml.safe_load(_config(tmp_path).read_text())
    from hacrl_fed.config import load_config

    cfg = load_config(cfg)
    with pytest.raises(
        ShardingError,
        match=r"orgs\[0\]\.sharding\.ranks=2 .*torchrun --nproc-per-node 2 -m "
        r"hacrl_fed\.cli worker --org a",
    ):
        check_launch(cfg, "a", None, ["--org", "a"])
    env = torchrun_env({"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(ShardingError, match=r"orgs\[0\]\.sharding\.ranks=2 .*torchrun started 3 processes"):
        check_launch(cfg, "a", env, [])
    two = torchrun_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert two is not None and two.rank == 1 and check_launch(cfg, "a", two, []) is True
    assert torchrun_env({"WORLD_SIZE": "2"}) is None
    with pytest.raises(ShardingError, match="RANK=2 is outside WORLD_SIZE=2"):
        torchrun_env({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert resolve_backend("auto", cuda=False) == "gloo" and resolve_backend("auto", cuda=True) == "nccl"
    with pytest.raises(ShardingError, match="nccl needs CUDA"):
        resolve_backend("nccl", cuda=False)


def test_sharded_org_started_without_torchrun_exits_2_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hacrl_fed.cli",
            "worker",
            "--config",
            str(_config(tmp_path)),
            "--org",
            "a",
            "--listen",
            f"unix:{tmp_path}/s/a.sock",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "orgs[0].sharding.ranks=2" in lines[0] and "torchrun --nproc-per-node 2" in lines[0]


def test_in_process_transports_refuse_a_sharded_org(tmp_path, capsys):
    from hacrl_fed.cli.run import main as run_main
    from hacrl_fed.flower.simulation import simulate

    config = _config(tmp_path)
    assert run_main([str(config), "--transport", "inprocess", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "orgs[0].sharding.ranks=2" in err[0] and "use --transport grpc" in err[0], err
    assert not (tmp_path / "r").exists()
    with pytest.raises(ShardingError, match=r"orgs\[0\]\.sharding\.ranks=2 .*Flower simulation"):
        simulate(config, run_dir=tmp_path / "f")


def test_launcher_wraps_a_sharded_org_in_torchrun():
    assert torchrun_argv(1, FAULTY) == FAULTY
    assert torchrun_argv(2, [sys.executable, "-m", "hacrl_fed.cli", "worker"]) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "hacrl_fed.cli",
        "worker",
    ]


def test_outcome_tells_a_fault_from_an_error():
    import torch

    assert outcome("step", result=object()) == {}
    assert outcome("step", error=ValueError("bad plan")) == {"error": "ValueError: bad plan"}
    assert outcome("train", error=torch.OutOfMemoryError("CUDA out of memory.\n  Tried")) == {
        "fault": "out of memory in train (CUDA out of memory. Tried)"
    }

    class Reply:
        raised = {"generate": MemoryError("no room")}

    assert outcome("step", result=Reply()) == {"fault": "out of memory in generate (no room)"}


# --------------------------------------------------------------------------------------------- faults


def _start(tmp_path: Path, fault: str, hang_timeout_s: float = 3.0):
    procs = WorkerProcesses(
        _config(tmp_path, hang_timeout_s=hang_timeout_s),
        ["a"],
        run_dir=tmp_path / "run",
        command=FAULTY,
        worker_args=["--fault", fault, "--fault-rank", "1"],
        ready_timeout_s=120,
        grace_s=5.0,
    )
    addresses = procs.start()
    transport = GrpcTransport(addresses)
    assert transport.wait_ready(30)["a"]["org_id"] == "a"
    return procs, transport


def _fault_reply(tmp_path: Path, fault: str, *, kill_rank: int | None = None, hang_timeout_s: float = 3.0):
    """Start the 2-rank stand-in with ``fault`` on rank 1, send one step; the error, the ranks' pids, the agent."""
    procs, transport = _start(tmp_path, fault, hang_timeout_s)
    log = tmp_path / "run" / "logs" / "a.log"
    agent = procs.workers["a"].proc
    pids = []
    try:
        pids = list(_rank_pids(log).values())
        assert len(pids) == 2
        if kill_rank is not None:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(transport.step, {"a": _plan()}, 60.0)
                while f"rank {kill_rank} in step" not in log.read_text():
                    time.sleep(0.05)
                os.kill(_rank_pids(log)[kill_rank], signal.SIGKILL)
                reply = pending.result()["a"]
        else:
            reply = transport.step({"a": _plan()}, 60.0)["a"]
        agent.wait(timeout=45)  # torchrun's agent ends when rank 0 gives the group up
        assert _all_gone(pids), "a rank outlived the fault"
        return reply, agent.returncode
    finally:
        transport.close()
        procs.close()
        _kill_leftovers(pids)


def _one_line(err) -> str:
    assert isinstance(err, WorkerCallError), err
    text = str(err)
    assert text.count("rank 1 of a:") == 1 and "\n" not in text, text
    return text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_out_of_memory_fails_the_reply_naming_it_and_no_rank_is_left(tmp_path):
    reply, code = _fault_reply(tmp_path, "oom")
    text = _one_line(reply)
    assert "rank 1 of a: out of memory in step (CUDA out of memory. Tried to allocate 2.00 GiB (test))" in text
    assert code != 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hung_rank_fails_the_reply_after_hang_timeout_naming_it(tmp_path):
    start = time.monotonic()
    reply, code = _fault_reply(tmp_path, "hang", hang_timeout_s=2.0)
    assert "rank 1 of a: hung in step for 2 s" in _one_line(reply) and code != 0
    assert time.monotonic() - start < 60


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_rank_fails_the_reply_naming_it(tmp_path):
    reply, code = _fault_reply(tmp_path, "die", kill_rank=1, hang_timeout_s=60.0)
    text = _one_line(reply)
    assert "rank 1 of a: died (process " in text and "exited) in step" in text and code != 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_to_rank_0_ends_every_rank_cleanly(tmp_path):
    """A served request, then SIGTERM to rank 0 alone: it stops serving, tells rank 1 to leave, both exit 0 and so
    does torchrun's agent."""
    procs, transport = _start(tmp_path, "")
    pids = list(_rank_pids(tmp_path / "run" / "logs" / "a.log").items())
    try:
        reply = transport.step({"a": _plan()}, 60.0)["a"]
        assert reply.batch is not None and reply.batch.round == 1, reply
        os.kill(dict(pids)[0], signal.SIGTERM)
        assert procs.workers["a"].proc.wait(timeout=45) == 0
        assert _all_gone([pid for _, pid in pids])
    finally:
        transport.close()
        procs.close()
        _kill_leftovers([pid for _, pid in pids])


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_coordinator_treats_a_rank_fault_as_a_failed_org(tmp_path):
    """Org a (2 ranks, rank 1 out of memory) fails round 1 and is gone after it; org b goes on: the existing rules."""
    path = _config(tmp_path, orgs=("a", "b"))
    cfg = yaml.safe_load(path.read_text())
    cfg["federation"].update(rounds=2, eval_every=0, checkpoint_every=0)
    path.write_text(yaml.safe_dump(cfg))
    from hacrl_fed.config import load_config

    procs = WorkerProcesses(
        path,
        ["a", "b"],
        run_dir=tmp_path / "run",
        command=FAULTY,
        worker_args=["--fault", "oom", "--fault-rank", "1"],
        ready_timeout_s=120,
        grace_s=5.0,
    )
    pids, results = [], []
    try:
        transport = GrpcTransport(procs.start())
        pids = list(_rank_pids(tmp_path / "run" / "logs" / "a.log").values())
        Coordinator(load_config(path), transport, tmp_path / "out", task=FakeTask(), on_round=results.append).run()
        transport.close()
    finally:
        procs.close()
        _kill_leftovers(pids)
    assert [r.round for r in results] == [1, 2]
    for r in results:  # a failed org contributes nothing; the round goes on with b
        assert r.failed.get("a") == "error" and "b" not in r.failed and r.replied == ["b"], r
    assert results[0].metrics.get("round/a/failure/error") == 1.0
    assert _all_gone(pids)


# --------------------------------------------------------------------------------------------- equal rewards


def _cli_run(run_dir: Path, config: Path, *extra: str) -> dict[int, dict[str, float]]:
    cmd = [
        sys.executable,
        "-m",
        "hacrl_fed.cli",
        "run",
        str(config),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--set",
        "federation.rounds=2",
        "--set",
        "federation.eval_every=1",
        "--set",
        "trainer.selection.rule=all",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[int, dict[str, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        keep = {
            k: v
            for k, v in rec.items()
            if not {"time", "cpu", "bytes", "messages", "wall_time", "perf", "seconds"} & set(k.split("/"))
        }
        out.setdefault(rec["round"], {}).update(keep)
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_org_on_two_gloo_ranks_over_grpc_gives_the_plain_numbers(tmp_path):
    """The smoke federation with acme on 2 gloo ranks (torchrun, started by ``run --transport grpc``) gives every
    per-round reward, loss, ratio and accuracy of the plain run (in-process; tests/test_e2e_transports.py shows
    in-process and gRPC agree)."""
    data = yaml.safe_load(SMOKE.read_text())
    data["orgs"][0]["trainer"] = {"outcome_guard": {"enabled": False}}  # refused over ranks > 1; off in both runs
    unsharded = tmp_path / "plain.yaml"
    unsharded.write_text(yaml.safe_dump(data))
    data["orgs"][0]["sharding"] = {"ranks": 2, "backend": "gloo"}
    sharded = tmp_path / "sharded.yaml"
    sharded.write_text(yaml.safe_dump(data))
    plain = _cli_run(tmp_path / "plain", unsharded)
    got = _cli_run(tmp_path / "grpc", sharded, "--transport", "grpc")
    assert sorted(got) == sorted(plain) == [0, 1, 2]
    assert any(k.endswith("acme/train/loss") for k in plain[2]) and any("reward" in k for k in plain[1])
    for rnd, metrics in plain.items():
        assert set(got[rnd]) == set(metrics), (rnd, set(got[rnd]) ^ set(metrics))
        for key, value in metrics.items():
            assert got[rnd][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (rnd, key)
    assert "on 2 ranks (gloo)" in (tmp_path / "grpc" / "logs" / "acme.log").read_text()
    assert _all_gone(_processes_naming(tmp_path / "grpc")), "a rank outlived the run"


def _processes_naming(path: Path) -> list[int]:
    """Pids of live processes whose command line names ``path`` (torchrun's agent and its ranks do)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(path).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in found if not pid_gone(pid)]


# --------------------------------------------------------------------------------------------- one order


class _Pair:
    """Rank 0's dispatcher and rank 1's loop over a real TCPStore in this process, ranks as threads."""

    def __init__(self, workers, hang_timeout_s: float = 30.0):
        import threading
        from datetime import timedelta

        from torch.distributed import TCPStore

        from hacrl_fed.sharded.dispatch import RankDispatcher, rank_loop
        from hacrl_fed.sharded.watchdog import Heartbeat
        from hacrl_fed.wire import codec

        self.master = TCPStore(
            "127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
        )
        self.hang_timeout_s = hang_timeout_s
        self.beats = [Heartbeat(self.group(r)).start() for r in (0, 1)]
        self.codes: list[int] = []
        self.other = threading.Thread(target=self._loop, args=(workers[1], rank_loop, codec), daemon=True)
        self.other.start()
        self.dispatcher = RankDispatcher(self.group(0), workers[0], self.beats[0])

    def _loop(self, worker, rank_loop, codec) -> None:
        self.codes.append(rank_loop(self.group(1), worker, self.beats[1], codec.DEFAULT_LIMITS, lambda: True))

    def group(self, rank):
        from datetime import timedelta
        from types import SimpleNamespace

        from torch.distributed import PrefixStore, TCPStore

        def connect():
            client = TCPStore("127.0.0.1", self.master.port, None, is_master=False, timeout=timedelta(seconds=30))
            return PrefixStore("hacrl_fed/", client)

        return SimpleNamespace(rank=rank, world_size=2, org_id="a", hang_timeout_s=self.hang_timeout_s, connect=connect)

    def stop(self) -> None:
        self.dispatcher.shutdown()  # no process group here: shutdown() alone ends rank 1's loop
        self.other.join(30)
        for b in self.beats:
            b.stop()


def test_concurrent_requests_reach_every_rank_in_one_order():
    """Requests sent at once from several threads run on both ranks in the same order, and rank 0 replies with its
    own value."""
    import threading

    from helpers_fake_workers import FakeWorker

    workers = [FakeWorker("a"), FakeWorker("a")]
    pair, replies = _Pair(workers), {}

    def send(round_):
        replies[round_] = pair.dispatcher.step(_plan(round_))

    senders = [threading.Thread(target=send, args=(r,)) for r in range(1, 9)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(30)
    pair.stop()
    order = [[p.round for p in w.plans] for w in workers]
    assert sorted(order[0]) == list(range(1, 9)) and order[0] == order[1] and pair.codes == [0]
    assert all(replies[r].batch.round == r for r in range(1, 9))


class _Rank1(FakeWorker):
    """Rank 1's stand-in in this process: raises ``error`` in step, or waits for ``release`` first."""

    error: BaseException | None = None
    release = None

    def step(self, request):
        if self.release is not None:
            self.release.wait(30)
        if self.error is not None:
            raise self.error
        return super().step(request)


@pytest.mark.parametrize(
    ("error", "hang", "line", "code"),
    [
        (MemoryError("no room for the KV cache"), False, r"rank 1 of a: out of memory in step \(no room", [1]),
        (ValueError("bad rows"), False, r"rank 1 of a: failed in step \(ValueError: bad rows\)", [0]),
        (None, True, r"rank 1 of a: hung in step for [0-9] s", [0]),
    ],
)
def test_a_rank_fault_fails_the_reply_naming_it_in_process(error, hang, line, code):
    import threading

    from hacrl_fed.sharded.watchdog import RankFault

    rank1 = _Rank1("a")
    rank1.error, rank1.release = error, threading.Event() if hang else None
    pair = _Pair([FakeWorker("a"), rank1], hang_timeout_s=0.5)
    with pytest.raises(RankFault, match=line):
        pair.dispatcher.step(_plan(1))
    assert pair.dispatcher.failed.is_set()
    with pytest.raises(RuntimeError, match="the org's ranks stopped: rank 1 of a"):
        pair.dispatcher.health()
    if hang:
        rank1.release.set()
    pair.stop()
    assert pair.codes == code  # out of memory: rank 1 leaves by itself once rank 0 has its cause
