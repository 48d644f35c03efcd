"""Fault-injection run (issue 45): SIGKILL the coordinator (``hacrl-fed run``), one of its gRPC workers, one rank of
a sharded worker, or the coordinator of an asynchronous run, at seeded moments of a small run on loopback, do what a
user would do next, and count what was lost.

``python scripts/fault_run.py --faults 12 --seed 0 [--targets coordinator,worker,rank,async] [--out DIR] [--json P]``

Every run is two micro orgs (``micro-qwen-char``, ``micro-gpt2-bpe``) on easy arithmetic, ``checkpoint_every: 1``,
``min_orgs: 1``, 4 rounds. One uninterrupted reference run per setting (the same config and transport), then fault
``i`` goes to target ``targets[i % len(targets)]`` at a phase drawn from :data:`PHASES`:

* ``coordinator``: lock-step over ``--transport grpc`` (the CLI starts both workers); SIGKILL the CLI (its workers
  must be gone within 10 s: else an orphan), then ``--resume``;
* ``worker``: the same run; SIGKILL org b's worker; the run goes on with a alone (``min_orgs: 1``), as the CLI
  cannot restart it;
* ``rank``: org b sharded (``sharding.ranks: 2``, gloo, started by torchrun); SIGKILL b's rank 1; its group stops
  and the run goes on with a alone;
* ``async``: ``federation.staleness: 1`` in process (the virtual clock); SIGKILL the CLI, then ``--resume``
  (docs/ALGORITHM.md "Resuming": from the last quiescent state, the workers' checkpoints aligned to it).

Phases, each after round 1's metrics line: ``between`` kills right after the next metrics line appears (the
coordinator has a step's replies and is sending the next plan); ``checkpoint`` kills as soon as a staging
checkpoint directory (``.tmp-round-*``) is seen (a checkpoint being written; after 30 s without one it falls back to
``step``, recorded as ``phase_hit: false``); ``step`` kills at a delay uniform in [0, 3) s (mid-step: generation or
training, which a micro step does not tell apart from outside).

Per fault it records: finished (exit 0, state at round 4), metric rows lost or duplicated, orphan processes (a
worker alive 10 s after its coordinator's kill, or any process of the run alive after it ended), checkpoints on
disk whose manifest does not verify (with the resumes that fell back past one), staging directories left, and
whether the learning metrics equal the reference's, and if not whether a gap explains it
(``round/<org>/failure/stale_round``: an org whose checkpoint was ahead of the coordinator's state refused the
round it had trained, by design; or the killed worker's rounds missing). Prints a table and writes JSON (after
every fault, so a batch cut short keeps what it measured).

* ``supernode``, ``superlink``: the same config through a real local Flower deployment (SuperLink, a SuperNode
  and a ``hacrl-fed worker`` per org); SIGKILL org b's SuperNode (then start it again) or the SuperLink (then start
  it again on its port and submit the run again with ``resume=true``): :mod:`fault_flower`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from fault_flower import deployment_run, victim_of  # noqa: E402

from hacrl_fed.worker.checkpoint_manifest import checkpoint_problem  # noqa: E402

ROUNDS = 4
ORGS = {"a": "micro-qwen-char", "b": "micro-gpt2-bpe"}
TARGETS = ("coordinator", "worker", "rank", "async", "supernode", "superlink")
PHASES = ("between", "checkpoint", "step")
SETTING = {"coordinator": "grpc", "worker": "grpc", "rank": "sharded", "async": "async"}  # target -> its run
SETTING.update(supernode="flower", superlink="flower")  # lock-step, as grpc, through a Flower deployment


def write_config(folder: Path, setting: str) -> Path:
    """The run config of ``setting``: ``grpc`` and ``flower`` (lock-step), ``sharded`` (b on two gloo ranks),
    ``async`` (K = 1)."""
    orgs = [{"id": o, "model": {"zoo": z}} for o, z in ORGS.items()]
    if setting == "sharded":  # the outcome guard works on one process's weights: off for the sharded org
        orgs[1].update(sharding={"ranks": 2, "backend": "gloo"}, trainer={"outcome_guard": {"enabled": False}})
    data = {
        "name": "faults",
        "seed": 1,
        "run_dir": str(folder / "runs"),
        "trainer": {"lr": 1e-3, "minibatch_size": 64, "micro_batch_size": 32},
        "generation": {"num_samples": 4, "max_new_tokens": 8, "eval_max_new_tokens": 8},
        "task": {"name": "arithmetic", "params": {"difficulty": 1, "max_operand": 9}, "eval_size": 4},
        "orgs": orgs,
        "federation": {
            "rounds": ROUNDS,
            "prompts_per_round": 4,
            "eval_every": 2,
            "min_orgs": 1,
            "round_timeout_s": 120.0,
            "checkpoint_every": 1,
            **({"staleness": 1} if setting == "async" else {}),
        },
    }
    path = folder / f"faults-{setting}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def cli(config: Path, run_dir: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    transport = "inprocess" if config.stem.endswith("async") else "grpc"
    argv = [sys.executable, "-m", "hacrl_fed.cli", "run", str(config), "--transport", transport]
    argv += ["--run-dir", str(run_dir), "--no-progress", *extra]
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def children(pid: int) -> dict[int, list[str]]:
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
    return out


def running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def wait_round(run_dir: Path, round: int, proc: subprocess.Popen, timeout_s: float = 600) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if any(r["round"] == round for r in rows(run_dir)):
                return True
        except ValueError:  # a line being written
            pass
        time.sleep(0.05)
    return False


def learning(run_dir: Path) -> dict[int, dict]:
    skip = ("time", "bytes", "wall_time")
    return {
        r["round"]: {
            k: v
            for k, v in r.items()
            if not k.startswith(skip)
            and "/time/" not in k
            and "/cpu/" not in k
            and "/perf/" not in k
            and not k.endswith(("/messages", "/step_s"))  # step_s: an asynchronous step call's wall seconds
        }
        for r in rows(run_dir)
    }


def worker_pids(cli_pid: int) -> dict[str, int]:
    deadline, found = time.monotonic() + 120, {}
    while time.monotonic() < deadline and len(found) < len(ORGS):
        for pid, argv in children(cli_pid).items():
            if "worker" in argv and "--org" in argv:
                found[argv[argv.index("--org") + 1]] = pid
        time.sleep(0.1)
    return found


def descendants(pid: int) -> dict[int, list[str]]:
    """Every process below ``pid`` (workers, torchrun agents and their ranks)."""
    out, todo = {}, [pid]
    while todo:
        kids = children(todo.pop())
        out.update(kids)
        todo.extend(kids)
    return out


def rank_pid(agent: int, rank: int) -> int | None:
    """The PID of rank ``rank`` below torchrun's agent ``agent`` (its ``RANK`` variable), None when not found."""
    for pid in descendants(agent):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and f"LOCAL_RANK={rank}".encode() in env:
            return pid
    return None


def org_dirs(run_dir: Path) -> list[Path]:
    """Where the workers of a run keep ``<org>/checkpoints``: the run dir's ``orgs`` (launched by the CLI), or each
    deployment worker's own ``workers/<org>/orgs`` (beside the run dir ``work/run``)."""
    deployed = sorted((run_dir.parent / "dep" / "workers").glob("*/orgs"))
    return deployed or [run_dir / "orgs"]


def staging(run_dir: Path) -> list[Path]:
    return [p for d in org_dirs(run_dir) for p in d.glob("*/checkpoints/*/.tmp-round-*")]


def wait_phase(phase: str, delay: float, run_dir: Path, alive: Callable[[], bool]) -> bool:
    """Wait for ``phase`` (module docstring) while ``alive()``; whether it was hit (``checkpoint`` may fall back to
    a delay)."""
    if phase == "between":
        seen = len(rows(run_dir))
        while alive() and len(rows(run_dir)) <= seen:
            time.sleep(0.005)
        return alive()
    if phase == "checkpoint":
        deadline = time.monotonic() + 30
        while alive() and time.monotonic() < deadline:
            if staging(run_dir):
                return True
            time.sleep(0.002)
    time.sleep(delay)
    return phase == "step"


def kill(target: str, proc: subprocess.Popen, pids: dict[str, int]) -> tuple[bool, int]:
    """SIGKILL the target; ``(injected, orphans)``: a killed coordinator's workers still alive 10 s later."""
    if proc.poll() is not None:
        return False, 0
    if target in ("coordinator", "async"):
        below = descendants(proc.pid)
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 10
        while any(running(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.1)
        return True, sum(running(p) for p in below)
    victim = pids.get("b") if target == "worker" else rank_pid(pids["b"], 1) if "b" in pids else None
    if victim is None or not running(victim):
        return False, 0
    os.kill(victim, signal.SIGKILL)
    return True, 0


def inject(i: int, rng: random.Random, targets: list[str], folder: Path, refs: dict[str, dict]) -> dict:
    """Fault ``i`` (module docstring); returns its record."""
    target, phase, delay = targets[i % len(targets)], rng.choice(PHASES), rng.uniform(0, 3)
    if SETTING[target] == "flower":
        return inject_flower(i, target, phase, delay, folder, refs["flower"])
    setting, run_dir = SETTING[target], folder / f"run-{i}"
    config = folder / f"faults-{setting}.yaml"
    proc = cli(config, run_dir)
    pids = worker_pids(proc.pid) if setting != "async" else {}
    injected = hit = False
    orphans = 0
    if wait_round(run_dir, 1, proc):
        hit = wait_phase(phase, delay, run_dir, lambda: proc.poll() is None)
        stage = [p.name for p in staging(run_dir)]
        everything = descendants(proc.pid)
        injected, orphans = kill(target, proc, pids)
        if injected and target in ("coordinator", "async"):
            proc = cli(config, run_dir, "--resume")
    else:
        stage, everything = [], {}
    _, err = proc.communicate(timeout=900)
    time.sleep(1)
    orphans += sum(running(p) for p in everything)
    return {
        "fault": i,
        "target": target,
        "phase": phase,
        "phase_hit": hit,
        "delay_s": round(delay, 2),
        "injected": injected,
        "staging_at_kill": stage,
        "orphans": orphans,
        "returncode": proc.returncode,
        **outcome(run_dir, proc.returncode, refs[setting]),
        "stderr_tail": err[-300:] if proc.returncode else "",
    }


def inject_flower(i: int, target: str, phase: str, delay: float, folder: Path, reference: dict[int, dict]) -> dict:
    """Fault ``i`` on a Flower deployment (:mod:`fault_flower`): after round 1's metrics line and ``phase``, SIGKILL
    ``target``, restart it as a user would; returns its record."""
    seen: dict = {"hit": False, "stage": []}

    def fault(dep, run_dir: Path, alive: Callable[[], bool]):
        deadline = time.monotonic() + 600
        while alive() and time.monotonic() < deadline and not any(r["round"] == 1 for r in rows(run_dir)):
            time.sleep(0.05)
        if not alive():
            return None
        seen["hit"] = wait_phase(phase, delay, run_dir, alive)
        seen["stage"] = [p.name for p in staging(run_dir)]
        return target, victim_of(dep, target)

    work = folder / f"run-{i}"
    got = deployment_run(work, folder / "faults-flower.yaml", list(ORGS), fault)
    head = {"fault": i, "target": target, "phase": phase, "phase_hit": seen["hit"], "delay_s": round(delay, 2)}
    return {
        **head,
        "injected": got["injected"],
        "staging_at_kill": seen["stage"],
        "orphans": got["orphans"],
        "returncode": got["returncode"],
        **outcome(work / "run", got["returncode"], reference, got["logs"]),
        "stderr_tail": got["stderr_tail"],
    }


def outcome(run_dir: Path, returncode: int, reference: dict[int, dict], logs: list[Path] | None = None) -> dict:
    """What a finished (or failed) run left: rows, checkpoints, whether it equals the reference; ``logs``: the
    workers' logs (default: the run dir's ``logs/*.log``)."""
    state = json.loads((run_dir / "coordinator_state.json").read_text()) if returncode == 0 else {}
    counts = Counter(r["round"] for r in rows(run_dir))
    checkpoints = [p for d in org_dirs(run_dir) for p in d.glob("*/checkpoints/*/round-*")]
    corrupt = [str(p) for p in checkpoints if checkpoint_problem(p) is not None]
    logs = "".join(p.read_text(errors="replace") for p in logs or (run_dir / "logs").glob("*.log"))
    got = learning(run_dir)
    gaps = any(
        v >= 1.0
        for rec in got.values()
        for k, v in rec.items()
        if k.endswith(("/failure/stale_round", "/failure/unreachable", "/failure/error", "/failure/timeout"))
    )
    return {
        "finished": state.get("round") == ROUNDS,
        "lost_rows": sum(1 for t in range(ROUNDS + 1) if counts[t] == 0),
        "duplicated_rows": sum(n - 1 for n in counts.values() if n > 1),
        "corrupt_checkpoints": len(corrupt),
        "staging_left": len(staging(run_dir)),
        "recovered": logs.count("unusable ("),
        "equal_to_reference": got == reference,
        "gap_explains_difference": got != reference and gaps,
    }


def table(records: list[dict]) -> str:
    """One line per (target, phase) with a fault injected, one per target, and one for all."""
    head = (
        "| target | phase | faults (phase hit) | finished | lost rows | duplicated rows | orphans "
        "| corrupt ckpt (recovered) | staging left | equal to reference | differ, gap explains | differ, unexplained |"
    )
    lines = [head, "|" + "---|" * 12]
    for target in (*TARGETS, "all"):
        for phase in (*PHASES, "all") if target != "all" else ("all",):
            rs = [r for r in records if r["injected"] and target in (r["target"], "all")]
            rs = [r for r in rs if phase in (r["phase"], "all")]
            if not rs:
                continue
            eq, gap = sum(r["equal_to_reference"] for r in rs), sum(r["gap_explains_difference"] for r in rs)
            lines.append(
                f"| {target} | {phase} | {len(rs)} ({sum(r['phase_hit'] for r in rs)}) | "
                f"{sum(r['finished'] for r in rs)} | {sum(r['lost_rows'] for r in rs)} "
                f"| {sum(r['duplicated_rows'] for r in rs)} | {sum(r['orphans'] for r in rs)} "
                f"| {sum(r['corrupt_checkpoints'] for r in rs)} ({sum(r['recovered'] for r in rs)}) "
                f"| {sum(r['staging_left'] for r in rs)} | {eq} | {gap} | {len(rs) - eq - gap} |"
            )
    return "\n".join(lines)


def reference(folder: Path, setting: str) -> dict[int, dict]:
    """The uninterrupted run of ``setting`` in ``folder`` (reused when a finished one is there: ``--out``): its
    learning metrics."""
    config = write_config(folder, setting)
    run_dir = folder / f"reference-{setting}" / ("run" if setting == "flower" else "")
    done = run_dir / "coordinator_state.json"
    if not (done.is_file() and json.loads(done.read_text()).get("round") == ROUNDS):
        if setting == "flower":
            got = deployment_run(run_dir.parent, config, list(ORGS))
            returncode, err = got["returncode"], got["stderr_tail"]
        else:
            ref = cli(config, run_dir)
            _, err = ref.communicate(timeout=900)
            returncode = ref.returncode
        if returncode != 0:
            sys.exit(f"the {setting} reference run failed: {err[-500:]}")
    print(f"reference {setting}: {len(learning(run_dir))} rows", flush=True)
    return learning(run_dir)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="the first fault's index (a later batch in the same --out)")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    p.add_argument("--out", type=Path, default=None, help="work folder (default: a new temporary one)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--table", type=Path, nargs="+", default=None, help="print the table of these JSON files, run none")
    args = p.parse_args()
    if args.table:
        print(table([r for path in args.table for r in json.loads(path.read_text())["faults"]]))
        return 0
    targets = [t for t in args.targets.split(",") if t]
    if not targets or any(t not in TARGETS for t in targets):
        sys.exit(f"--targets: choose among {', '.join(TARGETS)}")
    folder = args.out or Path(tempfile.mkdtemp(prefix="fault-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    refs = {setting: reference(folder, setting) for setting in sorted({SETTING[t] for t in targets})}
    records = []
    for i in range(args.start, args.start + args.faults):
        records.append(inject(i, rng, targets, folder, refs))
        print(json.dumps(records[-1]), flush=True)
        if args.json:  # after every fault: a batch cut short keeps what it measured
            args.json.write_text(json.dumps({"seed": args.seed, "targets": targets, "faults": records}, indent=1))
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
