"""``hacrl-fed simulate CONFIG [--set k=v ...] [--run-dir DIR] [--resume] ...``: the whole federation on Flower's
Simulation Engine (:func:`hacrl_fed.flower.simulation.simulate`, how it is wired is described there)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from hacrl_fed.cli.common import UsageError, add_set_flag, parser, run_command
from hacrl_fed.config import ConfigError
from hacrl_fed.flower.settings import SettingsError
from hacrl_fed.flower.simulation import simulate
from hacrl_fed.lifecycle import setup_logging
from hacrl_fed.run_files import SUMMARY_FILE

log = logging.getLogger("hacrl_fed.flower.simulation")
PROG = "hacrl-fed simulate"


def build_parser() -> argparse.ArgumentParser:
    p = parser("simulate", "Run a federation on Flower's Simulation Engine (one node per org).")
    p.add_argument("config", help="YAML run config")
    add_set_flag(p)
    p.add_argument("--run-dir", help="run directory (default: <run_dir>/<name> of the config)")
    p.add_argument("--resume", action="store_true", help="continue the run in the run directory")
    p.add_argument("--num-cpus", type=int, help="CPUs for the simulation (default: all this process may use)")
    p.add_argument("--num-gpus", type=int, help="GPUs for the simulation (default: all CUDA devices)")
    p.add_argument("--app-dir", help="directory with server/ and client/ (default: cwd or the source checkout)")
    p.add_argument(
        "--worker-factory",
        default="",
        metavar="MODULE:CALLABLE",
        help="build in-process workers with this instead of hacrl_fed.worker:build_worker",
    )
    p.add_argument(
        "--discovery-timeout",
        type=float,
        default=0.0,
        help="seconds to wait for every org's node (default: federation.round_timeout_s)",
    )
    p.add_argument("--verbose", action="store_true", help="Flower debug logging")
    p.add_argument("--log-level", default="INFO", help="hacrl-fed's log level (other libraries log warnings only)")
    p.add_argument("--no-progress", action="store_true", help="no per-round progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``hacrl-fed simulate``: 0 on success, 2 on a bad config or argument, 1 when the run failed."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, verbose=args.verbose)
    return run_command(PROG, lambda: _simulate(args), failure_detail=_log_failure)


def _log_failure() -> str:
    log.exception("simulation failed")
    return ""


def _simulate(args: argparse.Namespace) -> int:
    try:
        run_path = simulate(
            args.config,
            args.overrides,
            run_dir=args.run_dir,
            resume=args.resume,
            app_dir=args.app_dir,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
            worker_factory=args.worker_factory,
            discovery_timeout_s=args.discovery_timeout,
            verbose=args.verbose,
            progress=not args.no_progress,
        )
    except ConfigError:  # configuration or build-time: one line, the traceback in a log file
        raise
    except (SettingsError, FileNotFoundError, ValueError) as err:
        raise UsageError(str(err)) from None
    summary = run_path / SUMMARY_FILE
    if summary.is_file():
        print(summary.read_text().rstrip())
    print(f"{PROG}: done; outputs in {run_path} (metrics.jsonl, tb/, accuracy.png, report.html)")
    return 0
