"""``hacrl-fed keys --out DIR --orgs acme,globex [--san NAME_OR_IP ...] [--force]``: the CA, SuperLink and worker TLS
certificates, SuperNode auth keys and org signing identities that :mod:`hacrl_fed.security.keys` writes (the layout
is described there). Bad input (:class:`~hacrl_fed.security.keys.KeyToolError`, a ``ConfigError``) exits 2 with one
line.
"""

from __future__ import annotations

import argparse

from hacrl_fed.cli.common import parser, run_command
from hacrl_fed.security.keys import DEFAULT_SANS, KeyToolError, parse_orgs, parse_san, summary, write_keys


def build_parser() -> argparse.ArgumentParser:
    p = parser(
        "keys",
        "Create a CA, SuperLink and worker TLS certificates, SuperNode auth keys and org signing identities.",
    )
    p.add_argument("--out", required=True, help="output directory (created, mode 700)")
    p.add_argument("--orgs", required=True, help="comma-separated org ids: SuperNode, worker and identity keys each")
    p.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="NAME_OR_IP",
        help="host name or IP the SuperNodes dial, for the SuperLink and worker certificates "
        "(repeatable); default: " + " ".join(DEFAULT_SANS),
    )
    p.add_argument("--force", action="store_true", help="replace existing key files")
    return p


def main(argv: list[str] | None = None) -> int:
    """``hacrl-fed keys``: write the keys (see module docstring) and print what was written; 2 on bad input."""
    args = build_parser().parse_args(argv)
    return run_command("hacrl-fed keys", lambda: _keys(args), bad_input=(KeyToolError,))


def _keys(args: argparse.Namespace) -> int:
    sans = args.san or list(DEFAULT_SANS)
    orgs = parse_orgs(args.orgs)
    for s in sans:
        parse_san(s)
    layout = write_keys(args.out, orgs, sans, force=args.force)
    print(summary(layout, orgs, sans))
    return 0
