"""``hacrl-fed report RUN_DIR``: write ``RUN_DIR/report.html``, the run's self-contained report page
(:mod:`hacrl_fed.report`). Runs at any time: during a run it shows the rounds written so far (run it again to
refresh); every run also writes it at its end. Prints the page's path; exits 2 when RUN_DIR holds no metrics.jsonl.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hacrl_fed.cli.common import UsageError, parser, run_command

PROG = "hacrl-fed report"


def build_parser() -> argparse.ArgumentParser:
    p = parser("report", "Write RUN_DIR/report.html: curves, the intake matrix, trust events, phase times, rollouts.")
    p.add_argument("run_dir", help="the run directory (with metrics.jsonl)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``hacrl-fed report``: prints the page written. Returns the exit code."""
    args = build_parser().parse_args(argv)
    return run_command(PROG, lambda: _report(Path(args.run_dir)))


def _report(run_dir: Path) -> int:
    from hacrl_fed.report import write_report

    if not (run_dir / "metrics.jsonl").is_file():
        raise UsageError(f"{run_dir} holds no metrics.jsonl (not a run folder, or the run has not started)")
    print(write_report(run_dir))
    return 0
