"""A sharded stand-in worker for endpoint tests: ``hacrl-fed worker``'s own serve path under torchrun, each rank a
:class:`~helpers_fake_workers.FakeWorker` (no model), one rank misbehaving in ``step``.

``torchrun --nproc-per-node 2 tests/helpers_sharded_faults.py --fault oom --fault-rank 1 [hacrl-fed worker flags]``
(or through :class:`~hacrl_fed.coordinator.launcher.WorkerProcesses` with ``command=[python, this file]``).
Faults: ``oom`` raises ``torch.OutOfMemoryError``; ``hang`` sleeps; ``die`` prints ``rank R in step pid P`` and
sleeps (the test SIGKILLs it). Every rank prints ``rank R pid P`` once built, so a test can check every PID.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from helpers_fake_workers import FakeWorker

from hacrl_fed.cli.common import run_command, say_line
from hacrl_fed.cli.worker import PROG, build_parser, serve
from hacrl_fed.lifecycle import setup_logging


class FaultyWorker(FakeWorker):
    """A FakeWorker whose ``step`` fails the way ``fault`` says (``""``: it does not)."""

    fault: str = ""

    def step(self, request):
        rank = os.environ.get("RANK", "0")
        if self.fault == "oom":
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
        if self.fault in ("hang", "die"):
            say_line(f"rank {rank} in step pid {os.getpid()}")
            time.sleep(3600)
        return super().step(request)


def main(argv: list[str] | None = None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--fault", default="")
    extra.add_argument("--fault-rank", type=int, default=1)
    known, rest = extra.parse_known_args(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    args = p.parse_args(rest)
    args.argv = rest
    setup_logging(args.log_level)

    def factory(cfg, org_id, run_dir, resume):
        rank = int(os.environ.get("RANK", "0"))
        worker = FaultyWorker(org_id)
        worker.fault = known.fault if rank == known.fault_rank else ""
        say_line(f"rank {rank} pid {os.getpid()}")
        return worker

    return run_command(PROG, lambda: serve(args, p, rank_worker=factory))


if __name__ == "__main__":
    raise SystemExit(main())
