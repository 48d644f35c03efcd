"""List the functions of the library (``hacrl_fed/``) longer than a bound; exit 1 when there are any.

The developers' guide keeps functions under ~60 lines. A function's length is its lines from the ``def`` (its
decorators excluded) to its last line, docstring included. Usage::

    python scripts/function_lengths.py [--max 60] [ROOT ...]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def long_functions(root: Path, limit: int) -> list[tuple[str, int, str, int]]:
    """``(path, line, qualified name, lines)`` of every function under ``root`` longer than ``limit`` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
        out.extend((name, *hit) for hit in _walk(tree, "", limit))
    return out


def _walk(node: ast.AST, prefix: str, limit: int):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{child.name}"
            lines = (child.end_lineno or child.lineno) - child.lineno + 1
            if lines > limit:
                yield child.lineno, name, lines
            yield from _walk(child, f"{name}.", limit)
        elif isinstance(child, ast.ClassDef):
            yield from _walk(child, f"{prefix}{child.name}.", limit)
        else:
            yield from _walk(child, prefix, limit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=60, help="most lines a function may have (default 60)")
    parser.add_argument("roots", nargs="*", default=[str(REPO / "hacrl_fed")])
    args = parser.parse_args(argv)
    hits = [h for root in args.roots for h in long_functions(Path(root).resolve(), args.max)]
    for path, line, name, n in hits:
        print(f"{path}:{line}: {name} has {n} lines (> {args.max})")
    print(f"{len(hits)} function(s) over {args.max} lines")
    return 1 if hits else 0


if __name__ == "__main__":
    sys.exit(main())
