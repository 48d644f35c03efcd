"""``hacrl-fed``: the command line, one thin module per command over :mod:`hacrl_fed.cli.common`.

- ``hacrl-fed run CONFIG ...`` (:mod:`~hacrl_fed.cli.run`): a federated run driven by the coordinator in this process.
- ``hacrl-fed worker ...`` (:mod:`~hacrl_fed.cli.worker`): serve one org's policy worker over gRPC.
- ``hacrl-fed zoo list | build ...`` (:mod:`~hacrl_fed.cli.zoo`): the tiny built-in models.
- ``hacrl-fed simulate CONFIG ...`` (:mod:`~hacrl_fed.cli.simulate`): the Flower Simulation Engine.
- ``hacrl-fed keys ...`` (:mod:`~hacrl_fed.cli.keys`): TLS certificates, SuperNode auth keys, org identities.
- ``hacrl-fed config --describe [--config FILE]`` (:mod:`~hacrl_fed.cli.config`): every config field.
- ``hacrl-fed export RUN_DIR --org ORG --out DIR`` (:mod:`~hacrl_fed.cli.export`): an org's trained model as a
  transformers folder; ``hacrl-fed eval MODEL_DIR | --run-dir RUN_DIR --org ORG`` (:mod:`~hacrl_fed.cli.eval`):
  greedy accuracy and pass@k on a task's test split.
- ``hacrl-fed report RUN_DIR`` (:mod:`~hacrl_fed.cli.report`): the run's self-contained ``report.html``.
- ``hacrl-fed deploy-local ...`` (:mod:`~hacrl_fed.cli.deploy_local`) and ``hacrl-fed bench ...``
  (:mod:`~hacrl_fed.cli.bench`), ``hacrl-fed gpu-check ...`` (:mod:`~hacrl_fed.cli.gpu_check`): the tools
  (:mod:`hacrl_tools`, loaded only by these commands).

Every command takes ``--set KEY=VALUE ...`` the same way where it takes overrides, and exits 0 (success), 1 (the run
failed) or 2 (bad usage, configuration or build-time error: one line, the traceback in a log file); see
:mod:`hacrl_fed.cli.common`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module under hacrl_fed.cli, help). Each module has main(argv) -> int and imports what it runs lazily.
COMMANDS = {
    "run": ("run", "run a federation with the coordinator in this process"),
    "worker": ("worker", "serve one org's policy worker over gRPC"),
    "zoo": ("zoo", "build or list the tiny built-in agent models"),
    "simulate": ("simulate", "run on the Flower Simulation Engine"),
    "keys": ("keys", "make TLS certs (SuperLink, worker link), SuperNode auth keys and org identities"),
    "deploy-local": ("deploy_local", "a real SuperLink + SuperNodes + workers on loopback"),
    "config": ("config", "describe every config field (--describe) or resolve a config"),
    "bench": ("bench", "benchmarks: learning matrix, report, system costs, against TRL (BENCHMARKS.md)"),
    "gpu-check": ("gpu_check", "the prepared GPU check (scripts/gpu_check.sh)"),
    "export": ("export", "write an org's trained model as a transformers folder"),
    "eval": ("eval", "greedy accuracy and pass@k of a model on a task's test split"),
    "report": ("report", "write RUN_DIR/report.html: the run's self-contained report page"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (for ``--help``); each command parses its own arguments."""
    parser = argparse.ArgumentParser(prog="hacrl-fed", description="Federated RL from verifiable rewards (HACPO).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hacrl-fed`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        module = importlib.import_module(f"hacrl_fed.cli.{COMMANDS[argv[0]][0]}")
        return int(module.main(argv[1:]) or 0)
    parser = build_parser()
    parser.parse_args(argv)  # --help exits 0; an unknown command exits 2
    parser.print_help(sys.stderr)
    return 2
