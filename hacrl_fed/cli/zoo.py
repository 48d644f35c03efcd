"""``hacrl-fed zoo list``; ``hacrl-fed zoo build NAME... [--out DIR | --ship] [--dtype float32|float16]``: the tiny
built-in agents of :mod:`hacrl_fed.models.zoo`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from hacrl_fed.cli.common import parser, run_command
from hacrl_fed.config import BuildError
from hacrl_fed.models.catalog import ZOO, built_recipe, cached_dir, get_entry, read_recipe, shipped_dir
from hacrl_fed.models.zoo import build_agent


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    """``zoo build NAME... [--out DIR | --ship] [--dtype float32|float16]``; ``zoo list``. Returns an exit code.

    Default destination is the cache (:func:`cached_dir`); ``--out DIR`` writes ``DIR/<name>``; ``--ship``
    writes ``hacrl_fed/assets/zoo/<name>`` in float16.
    """
    p = parser("zoo", "Build or list the tiny agent zoo.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="list zoo agents with their recipe hash and where they resolve")
    build = sub.add_parser("build", help="build (SFT warm start) zoo agents")
    build.add_argument("names", nargs="+", help=f"agent names or 'all' ({', '.join(ZOO)})")
    where = build.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, help="write DIR/<name> instead of the cache")
    where.add_argument("--ship", action="store_true", help="write into the package assets dir (float16)")
    build.add_argument("--dtype", choices=("float32", "float16"), help="saved dtype (default float32; --ship fp16)")
    args = p.parse_args(argv)
    return run_command("hacrl-fed zoo", lambda: _zoo(args, p))


def _zoo(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.cmd == "list":
        for entry in ZOO.values():
            rec = read_recipe(shipped_dir(entry.name))
            if rec and rec.get("recipe_hash") == entry.recipe_hash():
                state = "shipped"
            elif read_recipe(cached_dir(entry.name)) is not None:
                state = f"cached in {cached_dir(entry.name)}"
            else:
                state = f"{'stale' if rec else 'not built'}: hacrl-fed zoo build {entry.name} --ship"
            print(f"{entry.name:18s} {entry.arch:6s} {entry.tokenizer:5s} {entry.recipe_hash()} {state}")
        return 0
    names = list(ZOO) if args.names == ["all"] else args.names
    try:
        entries = [get_entry(n) for n in names]
    except BuildError as err:
        p.error(str(err))
    dtype = args.dtype or ("float16" if args.ship else "float32")
    for entry in entries:
        dest = shipped_dir(entry.name) if args.ship else args.out / entry.name if args.out else cached_dir(entry.name)
        path = build_agent(entry.name, dest, dtype=dtype)
        rec = built_recipe(path)
        print(
            f"{entry.name}: params={rec['num_params']} accuracy={rec['accuracy']:.3f} "
            f"stop_rate={rec['stop_rate']:.2f} build={rec['build_seconds']:.0f}s "
            f"size={_dir_size(path) / 1e6:.2f}MB -> {path}"
        )
    return 0
