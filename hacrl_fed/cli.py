"""``hacrl-fed``: the command line.

- ``hacrl-fed run CONFIG [--transport inprocess|grpc] [--set key=value ...] [--worker ORG=ADDRESS ...]
  [--run-dir DIR] [--resume] [--no-progress]``: a federated run driven by the coordinator in this process.
  ``inprocess`` builds every org's worker here; ``grpc`` starts one ``hacrl-fed worker`` subprocess per org (or
  dials the already-running workers given with ``--worker``). Writes what every entry point writes
  (:mod:`hacrl_fed.lifecycle`: ``config.yaml``, ``run_info.json``, ``metrics.jsonl``, ``tb/``,
  ``coordinator_state.json``, ``accuracy.png``, ``summary.txt``, ``error.log`` on failure) to the run dir (default
  ``<run_dir>/<name>`` from the config), logs one line per round, and prints the final per-org table and the
  run dir's absolute path.
- ``hacrl-fed worker ...``: serve one org's policy worker over gRPC (:func:`hacrl_fed.wire.grpc_server.main_worker`).
- ``hacrl-fed zoo ...``: build / list the tiny built-in models (:func:`hacrl_fed.models.zoo.main_zoo`).
- ``hacrl-fed simulate CONFIG ...``: the Flower Simulation Engine (:func:`hacrl_fed.flower.simulation.main_simulate`).
- ``hacrl-fed config --describe [--config FILE]``: every config field with its type, default and description
  (:func:`hacrl_fed.config_cli.main_config`).
- ``hacrl-fed export RUN_DIR --org ORG --out DIR``: an org's trained model as a transformers folder
  (:func:`hacrl_fed.cli_export_eval.main_export`, :mod:`hacrl_fed.export`).
- ``hacrl-fed eval MODEL_DIR | --run-dir RUN_DIR --org ORG``: greedy accuracy and pass@k on a task's test split
  (:func:`hacrl_fed.cli_export_eval.main_eval`, :mod:`hacrl_fed.evaluate`).

Exit codes: 0 success, 1 the run failed, 2 bad usage, configuration or build-time error (one line naming the bad
field or file; :class:`~hacrl_fed.config.BuildError` and every ``ConfigError``, in every command, with the
traceback in a log file).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hacrl_fed.lifecycle import CLI_KEYS, RunDirError, check_run_dir, setup_logging

log = logging.getLogger("hacrl_fed.cli")

# subcommand -> (module, function, help); each gets the remaining argv and parses it itself
DELEGATES = {
    "worker": ("hacrl_fed.wire.grpc_server", "main_worker", "serve one org's policy worker over gRPC"),
    "zoo": ("hacrl_fed.models.zoo", "main_zoo", "build or list the tiny built-in agent models"),
    "simulate": ("hacrl_fed.flower.simulation", "main_simulate", "run on the Flower Simulation Engine"),
    "keys": (
        "hacrl_fed.security.keys",
        "main_keys",
        "make TLS certs (SuperLink, worker link), SuperNode auth keys and org identities",
    ),
    "deploy-local": ("hacrl_fed.deploy.harness", "main_local", "a real SuperLink + SuperNodes + workers on loopback"),
    "config": ("hacrl_fed.config_cli", "main_config", "describe every config field (--describe) or resolve a config"),
    "bench": (
        "hacrl_fed.bench",
        "main_bench",
        "benchmarks: learning matrix, report, system costs, TRL peer (BENCHMARKS.md)",
    ),
    "export": ("hacrl_fed.cli_export_eval", "main_export", "write an org's trained model as a transformers folder"),
    "eval": ("hacrl_fed.cli_export_eval", "main_eval", "greedy accuracy and pass@k of a model on a task's test split"),
}


class UsageError(Exception):
    """Bad arguments or configuration: exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hacrl-fed", description="Federated RL from verifiable rewards (HACPO).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="run a federation with the coordinator in this process")
    run.add_argument("config", help="run config YAML")
    run.add_argument(
        "--transport",
        choices=("inprocess", "grpc"),
        default=None,
        help="default: federation.transport of the config (grpc when --worker is given)",
    )
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set federation.rounds=3 trainer.lr=1e-5",
    )
    run.add_argument(
        "--worker",
        dest="workers",
        action="append",
        default=[],
        metavar="ORG=ADDRESS",
        help="use an already-running worker (HOST:PORT or unix:/PATH) instead of starting one",
    )
    run.add_argument("--run-dir", default=None, help="default: <config run_dir>/<config name>")
    run.add_argument("--resume", action="store_true", help="continue the run in --run-dir after its last round")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--ready-timeout-s", type=float, default=600.0, help="how long workers may take to start")
    run.add_argument("--log-level", default="INFO")
    for name, (_, _, help_text) in DELEGATES.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _delegate(name: str, argv: list[str]) -> int:
    module, func, _ = DELEGATES[name]
    try:
        entry: Callable[[list[str]], Any] = getattr(importlib.import_module(module), func)
    except ImportError as err:
        print(f"hacrl-fed {name}: unavailable ({err})", file=sys.stderr)
        return 1
    from hacrl_fed.config import ConfigError, report_error

    try:
        rc = entry(argv)
    except ConfigError as err:  # configuration or build-time (BuildError): one line, traceback in a log, exit 2
        return report_error(f"hacrl-fed {name}", err)
    return int(rc or 0)


def parse_worker_addresses(items: list[str], org_ids: list[str]) -> dict[str, str]:
    """``["a=127.0.0.1:5001", "b=unix:/tmp/b.sock"]`` → ``{"a": ..., "b": ...}``; orgs must be configured."""
    out: dict[str, str] = {}
    for item in items:
        org, sep, address = item.partition("=")
        if not sep or not org or not address:
            raise UsageError(f"--worker {item!r} must look like ORG=ADDRESS")
        if org not in org_ids:
            raise UsageError(f"--worker {item!r}: org {org!r} is not in the config (orgs: {org_ids})")
        out[org] = address
    return out


def _worker_flags(run_dir: Path, resume: bool) -> list[str]:
    """``hacrl-fed worker`` flags so each worker checkpoints under the run dir (and resumes with the run)."""
    return ["--run-dir", str(run_dir)] + (["--resume"] if resume else [])


def _grpc_transport(args: argparse.Namespace, cfg, run_dir: Path, stack: ExitStack):
    from hacrl_fed.coordinator.grpc_transport import GrpcTransport
    from hacrl_fed.coordinator.launcher import WorkerProcesses

    org_ids = [o.id for o in cfg.orgs]
    if args.workers:
        addresses = parse_worker_addresses(args.workers, org_ids)  # checked before the run started
    else:
        procs = WorkerProcesses(
            args.config,
            org_ids,
            run_dir=run_dir,
            overrides=args.overrides,
            ready_timeout_s=args.ready_timeout_s,
            worker_args=_worker_flags(run_dir, args.resume),
        )
        stack.callback(procs.close)
        addresses = procs.start()
    transport = GrpcTransport(addresses, max_message_mb=cfg.federation.max_message_mb)
    stack.callback(transport.close)
    ready = transport.wait_ready(args.ready_timeout_s)
    bad = {org: err for org, err in ready.items() if isinstance(err, Exception)}
    for org, err in bad.items():
        log.warning("worker %s at %s is not ready: %s", org, addresses[org], err)
    if len(ready) - len(bad) < cfg.federation.min_orgs:
        raise RuntimeError(
            f"only {len(ready) - len(bad)} of {len(ready)} workers are ready, "
            f"federation.min_orgs={cfg.federation.min_orgs}"
        )
    from hacrl_fed.security.keyring import check_worker_keys

    check_worker_keys(cfg, run_dir, ready, addresses)  # mismatched signing keys: one line now, not failed rounds
    return transport


def _inprocess_transport(cfg, run_dir: Path, resume: bool, stack: ExitStack):
    from hacrl_fed.coordinator.inprocess import InProcessTransport
    from hacrl_fed.worker import build_worker

    transport = InProcessTransport({o.id: build_worker(cfg, o.id, run_dir=run_dir, resume=resume) for o in cfg.orgs})
    stack.callback(transport.close)
    return transport


def _resolve_run(args: argparse.Namespace):
    from hacrl_fed.config import ConfigError, load_config

    args.overrides = [kv for group in args.overrides for kv in group]  # --set a=1 b=2 --set c=3
    try:
        cfg = load_config(args.config, overrides=args.overrides)
    except ConfigError as err:
        raise UsageError(str(err)) from None
    transport = args.transport or ("grpc" if args.workers else cfg.federation.transport)
    if transport == "flower":
        raise UsageError("federation.transport=flower: use `hacrl-fed simulate CONFIG` (or flwr run)")
    if args.workers and transport != "grpc":
        raise UsageError("--worker needs --transport grpc")
    parse_worker_addresses(args.workers, [o.id for o in cfg.orgs])  # bad usage fails before the run dir is used
    run_dir = (Path(args.run_dir) if args.run_dir else Path(cfg.run_dir) / cfg.name).absolute()
    try:
        check_run_dir(run_dir, args.resume, CLI_KEYS)
    except RunDirError as err:
        raise UsageError(str(err)) from None
    return cfg, transport, run_dir


def cmd_run(args: argparse.Namespace) -> int:
    from hacrl_fed.coordinator.loop import FederationError
    from hacrl_fed.lifecycle import Run

    cfg, transport_name, run_dir = _resolve_run(args)
    run = Run(
        cfg,
        run_dir,
        transport=transport_name,
        resume=args.resume,
        keys=CLI_KEYS,
        progress=not args.no_progress,
        entry="hacrl-fed run",
    )
    args.lifecycle = run
    try:
        with run, ExitStack() as stack:
            if transport_name == "grpc":
                transport = _grpc_transport(args, cfg, run_dir, stack)
            else:
                transport = _inprocess_transport(cfg, run_dir, args.resume, stack)
            run.execute(transport)
    except FederationError as err:
        print(f"hacrl-fed run: {err} (traceback in {run.error_log})", file=sys.stderr)
        return 1
    print(run.table)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hacrl-fed`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATES:
        return _delegate(argv[0], argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "run":
        parser.print_help(sys.stderr)
        return 2
    setup_logging(args.log_level)
    from hacrl_fed.config import ConfigError, report_error

    try:
        return cmd_run(args)
    except UsageError as err:
        print(f"hacrl-fed run: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hacrl-fed run: interrupted (continue with --resume)", file=sys.stderr)
        return 1
    except ConfigError as err:  # found while building models or tasks (BuildError): exit 2, traceback kept
        run = getattr(args, "lifecycle", None)
        return report_error("hacrl-fed run", err, log_dir=run.run_dir if run is not None and run.error_log else None)
    except Exception as err:  # the run failed: one line here, the traceback in the run dir's error.log
        detail = _save_traceback(args)
        print(f"hacrl-fed run: failed: {type(err).__name__}: {err}{detail}", file=sys.stderr)
        return 1


def _save_traceback(args: argparse.Namespace) -> str:
    """Where the run's lifecycle saved the traceback (``error.log``); printed here when it had no run dir yet."""
    run = getattr(args, "lifecycle", None)
    if run is not None and run.error_log is not None:
        return f" (traceback in {run.error_log})"
    traceback.print_exc()
    return ""


if __name__ == "__main__":
    sys.exit(main())
