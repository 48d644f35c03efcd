"""A launched worker that dies while the run goes on is reported in one line: org, phase, signal, peak memory.

The kernel's OOM killer sends SIGKILL, which leaves the worker no last words. So the launcher's
:class:`DeathWatch` thread reaps each worker itself (``os.wait4(pid, WNOHANG)`` every :data:`POLL_S` seconds: the
exit status and the resource usage of the dead process, its peak RSS ``ru_maxrss`` included) and reads the phase
the worker last entered from its phase file (:mod:`hacrl_fed.worker.phase`). The line::

    worker 'gemma' (pid 4242) was killed by SIGKILL in phase train (likely out of memory: peak RSS 11.2 GiB of
    23.4 GiB) (log: <run_dir>/logs/gemma.log)

(another signal: ``was killed by SIGTERM in phase ... (peak RSS ...)``; an exit of its own: ``exited with code N in
phase ...: <its own error line>``; a sharded org's torchrun agent reports a rank's signal as ``exitcode : -9``,
read from its log) is appended to ``<run_dir>/error.log`` and printed to stderr, once per worker. The round's own
bookkeeping goes on as before (the org is ``unreachable`` from then on; ``federation.min_orgs`` decides whether
the run continues).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from hacrl_fed.run_files import ERROR_LOG
from hacrl_fed.worker.phase import memory_note, read_phase_file

POLL_S = 0.2
_RANK_SIGNAL = re.compile(r"exitcode\s*:\s*-(\d+)")  # torch.distributed.run's report of a rank killed by a signal


def phase_file_of(run_dir: Path, org: str) -> Path:
    """Where the launcher tells ``org``'s worker to write its phase: ``<run_dir>/logs/<org>.phase``."""
    return run_dir / "logs" / f"{org}.phase"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class LaunchedWorker(Protocol):
    """What a death line reads of a launched worker (the launcher's ``_Worker``)."""

    org_id: str
    proc: subprocess.Popen[Any]
    tail: Iterable[str]
    log_path: Path

    @property
    def error_line(self) -> str | None: ...


def death_line(worker: LaunchedWorker, code: int, peak_kib: int | None, run_dir: Path) -> str:
    """The one line for ``worker`` (a launcher ``_Worker``) that exited with ``code`` (``-N``: signal ``N``)."""
    phase, phase_peak = read_phase_file(phase_file_of(run_dir, worker.org_id))
    peak = max(peak_kib or 0, phase_peak or 0) or None
    where = f"in phase {phase or 'unknown (it reported none)'}"
    if code >= 0:  # a sharded org's agent exits 1 when a rank was killed: the rank's signal is in its log
        ranks = [int(m.group(1)) for line in worker.tail if (m := _RANK_SIGNAL.search(line))]
        code = -ranks[0] if ranks else code
    head = f"worker {worker.org_id!r} (pid {worker.proc.pid})"
    if code < 0:
        name = _signal_name(-code)
        note = memory_note(peak)
        note = f"likely out of memory: {note}" if -code == signal.SIGKILL else note
        return f"{head} was killed by {name} {where} ({note}) (log: {worker.log_path})"
    own = f": {worker.error_line}" if worker.error_line else ""
    return f"{head} exited with code {code} {where}{own} (log: {worker.log_path})"


def _reap(pid: int) -> tuple[int, int] | None:
    """``(exit code, peak RSS KiB)`` of child ``pid`` if it has exited (reaping it), else None."""
    try:
        got, status, usage = os.wait4(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if got == 0:
        return None
    peak = usage.ru_maxrss // 1024 if sys.platform == "darwin" else usage.ru_maxrss  # KiB
    return os.waitstatus_to_exitcode(status), int(peak)


class DeathWatch:
    """The thread that watches ``workers`` (``{org: _Worker}``) of a run in ``run_dir`` (module doc).
    ``lines`` holds what it reported, by org."""

    def __init__(self, run_dir: Path, workers: dict[str, Any]) -> None:
        self.run_dir, self.workers = Path(run_dir), dict(workers)
        self.lines: dict[str, str] = {}
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # stop() waits for a report in progress
        self._thread = threading.Thread(target=self._watch, name="worker-deaths", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            with self._lock:
                if self._stopped.is_set():
                    return
                for org, w in self.workers.items():
                    if org not in self.lines and w.proc.returncode is None and (done := _reap(w.proc.pid)):
                        w.proc.returncode = done[0]  # reaped here: Popen must not wait for it again
                        w.reader.join(timeout=2.0)  # its last log lines (a sharded org's rank signal)
                        self.report(org, death_line(w, done[0], done[1], self.run_dir))

    def report(self, org: str, line: str) -> None:
        """Append ``line`` to the run's error.log and print it (once per org)."""
        self.lines[org] = line
        with (self.run_dir / ERROR_LOG).open("a") as f:
            f.write(line + "\n")
        print(f"hacrl-fed run: {line}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        """Stop watching (the launcher is about to stop the workers itself); idempotent."""
        with self._lock:
            self._stopped.set()
        self._thread.join(timeout=5.0)
