"""``hacrl-fed worker --config RUN.yaml [--org ID] --listen ADDRESS [LINK FLAGS] [--set K=V ...] [--run-dir DIR]
[--resume]``: build one org's worker (:func:`hacrl_fed.worker.build_worker`) and serve it over gRPC
(:func:`hacrl_fed.wire.grpc_server.serve_worker`) until SIGTERM / SIGINT; the link rules are those of
:mod:`hacrl_fed.wire.grpc_server`. An org with ``sharding.ranks > 1`` runs this command under torchrun, one
process per rank (``torchrun --nproc-per-node N -m hacrl_fed.cli worker ...``): rank 0 serves, every rank computes
(:mod:`hacrl_fed.sharded.endpoint`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from hacrl_fed.cli.common import USAGE, add_set_flag, parser, run_command, say_line
from hacrl_fed.wire.grpc_server import ListenError, WorkerTLS, check_listen, describe_worker, serve_worker
from hacrl_fed.worker.orphan_guard import PARENT_PID_ENV, guard_against_orphaning

if TYPE_CHECKING:
    from hacrl_fed.worker.api import WorkerAPI

log = logging.getLogger("hacrl_fed.wire.grpc_server")
PROG = "hacrl-fed worker"
ORPHAN_MARGIN_S = 15.0  # the orphan guard's bound: --grace-s plus this (the graceful stop's own wait is grace + 5)


def add_link_args(p: argparse.ArgumentParser) -> None:
    """The ``--listen`` / TLS / ``--insecure`` flags of ``hacrl-fed worker`` (also used by test stand-ins)."""
    p.add_argument(
        "--listen",
        required=True,
        metavar="ADDRESS",
        help="unix:/PATH (recommended), or HOST:PORT (port 0 = any free) with --tls-* or --insecure",
    )
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="this worker's TLS certificate (TCP listen)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="CA certificate that signs the allowed clients")
    p.add_argument(
        "--tls-client-name",
        dest="tls_client_names",
        action="append",
        default=[],
        metavar="NAME",
        help="accept only client certificates with this common name (repeatable; e.g. acme-client)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext TCP; allowed only on a loopback host (127.0.0.0/8, ::1, localhost); every call must carry "
        "the link secret (--secret-file)",
    )
    p.add_argument(
        "--secret-file",
        default=None,
        metavar="FILE",
        help="the link secret (mode 0600) every call must carry; read when it exists, else created; with "
        "--insecure and no --secret-file a fresh one is created and its path printed",
    )


def link_settings(args: argparse.Namespace) -> tuple[WorkerTLS | None, bool]:
    """``(tls, insecure)`` from :func:`add_link_args` flags, checked against ``args.listen`` (ListenError)."""
    given = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-ca": args.tls_ca}
    missing = [flag for flag, value in given.items() if not value]
    if len(missing) not in (0, 3):
        raise ListenError(f"--tls-cert, --tls-key and --tls-ca go together: missing {', '.join(missing)}")
    if missing and args.tls_client_names:
        raise ListenError("--tls-client-name needs --tls-cert, --tls-key and --tls-ca")
    tls = None if missing else WorkerTLS(args.tls_cert, args.tls_key, args.tls_ca, tuple(args.tls_client_names))
    check_listen(args.listen, tls=tls, insecure=args.insecure, require_flag=True)
    if tls is not None:
        tls.server_credentials()  # unreadable files fail now, before a model is loaded
    return tls, args.insecure


def link_secret(args: argparse.Namespace, org: str) -> str | None:
    """The link secret from :func:`add_link_args` flags: ``--secret-file`` (read, or created), or for
    ``--insecure`` a fresh one whose path is printed (``hacrl-fed worker ORG link secret in PATH``); None for a
    unix socket or mutual TLS without ``--secret-file``. SecretError (a ValueError) for an unusable file."""
    if args.secret_file is None and not args.insecure:
        return None
    from hacrl_fed.wire.link_secret import worker_secret

    secret, path = worker_secret(args.secret_file)
    say_line(f"hacrl-fed worker {org} link secret in {path}")
    return secret


def build_parser() -> argparse.ArgumentParser:
    p = parser("worker", "Serve one organization's policy worker.")
    p.add_argument("--config", required=True, help="run config YAML (or a one-org config) naming this org")
    p.add_argument("--org", default=None, help="org id in the config (optional when it lists exactly one org)")
    add_link_args(p)
    add_set_flag(p, "--override", help="config override, as for hacrl-fed run")
    p.add_argument("--run-dir", default=None, help="passed to build_worker (where checkpoints go)")
    p.add_argument("--resume", action="store_true", help="passed to build_worker: resume from the latest checkpoint")
    p.add_argument("--max-message-mb", type=int, default=None, help="default: federation.max_message_mb")
    p.add_argument("--grace-s", type=float, default=10.0, help="how long a stop waits for in-flight calls")
    p.add_argument("--log-level", default="INFO")
    return p


def _pick_org(cfg: Any, org: str | None) -> str:
    ids = [o.id for o in cfg.orgs]
    if org is None:
        if len(ids) != 1:
            raise ValueError(f"--org is required: the config lists {len(ids)} orgs {ids}")
        return ids[0]
    if org not in ids:
        raise ValueError(f"--org {org!r} is not in the config (orgs: {ids})")
    return org


def _close(worker: WorkerAPI) -> None:
    close = getattr(worker, "close", None)
    if callable(close):
        close()


def main(argv: list[str] | None = None) -> int:
    """``hacrl-fed worker``: build this org's worker, serve it, stop gracefully on SIGTERM / SIGINT.

    Prints ``hacrl-fed worker <org> listening on <address>`` (flushed) once it accepts calls. Exits 2, with one
    line on stderr, for a bad config or org, or a listen address / TLS setting the link rules refuse.
    """
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the torchrun command a sharded org needs
    from hacrl_fed.lifecycle import setup_logging

    setup_logging(args.log_level)
    return run_command(PROG, lambda: serve(args, p))


def serve(
    args: argparse.Namespace, p: argparse.ArgumentParser, *, rank_worker: Callable[..., WorkerAPI] | None = None
) -> int:
    """The command's work: check the link and config, build the worker, serve until stopped. Under torchrun (an
    org with ``sharding.ranks > 1``) each rank goes to :func:`hacrl_fed.sharded.endpoint.serve_ranks`, which builds
    its worker with ``rank_worker`` (default :func:`hacrl_fed.sharded.dispatch.rank_worker`)."""
    from hacrl_fed.config import ConfigError, load_config
    from hacrl_fed.preflight import check_settings
    from hacrl_fed.sharded.group import check_launch, torchrun_env

    try:
        env = torchrun_env()
        # the link (TLS files, listen address) is rank 0's alone: other ranks, maybe on other nodes, never bind
        tls, insecure = link_settings(args) if env is None or env.rank == 0 else (None, False)
        cfg = load_config(args.config, overrides=args.overrides)
        org_id = _pick_org(cfg, args.org)
        sharded = check_launch(cfg, org_id, env, getattr(args, "argv", []))
        check_settings(cfg, [org_id])  # what building the worker would refuse, before any weights load
    except (ConfigError, ValueError) as err:
        p.exit(USAGE, f"{PROG}: {err}\n")
    if sharded:
        return _serve_rank(args, p, cfg, org_id, env, link=(tls, insecure), rank_worker=rank_worker)
    stop = stop_on_signals()
    parent = os.environ.get(PARENT_PID_ENV)  # set by the launcher: never outlive it by more than a bound
    if parent:
        guard_against_orphaning(int(parent), bound_s=args.grace_s + ORPHAN_MARGIN_S)
    from hacrl_fed.worker import build_worker  # heavy (torch, model); only the real entry point needs it

    extra = {"run_dir": args.run_dir} if args.run_dir is not None else {}
    if args.resume:
        extra["resume"] = True
    worker = rank_worker(cfg, org_id, args.run_dir, args.resume) if rank_worker else build_worker(cfg, org_id, **extra)
    log.info("hacrl-fed worker serves %s", describe_worker(worker))
    return serve_endpoint(args, p, cfg, org_id, worker, link=(tls, insecure), stop=stop)


def _serve_rank(
    args: argparse.Namespace,
    p: argparse.ArgumentParser,
    cfg: Any,
    org_id: str,
    env: Any,
    *,
    link: tuple[WorkerTLS | None, bool],
    rank_worker: Callable[..., WorkerAPI] | None,
) -> int:
    """One rank of a sharded worker (:func:`hacrl_fed.sharded.endpoint.serve_ranks`); rank 0 serves the endpoint."""
    from hacrl_fed.sharded.dispatch import rank_worker as default_factory
    from hacrl_fed.sharded.endpoint import serve_ranks

    factory = rank_worker or default_factory

    def endpoint(dispatcher: Any, halt: Any) -> int:
        return serve_endpoint(args, p, cfg, org_id, dispatcher, link=link, stop=stop_on_signals(), halt=halt)

    def build() -> Any:
        return factory(cfg, org_id, args.run_dir, bool(args.resume))

    return serve_ranks(cfg, org_id, env, build=build, serve=endpoint)


def stop_on_signals() -> threading.Event:
    """An event SIGTERM / SIGINT set (the graceful stop of :func:`serve_endpoint`). The handler sets it from a new
    thread: a handler runs on the main thread between two bytecodes, maybe while that thread holds the event's own
    lock inside ``stop.wait`` (a plain, non-reentrant lock), and ``stop.set()`` there would wait for it forever."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: threading.Thread(target=stop.set, daemon=True).start())
    return stop


def serve_endpoint(
    args: argparse.Namespace,
    p: argparse.ArgumentParser,
    cfg: Any,
    org_id: str,
    worker: WorkerAPI,
    *,
    link: tuple[WorkerTLS | None, bool],
    stop: threading.Event,
    halt: Any = None,
) -> int:
    """Serve ``worker`` over gRPC on ``args.listen`` until ``stop`` is set, the launcher is gone or ``halt()`` is
    true; print the ready line once it accepts calls; stop gracefully and close the worker. An org with
    a benchmark slowdown ``HACRL_FED_BENCH_SLOWDOWN`` is served paced (:mod:`hacrl_fed.worker.pacing`; a sharded
    org: rank 0's dispatcher)."""
    max_mb = args.max_message_mb or cfg.federation.max_message_mb
    from hacrl_fed.wire.bounds import max_request_bytes, worker_limits
    from hacrl_fed.worker.pacing import paced, slowdowns

    worker = paced(worker, slowdowns(cfg).get(org_id, 1.0))

    try:
        server = serve_worker(
            worker,
            args.listen,
            tls=link[0],
            insecure=link[1],
            max_message_mb=max_mb,
            secret=link_secret(args, org_id),
            max_receive_bytes=max_request_bytes(cfg, org_id),
            limits=worker_limits(cfg),
        )
    except (ValueError, RuntimeError) as err:
        _close(worker)
        p.exit(USAGE, f"{PROG}: {err}\n")
    say_line(f"hacrl-fed worker {org_id} listening on {server.address}")  # the one ready line
    parent = os.environ.get(PARENT_PID_ENV)  # set by the launcher: stop when it is gone
    while not stop.wait(0.5):
        if parent and os.getppid() != int(parent):
            log.warning("launcher (pid %s) is gone: stopping", parent)
            break
        if halt is not None and halt():
            break
    log.info("stopping (grace %.1f s)", args.grace_s)
    stopped = server.stop(args.grace_s)
    if parent:  # started by the launcher: it waits for nothing this process would tear down
        _exit_launched(stopped, worker, args.grace_s)
    stopped.wait()
    _close(worker)
    return 0


def _exit_launched(stopped: threading.Event, worker: WorkerAPI, grace_s: float) -> NoReturn:
    """A worker the launcher started (:mod:`hacrl_fed.coordinator.launcher`) stops when the launcher SIGTERMs it
    (its ``close()``, or the parent-death signal of a killed launcher) or is gone: it closes the worker once its
    calls returned (gRPC cancels them after ``grace_s``), then exits with ``os._exit``, skipping the interpreter's
    teardown. Measured on this 2-core machine under load: a worker whose coordinator was SIGKILLed spent under 3 s
    stopping and then about 6 s in that teardown's garbage collection (torch's and gRPC's objects), unbounded
    under more load; a minute of it failed tests/test_faults.py::test_cli_killed_mid_run_... (a worker outlived
    its coordinator by 60 s). The parent-death signal comes while the killed launcher's other threads still
    exit, so the parent pid does not tell an orphan yet. A call cut short loses nothing the run needs: a
    checkpoint is staged and renamed whole (:mod:`hacrl_fed.worker.checkpoint`)."""
    if stopped.wait(grace_s + 5.0):  # every call returned: nothing uses the worker any more
        _close(worker)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a killed launcher's end of the pipe is gone
            pass
    os._exit(0)
