"""A launched worker whose main thread is blocked still ends once its launcher is gone
(:mod:`hacrl_fed.worker.orphan_guard`), and leaves the stacks that show where it was stuck."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hacrl_fed.worker.phase import PHASE_FILE_ENV

REPO = Path(__file__).resolve().parents[1]

# the worker stand-in: the guard on, its main thread then blocked for good (what no graceful stop can end)
BLOCKED = (
    "import os, threading\n"
    "from hacrl_fed.worker.orphan_guard import guard_against_orphaning\n"
    "guard_against_orphaning(os.getppid(), bound_s=0.5, poll_s=0.05)\n"
    "print(os.getpid(), flush=True)\n"
    "lock = threading.Lock(); lock.acquire(); lock.acquire()\n"
)
# the launcher stand-in: starts the worker, prints its pid, and dies without stopping it
LAUNCHER = (
    "import subprocess, sys\n"
    "w = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=subprocess.PIPE, text=True)\n"
    "print(w.stdout.readline().strip(), flush=True)\n"
    "import os; os._exit(0)\n"
)


def _running(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def test_a_worker_blocked_for_good_ends_soon_after_its_launcher_and_leaves_its_stacks(tmp_path):
    phase = tmp_path / "b.phase"
    env = dict(os.environ, PYTHONPATH=str(REPO), **{PHASE_FILE_ENV: str(phase)})
    launcher = subprocess.run([sys.executable, "-c", LAUNCHER, BLOCKED], env=env, capture_output=True, text=True,
                              timeout=60, check=True)
    worker = int(launcher.stdout.strip())
    deadline = time.monotonic() + 30
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _running(worker)
    if alive:
        os.kill(worker, 9)
    assert not alive, "the worker outlived its launcher by 30 s"
    stacks = phase.with_suffix(".stacks").read_text()
    assert "gone for 0 s; the graceful stop had not ended" in stacks
    assert "acquire" in stacks or "<module>" in stacks  # the main thread's frame, where it was stuck
