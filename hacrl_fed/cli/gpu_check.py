"""``hacrl-fed gpu-check [--dry-run] [--out DIR] [--skip-tests] [--skip-vllm] [--budget-s S] [--keep-work]``: the
prepared GPU check (:mod:`hacrl_tools.gpu_check`, a tool: loaded here only), which ``scripts/gpu_check.sh`` runs from
the checkout's root. Exit 0 when no step failed, 1 otherwise, 2 for bad usage or no tools package.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hacrl_fed.cli.common import load_tools, parser, run_command

PROG = "hacrl-fed gpu-check"


def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "gpu-check", "One prepared GPU check (builds a model, gpu tests, federated rounds, vLLM where it works)."
    )
    p.add_argument("--dry-run", action="store_true", help="every step on CPU with a micro model (seconds)")
    p.add_argument("--out", type=Path, default=Path("gpu-check"), help="where gpu_check.json goes (./gpu-check)")
    p.add_argument("--work-dir", type=Path, default=None, help="models and run dirs (default: a temp dir, removed)")
    p.add_argument("--keep-work", action="store_true", help="keep the temporary work dir")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no step after this many seconds")
    p.add_argument("--skip-tests", action="store_true", help="no pytest steps")
    p.add_argument("--skip-vllm", action="store_true", help="no vLLM steps even where vllm imports")
    p.add_argument("--repo", type=Path, default=Path.cwd(), help="the checkout whose tests run (default: cwd)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``hacrl-fed gpu-check``: see the module docstring."""
    args = build_parser().parse_args(argv)

    def work() -> int:
        tool = load_tools("gpu_check", PROG)
        return int(tool.check(tool.Options(**vars(args))))

    return run_command(PROG, work)
