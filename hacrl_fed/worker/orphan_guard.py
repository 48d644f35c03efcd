"""A launched worker never outlives its launcher by more than a bound, whatever its main thread is doing.

``hacrl-fed run --transport grpc`` starts its workers (:mod:`hacrl_fed.coordinator.launcher`) with a parent-death
signal (SIGTERM) and ``HACRL_FED_PARENT_PID``; the worker's main thread polls its parent pid and stops gracefully
(:func:`hacrl_fed.cli.worker.serve_endpoint`). Both paths run on the main thread: a main thread blocked anywhere
(a lock, a write, a call that does not return) leaves an orphan holding a model's memory. That happened once in 11
reruns of tests/test_faults.py::test_cli_killed_mid_run_... (a worker sleeping, parent pid 1, 60 s after its
coordinator's SIGKILL).

:func:`guard_against_orphaning` starts a daemon thread that needs nothing from the main thread: it polls
``os.getppid()`` every :data:`POLL_S`; once the launcher is gone it gives the graceful stop ``bound_s`` seconds,
then writes every thread's stack to ``<phase file>.stacks`` (beside the worker's phase file, so the place the
graceful stop was stuck is on disk) and ends the process with ``os._exit(EXIT_ORPHANED)``. Nothing the run needs is
lost by that exit: a checkpoint is staged and renamed whole (:mod:`hacrl_fed.worker.checkpoint`).
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from pathlib import Path

from hacrl_fed.worker.phase import PHASE_FILE_ENV

PARENT_PID_ENV = "HACRL_FED_PARENT_PID"  # set by the launcher: its pid, which the worker must not outlive
POLL_S = 0.5
EXIT_ORPHANED = 3  # the exit status of a worker the guard ended (no one is left to read it; for tests)


def stacks_path() -> Path | None:
    """``<phase file>.stacks`` of this worker (:data:`~hacrl_fed.worker.phase.PHASE_FILE_ENV`), None without one."""
    phase = os.environ.get(PHASE_FILE_ENV)
    return Path(phase).with_suffix(".stacks") if phase else None


def guard_against_orphaning(parent: int, bound_s: float, *, poll_s: float = POLL_S) -> threading.Thread:
    """Start the daemon thread (module docstring): once ``os.getppid() != parent``, wait ``bound_s`` seconds for
    the graceful stop, then dump the stacks and ``os._exit(EXIT_ORPHANED)``. Returns the started thread."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        time.sleep(bound_s)
        path = stacks_path()
        if path is not None:
            try:
                with path.open("w") as out:
                    out.write(f"launcher (pid {parent}) gone for {bound_s:.0f} s; the graceful stop had not ended\n")
                    faulthandler.dump_traceback(out, all_threads=True)
            except OSError:
                pass
        os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="orphan-guard", daemon=True)
    thread.start()
    return thread
