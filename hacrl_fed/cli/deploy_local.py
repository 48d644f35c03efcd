"""``hacrl-fed deploy-local --config configs/smoke.yaml [--tls] [--worker-link auto|unix|tls|insecure] [--workdir DIR]
[--set federation.rounds=2 ...] [--app .] [--timeout-s 1800]``: a real SuperLink, SuperNodes and policy workers on
loopback, one run submitted with ``flwr run`` (:func:`hacrl_tools.deploy_local.run_local`, a tool: loaded here only).

Exit 0 iff the run ends ``finished:completed``, 1 otherwise; 2 for ``--worker-link tls`` without ``--tls``, a bad
config, or no tools package.
"""

from __future__ import annotations

import argparse
from types import ModuleType

from hacrl_fed.cli.common import USAGE, add_set_flag, load_tools, parser, run_command

PROG = "hacrl-fed deploy-local"


def build_parser(harness: ModuleType) -> argparse.ArgumentParser:
    p = parser(
        "deploy-local",
        "A real SuperLink, SuperNodes and policy workers on loopback; one run submitted with flwr run. Exit 0 iff "
        "the run ends finished:completed.",
    )
    p.add_argument("--config", required=True, help="hacrl-fed run config YAML")
    p.add_argument("--tls", action="store_true", help="TLS + SuperNode auth with fresh keys in WORKDIR/keys")
    p.add_argument(
        "--worker-link",
        choices=harness.WORKER_LINKS,
        default="auto",
        help="how SuperNodes reach workers: unix sockets in WORKDIR/sock (auto, when the paths fit), "
        "tls (mutual TLS on loopback TCP; needs --tls) or insecure (plaintext loopback TCP)",
    )
    p.add_argument("--workdir", default=None, help="logs, homes, keys and the run dir (default: a temp dir)")
    add_set_flag(p)
    p.add_argument("--app", default=".", help="the Flower app directory (holding pyproject.toml)")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    return p


def main(argv: list[str] | None = None) -> int:
    """``hacrl-fed deploy-local``: see the module docstring. Returns the exit code."""
    return run_command(PROG, lambda: _deploy(argv))


def _deploy(argv: list[str] | None) -> int:
    harness = load_tools("deploy_local", PROG)
    p = build_parser(harness)
    args = p.parse_args(argv)
    if args.worker_link == "tls" and not args.tls:
        p.exit(USAGE, f"{PROG}: --worker-link tls needs --tls (the worker certificates come with the keys)\n")
    return int(
        harness.run_local(
            args.config,
            workdir=args.workdir,
            tls=args.tls,
            worker_link=args.worker_link,
            overrides=args.overrides,
            app=args.app,
            timeout_s=args.timeout_s,
            out=lambda text: print(text, flush=True),
        )
    )
