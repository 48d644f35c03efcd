"""What this machine offers the process (kept apart from torch so launchers can ask cheaply)."""

from __future__ import annotations

import os


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one, else the machine's count (>= 1)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS / Windows
        return os.cpu_count() or 1
