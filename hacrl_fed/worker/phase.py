"""The phase a worker is in, so that a worker that dies or runs out of memory is reported with its org and phase.

Each of the worker's calls (``load``, ``generate``, ``train``, ``evaluate``, ``checkpoint``) runs inside
:func:`phase`, which

- records the phase per org in this process (:func:`current`);
- when the environment names a phase file (:data:`PHASE_FILE_ENV`, set by the launcher for each worker it
  starts: ``<run_dir>/logs/<org>.phase``), writes ``<phase> <peak RSS KiB>`` there: one short write per call, the
  heartbeat the launcher reads when the worker process is killed (a SIGKILL leaves no last words);
- turns an allocation failure (``MemoryError``, or torch's ``RuntimeError`` "can't allocate memory" / "out of
  memory") into :class:`OutOfMemory`, one line naming the org, the phase and the peak RSS against the machine's
  memory: what an in-process run reports for that org.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from hacrl_fed.perf import peak_rss_mb

PHASE_FILE_ENV = "HACRL_FED_PHASE_FILE"
_ALLOCATION = re.compile(r"can't allocate memory|out of memory|DefaultCPUAllocator|std::bad_alloc", re.IGNORECASE)
_current: dict[str, str] = {}
F = TypeVar("F", bound=Callable[..., Any])


class OutOfMemory(MemoryError):
    """An allocation failed in an org's phase: the message is one line naming both (module doc)."""


def peak_rss_kib() -> int:
    """This process's peak resident set size in KiB, since the current phase's start where the peak can be reset
    (:func:`hacrl_fed.perf.peak_rss_mb`); 0 where unknown."""
    mb = peak_rss_mb()
    return int(mb * 1024) if mb is not None else 0


def total_memory_kib() -> int | None:
    """The machine's memory in KiB (``MemTotal`` of ``/proc/meminfo``; else ``sysconf``), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1])
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 1024
    except (ValueError, OSError, AttributeError):
        return None


def gib(kib: float) -> str:
    return f"{kib / 2**20:.1f} GiB"


def memory_note(peak_kib: int | None) -> str:
    """``peak RSS X GiB of Y GiB`` (the machine's memory), or ``peak RSS unknown``."""
    total = total_memory_kib()
    if not peak_kib:
        return "peak RSS unknown"
    return f"peak RSS {gib(peak_kib)}" + (f" of {gib(total)}" if total else "")


def current(org: str) -> str | None:
    """The phase ``org``'s worker in this process is in (or last entered), None before its first."""
    return _current.get(org)


def enter(org: str, name: str) -> None:
    """Record that ``org`` enters phase ``name`` (module doc); writes the phase file when the environment names one
    (rank 0 of a sharded org only)."""
    _current[org] = name
    path = os.environ.get(PHASE_FILE_ENV)
    if path and os.environ.get("RANK", "0") == "0":
        try:
            with open(path, "w") as f:
                f.write(f"{name} {peak_rss_kib()}\n")
        except OSError:  # a heartbeat must never fail the call it reports on
            pass


def read_phase_file(path: str | os.PathLike) -> tuple[str | None, int | None]:
    """``(phase, peak RSS KiB)`` a worker last wrote to its phase file, ``(None, None)`` when there is none."""
    try:
        words = open(path).read().split()
    except OSError:
        return None, None
    if not words:
        return None, None
    return words[0], int(words[1]) if len(words) > 1 and words[1].isdigit() else None


def allocation_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failed allocation (``MemoryError``, or torch's allocator's ``RuntimeError``)."""
    return isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and bool(_ALLOCATION.search(str(err))))


@contextmanager
def phase(org: str, name: str) -> Iterator[None]:
    """Run the block as ``org``'s phase ``name`` (module doc)."""
    enter(org, name)
    try:
        yield
    except OutOfMemory:
        raise
    except (MemoryError, RuntimeError) as err:
        if not allocation_failure(err):
            raise
        first = (str(err).strip().splitlines() or [""])[0][:200]
        note = memory_note(peak_rss_kib())
        why = f"{type(err).__name__}: {first}"
        raise OutOfMemory(f"org {org!r} ran out of memory in phase {name} ({note}): {why}") from err


def in_phase(name: str) -> Callable[[F], F]:
    """Decorate a worker method (``self.org_id``) so that it runs as phase ``name`` (:func:`phase`)."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(self, *args: Any, **kwargs: Any) -> Any:
            with phase(self.org_id, name):
                return method(self, *args, **kwargs)

        return run  # type: ignore[return-value]

    return wrap
