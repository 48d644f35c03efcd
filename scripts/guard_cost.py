"""The outcome guard's honest cost per org, paired by seed with the run without it (issue 27, BENCHMARKS.md "A
regression the shadow matches"):

    python scripts/guard_cost.py [--results benchmarks/results] [--method hacpo_defended_split_guard_gate]
        [--ref hacpo_defended_split] [--same-as hacpo_defended_split_guard_slack hacpo_defended_split_guard_final]
        [--json F]

A method's cell of a seed, where it exists, is paired with ``--ref``'s cell of the same seed. Where it does not, a
``--same-as`` cell (tried in order) stands in for it only when no org's guard ever rolled back in it: the gate of
``shadow_gate`` decides only on a regression after foreign rows, which always rolled back under the earlier rules,
so such a run is the same run under the gate. A stand-in where a guard rolled back is listed as missing, never used.
Per setting and org: the difference in final held-out accuracy (points, mean ± standard error over seeds; a verdict
only past two standard errors) and which cell stood for each seed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from hacrl_tools.bench.report import _mean_se, load_results
from hacrl_tools.bench.report import _verdict as resolved  # past two standard errors, or not


def rolled_back(cell: dict[str, Any]) -> bool:
    """Whether any org's guard rolled back in this cell (its ``outcome.rollbacks``)."""
    return any((a.get("outcome") or {}).get("rollbacks") for a in cell["agents"].values())


def _stand_in(cells: dict[str, dict[int, dict[str, Any]]], seed: int, same_as: list[str]) -> tuple[Any, str]:
    """The first ``same_as`` cell of ``seed`` where no guard rolled back, and its method (None, "" when none)."""
    for method in same_as:
        cell = cells.get(method, {}).get(seed)
        if cell is not None and not rolled_back(cell):
            return cell, method
    return None, ""


def setting_rows(
    cells: dict[str, dict[int, dict[str, Any]]], method: str, ref: str, same_as: list[str]
) -> tuple[list[dict[str, Any]], list[str], list[int]]:
    """One row per org of a setting: ``(rows, sources per seed, seeds missing a usable cell)``."""
    pairs, sources, missing = [], [], []
    for seed in sorted(cells.get(ref, {})):
        run, source = cells.get(method, {}).get(seed), method
        if run is None:
            run, source = _stand_in(cells, seed, same_as)
        if run is None:
            if any(seed in cells.get(m, {}) for m in same_as):
                missing.append(seed)
            continue
        pairs.append((run, cells[ref][seed]))
        sources.append(f"{seed}:{source.removeprefix('hacpo_defended_split_')}")
    rows = []
    for org in pairs[0][0]["agents"] if pairs else []:
        diffs = [
            100 * (run["agents"][org]["accuracy_after"] - ref_cell["agents"][org]["accuracy_after"])
            for run, ref_cell in pairs
        ]
        mean, se = _mean_se(diffs)
        rows.append({"org": org, "mean": mean, "se": se, "per_seed": diffs})
    return rows, sources, missing


def _verdict(mean: float, se: float | None) -> str:
    """Within one standard error, else the report's verdict (resolved past two, or not). One nonzero difference
    among zeros has ``|mean| == se`` exactly, which float round-off must not tip."""
    if se is None:
        return "one seed"
    if abs(mean) <= se or math.isclose(abs(mean), se, rel_tol=1e-9):
        return "within one SE"
    return resolved(mean, se)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results")
    ap.add_argument("--method", default="hacpo_defended_split_guard_gate")
    ap.add_argument("--ref", default="hacpo_defended_split")
    ap.add_argument(
        "--same-as", nargs="*", default=["hacpo_defended_split_guard_slack", "hacpo_defended_split_guard_final"]
    )
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    by_setting: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    for (setting, method), cells in load_results(args.results).items():
        by_setting.setdefault(setting, {})[method] = {int(c["seed"]): c for c in cells}
    out: dict[str, Any] = {}
    print(f"| setting | seeds (cell) | org | {args.method} − {args.ref} (points) | per seed | verdict |")
    print("|---|---|---|---|---|---|")
    for setting in sorted(by_setting):
        rows, sources, missing = setting_rows(by_setting[setting], args.method, args.ref, args.same_as)
        if missing:
            print(
                f"{setting}: seeds {missing} have only cells where a guard rolled back: run {args.method}",
                file=sys.stderr,
            )
        for row in rows:
            se = "–" if row["se"] is None else f"{row['se']:.1f}"
            per_seed = ", ".join(f"{d:+.1f}" for d in row["per_seed"])
            print(
                f"| `{setting}` | {', '.join(sources)} | {row['org']} | {row['mean']:+.1f} ± {se} | {per_seed} | "
                f"{_verdict(row['mean'], row['se'])} |"
            )
        if rows:
            out[setting] = {"seeds": sources, "missing": missing, "orgs": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
