"""A worker that dies is never silent: a launched worker SIGKILLed mid-run leaves one line naming its org, its phase
and its peak memory in the run's error.log and on stderr (hacrl_fed/coordinator/worker_deaths.py); an allocation
failure in an in-process phase names the org and the phase (hacrl_fed/worker/phase.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hacrl_fed.run_files import ERROR_LOG
from hacrl_fed.worker import phase

REPO = Path(__file__).resolve().parents[1]


def _config(tmp_path: Path) -> Path:
    data = {
        "name": "death",
        "seed": 1,
        "run_dir": str(tmp_path / "runs"),
        "trainer": {"lr": 1e-3, "minibatch_size": 64, "micro_batch_size": 32, "outcome_guard": {"enabled": False}},
        "generation": {"num_samples": 4, "max_new_tokens": 8, "eval_max_new_tokens": 8},
        "task": {"name": "arithmetic", "params": {"difficulty": 1, "max_operand": 9}, "eval_size": 4},
        "orgs": [{"id": "a", "model": {"zoo": "micro-qwen-char"}}, {"id": "b", "model": {"zoo": "micro-gpt2-bpe"}}],
        "federation": {
            "rounds": 200,
            "prompts_per_round": 4,
            "eval_every": 0,
            "min_orgs": 1,
            "protocol": "two_message",
            "round_timeout_s": 60.0,
        },
    }
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _child(pid: int, org: str) -> int | None:
    """The ``hacrl-fed worker --org ORG`` child of ``pid`` (Linux /proc), None while there is none."""
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "--org" in argv and argv[argv.index("--org") + 1] == org:
            return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_worker_killed_mid_train_is_one_line_with_org_phase_and_memory(tmp_path):
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    argv = [
        sys.executable,
        "-m",
        "hacrl_fed.cli",
        "run",
        str(_config(tmp_path)),
        "--transport",
        "grpc",
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    phase_file, victim = run_dir / "logs" / "b.phase", None
    try:
        deadline = time.monotonic() + 180
        while victim is None and time.monotonic() < deadline and proc.poll() is None:
            if phase.read_phase_file(phase_file)[0] == "train":
                victim = _child(proc.pid, "b")
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
            time.sleep(0.002)
        assert victim is not None, "b never reached its train phase"
        while time.monotonic() < deadline and "worker 'b'" not in _read(run_dir / ERROR_LOG):
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    line = _read(run_dir / ERROR_LOG).splitlines()[0]
    pattern = (
        rf"^worker 'b' \(pid {victim}\) was killed by SIGKILL in phase train \(likely out of memory: "
        r"peak RSS \d+\.\d GiB of \d+\.\d GiB\) \(log: .*/logs/b\.log\)$"
    )
    assert re.match(pattern, line), line
    assert f"hacrl-fed run: {line}" in stderr
    assert sum("worker 'b'" in x for x in _read(run_dir / ERROR_LOG).splitlines()) == 1  # once, not per poll


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_an_allocation_failure_names_the_org_and_the_phase(tmp_path, monkeypatch):
    monkeypatch.setenv(phase.PHASE_FILE_ENV, str(tmp_path / "x.phase"))
    with pytest.raises(phase.OutOfMemory) as err:
        with phase.phase("gemma", "train"):
            raise RuntimeError(
                "[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 4294967296 bytes. Error code 12\nmore"
            )
    assert re.match(
        r"^org 'gemma' ran out of memory in phase train \(peak RSS \d+\.\d GiB of \d+\.\d GiB\): "
        r"RuntimeError: \[enforce fail",
        str(err.value),
    ) and "\n" not in str(err.value)
    assert phase.current("gemma") == "train"
    name, peak = phase.read_phase_file(tmp_path / "x.phase")
    assert name == "train" and peak is not None and peak > 0
    with pytest.raises(phase.OutOfMemory, match="^org 'acme' ran out of memory in phase generate"):
        with phase.phase("acme", "generate"):
            raise MemoryError()
    with pytest.raises(RuntimeError, match="^shapes differ$"):  # not an allocation: left as it is
        with phase.phase("acme", "generate"):
            raise RuntimeError("shapes differ")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the per-phase peak resets /proc/self/clear_refs")
def test_peak_rss_is_each_phases_own():
    """perf/<phase>/peak_rss_mb is the phase's peak: a 400 MB buffer freed in phase one does not count in phase
    two."""
    import torch

    from hacrl_fed.perf import PhaseMeter

    meter = PhaseMeter("cpu")
    big = torch.ones(100 * 2**20)  # 400 MB, touched
    del big
    first = meter.lap("one", 0)["perf/one/peak_rss_mb"]
    second = meter.lap("two", 0)["perf/two/peak_rss_mb"]
    assert first - second > 300, (first, second)


def test_the_death_line_of_each_way_to_die(tmp_path):
    """A signal, a sharded org's rank killed under torchrun (its agent exits 1, the rank's signal is in its log),
    and an exit of the worker's own."""
    from types import SimpleNamespace

    from hacrl_fed.coordinator.worker_deaths import death_line, phase_file_of

    (tmp_path / "logs").mkdir()
    phase_file_of(tmp_path, "acme").write_text(f"generate {3 * 2**20}\n")
    w = SimpleNamespace(org_id="acme", proc=SimpleNamespace(pid=7), tail=[], error_line=None, log_path="L")
    line = death_line(w, -signal.SIGKILL, 2**20, tmp_path)
    assert re.match(r"^worker 'acme' \(pid 7\) was killed by SIGKILL in phase generate \(likely out of memory: "
                    r"peak RSS 3\.0 GiB of \d+\.\d GiB\) \(log: L\)$", line), line
    assert "was killed by SIGTERM in phase generate (peak RSS 3.0 GiB" in death_line(w, -signal.SIGTERM, 0, tmp_path)
    w.tail = ["  exitcode  : -9 (pid: 1234)", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"]
    assert "was killed by SIGKILL in phase generate (likely out of memory" in death_line(w, 1, None, tmp_path)
    w.tail, w.error_line = [], "hacrl-fed worker: failed: ValueError: bad"
    assert death_line(w, 1, None, tmp_path) == ("worker 'acme' (pid 7) exited with code 1 in phase generate: "
                                                "hacrl-fed worker: failed: ValueError: bad (log: L)")
    assert "in phase unknown (it reported none)" in death_line(w, 1, None, tmp_path / "elsewhere")
