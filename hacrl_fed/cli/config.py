"""``hacrl-fed config``: what every config field means, and what a config file resolves to.

- ``hacrl-fed config --describe``: every section and field of the run config (:mod:`hacrl_fed.config`) with its
  type, constraints, default and description (:func:`hacrl_fed.config_describe.describe`).
- ``hacrl-fed config --describe --config RUN.yaml [--set key=value ...]``: the same, with each field's resolved
  value in that config (``*`` marks a value other than the default; per-org values are listed by org).
- ``hacrl-fed config --config RUN.yaml [--set key=value ...]``: the resolved, validated config as YAML.

Exit codes: 0, or 2 for a config that does not validate (one line naming the field).
"""

from __future__ import annotations

import argparse

from hacrl_fed.cli.common import add_set_flag, parser, run_command
from hacrl_fed.config import load_config
from hacrl_fed.config_describe import describe

PROG = "hacrl-fed config"


def build_parser() -> argparse.ArgumentParser:
    p = parser("config", "Describe the run config's fields, or show what a config file resolves to.")
    p.add_argument("--describe", action="store_true", help="every section and field: type, default, description")
    p.add_argument("--config", help="a run config YAML: show its resolved values (validated)")
    add_set_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """``hacrl-fed config``: see the module docstring. Returns the exit code."""
    p = build_parser()
    args = p.parse_args(argv)
    return run_command(PROG, lambda: _config(args, p))


def _config(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    overrides = args.overrides
    if not args.describe and not args.config:
        p.print_usage()
        print("hacrl-fed config: give --describe, --config FILE, or both")
        return 2
    if overrides and not args.config:
        p.error("--set needs --config")
    cfg = None
    if args.config:
        cfg = load_config(args.config, overrides=overrides)
    if args.describe:
        print(describe(cfg))
    else:
        import yaml

        assert cfg is not None  # --config was given
        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False).rstrip())
    return 0
