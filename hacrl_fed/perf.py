"""Per-phase performance metrics of a policy worker: ``perf/<phase>/...`` (phases: generate, score, train).

A :class:`PhaseMeter` times consecutive phases and reports for each one

- ``perf/<phase>/seconds`` and ``perf/<phase>/tokens`` (what the phase processed: generated response tokens,
  re-tokenized foreign tokens, prompt + response tokens trained on) and ``perf/<phase>/tokens_per_s``;
- on CUDA ``perf/<phase>/peak_gpu_mem_mb``: ``torch.cuda.max_memory_allocated`` during the phase (the peak is
  reset when the phase starts);
- elsewhere ``perf/<phase>/peak_rss_mb``: the process's peak resident set size during the phase. On Linux the
  kernel's peak (``VmHWM``) is reset when the phase starts (``echo 5 > /proc/self/clear_refs``) and read when it
  ends: one small write and one read of ``/proc/self/status`` per phase. Where it cannot be reset (another OS) it is
  ``resource``'s ``ru_maxrss``, the running maximum so far. It is the process's: in-process, every org's weights
  that live in it count.
"""

from __future__ import annotations

import sys
import time

import torch


def peak_rss_mb() -> float | None:
    """Peak resident set size of this process in MiB (since :func:`reset_peak_rss` where that worked), or None
    where neither ``/proc`` nor ``resource`` is available."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm / 2**10
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak RSS of this process to its current RSS (Linux ``clear_refs`` 5); False where it
    cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhaseMeter:
    """Times phases that follow each other on ``device``; :meth:`lap` closes one and starts the next."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._start = time.perf_counter()
        self._reset_peak()

    def _reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_peak_rss()

    def lap(self, phase: str, tokens: float) -> dict[str, float]:
        """Metrics of the phase that ends now (``tokens`` processed in it); the next phase starts now."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        seconds = now - self._start
        out = {
            f"perf/{phase}/seconds": seconds,
            f"perf/{phase}/tokens": float(tokens),
            f"perf/{phase}/tokens_per_s": float(tokens) / seconds if seconds > 0 else 0.0,
        }
        if self.cuda:
            out[f"perf/{phase}/peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            rss = peak_rss_mb()
            if rss is not None:
                out[f"perf/{phase}/peak_rss_mb"] = rss
        self._reset_peak()
        self._start = time.perf_counter()
        return out


class CpuTally:
    """CPU seconds of this process (all its threads: ``time.process_time``) summed per named part of a phase, for
    a cost breakdown: ``with tally("generate"): ...`` adds to ``cpu/<prefix>_generate``; :meth:`take` returns the
    sums and starts over. Parts must not nest (each second is counted once)."""

    def __init__(self, prefix: str):
        self.prefix, self.sums = prefix, dict[str, float]()

    def __call__(self, part: str) -> _Lap:
        return _Lap(self, part)

    def take(self) -> dict[str, float]:
        """``{"cpu/<prefix>_<part>": seconds}`` since the last take."""
        out = {f"cpu/{self.prefix}_{k}": v for k, v in self.sums.items()}
        self.sums = {}
        return out


class _Lap:
    def __init__(self, tally: CpuTally, part: str):
        self.tally, self.part = tally, part

    def __enter__(self) -> None:
        self.c0 = time.process_time()

    def __exit__(self, *exc: object) -> None:
        sums = self.tally.sums
        sums[self.part] = sums.get(self.part, 0.0) + time.process_time() - self.c0
