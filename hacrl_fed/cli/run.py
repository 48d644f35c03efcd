"""``hacrl-fed run CONFIG [--transport inprocess|grpc] [--set key=value ...] [--worker ORG=ADDRESS ...]
  [--run-dir DIR] [--resume | --fork RUN_DIR@ROUND] [--no-progress]``: a federated run driven by the coordinator in
  this process (``--fork``: a new run from a round of an earlier one, :mod:`hacrl_fed.fork`).
  ``inprocess`` builds every org's worker here; ``grpc`` starts one ``hacrl-fed worker`` subprocess per org (or
  dials the already-running workers given with ``--worker``). Writes what every entry point writes
  (:mod:`hacrl_fed.lifecycle`: ``config.yaml``, ``run_info.json``, ``metrics.jsonl``, ``tb/``,
  ``coordinator_state.json``, ``accuracy.png``, ``summary.txt``, ``error.log`` on failure) to the run dir (default
  ``<run_dir>/<name>`` from the config), logs one line per round, and prints the final per-org table and the
  run dir's absolute path.

Exit codes as every command (:mod:`hacrl_fed.cli.common`): 0, 1 the run failed, 2 bad usage, configuration or
build-time error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from contextlib import ExitStack
from pathlib import Path

from hacrl_fed.cli.common import UsageError, add_set_flag, parser, run_command
from hacrl_fed.lifecycle import CLI_KEYS, RunDirError, check_run_dir, setup_logging

log = logging.getLogger("hacrl_fed.cli")


def build_parser() -> argparse.ArgumentParser:
    run = parser("run", "Run a federation with the coordinator in this process.")
    run.add_argument("config", help="run config YAML")
    run.add_argument(
        "--transport",
        choices=("inprocess", "grpc"),
        default=None,
        help="default: federation.transport of the config (grpc when --worker is given)",
    )
    add_set_flag(run)
    run.add_argument(
        "--worker",
        dest="workers",
        action="append",
        default=[],
        metavar="ORG=ADDRESS",
        help="use an already-running worker (HOST:PORT or unix:/PATH) instead of starting one",
    )
    run.add_argument(
        "--worker-secret",
        dest="worker_secrets",
        action="append",
        default=[],
        metavar="ORG=FILE",
        help="the link secret file an --insecure worker printed (hacrl-fed worker ORG link secret in FILE)",
    )
    run.add_argument("--run-dir", default=None, help="default: <config run_dir>/<config name>")
    run.add_argument("--resume", action="store_true", help="continue the run in --run-dir after its last round")
    run.add_argument(
        "--fork",
        default=None,
        metavar="RUN_DIR@ROUND",
        help="start a new run (own run id and run dir) from round ROUND of the run in RUN_DIR; only the learning "
        "rate, rounds, evaluation and logging may differ from its config",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--ready-timeout-s", type=float, default=600.0, help="how long workers may take to start")
    run.add_argument("--log-level", default="INFO")
    return run


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


def worker_secrets(items: list[str], org_ids: list[str]) -> dict[str, str]:
    """``["a=/path/a.secret"]`` → ``{"a": <the secret in that file>}`` (the link secrets of ``--insecure`` workers)."""
    from hacrl_fed.wire.link_secret import read_secret_file

    out = {}
    for item in items:
        org, sep, path = item.partition("=")
        if not sep or org not in org_ids or not path:
            raise UsageError(f"--worker-secret {item!r} must look like ORG=FILE with ORG in the config ({org_ids})")
        try:
            out[org] = read_secret_file(path)
        except ValueError as err:
            raise UsageError(f"--worker-secret {org}={path}: {err}") from None
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
        secrets = worker_secrets(args.worker_secrets, org_ids)
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
        addresses, secrets = procs.start(), procs.secrets
    transport = GrpcTransport(addresses, max_message_mb=cfg.federation.max_message_mb, secrets=secrets)
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

    try:
        cfg = load_config(args.config, overrides=args.overrides)
    except ConfigError as err:
        raise UsageError(str(err)) from None
    transport = args.transport or ("grpc" if args.workers else cfg.federation.transport)
    if transport == "flower":
        raise UsageError("federation.transport=flower: use `hacrl-fed simulate CONFIG` (or flwr run)")
    if args.workers and transport != "grpc":
        raise UsageError("--worker needs --transport grpc")
    given = parse_worker_addresses(args.workers, [o.id for o in cfg.orgs])  # bad usage: before the run dir is used
    if transport == "inprocess":
        from hacrl_fed.sharded.group import check_in_process
        from hacrl_fed.worker.pacing import refuse_emulated_slowdown

        try:
            check_in_process(cfg, "inprocess")
            refuse_emulated_slowdown(cfg, "--transport inprocess")
        except ConfigError as err:  # ShardingError is one
            raise UsageError(str(err)) from None
    from hacrl_fed.memory_estimate import check_memory
    from hacrl_fed.preflight import check_settings

    try:  # what the workers this command builds or starts would refuse: now, before any of them starts
        here = [o.id for o in cfg.orgs if o.id not in given]
        check_settings(cfg, here)
        check_memory(cfg, here, one_process=transport == "inprocess")  # a plan that cannot fit this host
    except ConfigError as err:
        raise UsageError(str(err)) from None
    run_dir = (Path(args.run_dir) if args.run_dir else Path(cfg.run_dir) / cfg.name).absolute()
    try:
        check_run_dir(run_dir, args.resume, CLI_KEYS)
    except RunDirError as err:
        raise UsageError(str(err)) from None
    if args.fork is not None:
        _fork(args, cfg, run_dir)
    return cfg, transport, run_dir


def _fork(args: argparse.Namespace, cfg, run_dir: Path) -> None:
    """``--fork RUN_DIR@ROUND``: write the new run's starting point into ``run_dir`` (:mod:`hacrl_fed.fork`); the
    run then goes on as a resume of it."""
    from hacrl_fed.config import ConfigError
    from hacrl_fed.coordinator.loop import make_run_id
    from hacrl_fed.fork import parse_fork, prepare_fork

    if args.resume:
        raise UsageError("--fork starts a new run: it cannot be combined with --resume")
    try:
        source, round = parse_fork(args.fork)
        prepare_fork(cfg, source, round, run_dir, make_run_id(cfg))
    except (ValueError, ConfigError) as err:  # ConfigError is a ValueError too
        raise UsageError(str(err)) from None
    args.resume = True


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
                if args.resume and args.fork is None and cfg.federation.staleness >= 1:
                    from hacrl_fed.coordinator.async_state import align_checkpoints

                    align_checkpoints(run_dir)  # the workers back to the last quiescent state, before they are built
                transport = _inprocess_transport(cfg, run_dir, args.resume, stack)
            run.execute(transport)
    except FederationError as err:
        print(f"hacrl-fed run: {err} (traceback in {run.error_log})", file=sys.stderr)
        return 1
    print(run.table)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``hacrl-fed run``; returns the exit code."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)

    def run_dir() -> Path | None:  # where a build-time error's traceback goes: the run dir, once it holds one
        run = getattr(args, "lifecycle", None)
        return run.run_dir if run is not None and run.error_log else None

    return run_command(
        "hacrl-fed run",
        lambda: cmd_run(args),
        log_dir=run_dir,
        failure_detail=lambda: _save_traceback(args),
        interrupted=" (continue with --resume)",
    )


def _save_traceback(args: argparse.Namespace) -> str:
    """Where the run's lifecycle saved the traceback (``error.log``); printed here when it had no run dir yet."""
    run = getattr(args, "lifecycle", None)
    if run is not None and run.error_log is not None:
        return f" (traceback in {run.error_log})"
    traceback.print_exc()
    return ""
