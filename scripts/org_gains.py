"""Every org of a setting against its isolated GSPO and GSPO×2, paired by seed (issue 30, BENCHMARKS.md "Expertise
settings"):

    python scripts/org_gains.py mixed3 --methods hacpo hacpo_defended_split [--results benchmarks/results] [--json F]

For each method and org: the final held-out accuracy (mean over the seeds that ran it and both references), its
difference from ``gspo`` and from ``gspo_x2`` of the same seed, in points (mean ± standard error over seeds; a
verdict only past two standard errors), and, where the setting has slices, the org's final accuracy per slice.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from hacrl_tools.bench.report import _mean_se, load_results

REFS = ("gspo", "gspo_x2")


def _verdict(mean: float, se: float | None) -> str:
    if se is None:
        return "one seed"
    if abs(mean) > 2 * se:
        return "above" if mean > 0 else "below"
    return "not resolved"


def org_rows(cells: dict[str, dict[int, dict[str, Any]]], method: str) -> list[dict[str, Any]]:
    """One row per org of ``method``: accuracy, differences from each reference (points), slices, seeds."""
    seeds = sorted(set(cells.get(method, {})).intersection(*(cells.get(r, {}) for r in REFS)))
    if not seeds:
        return []
    rows = []
    for org in cells[method][seeds[0]]["agents"]:
        accs = [cells[method][s]["agents"][org]["accuracy_after"] for s in seeds]
        row: dict[str, Any] = {"method": method, "org": org, "seeds": seeds, "accuracy": statistics.fmean(accs)}
        for ref in REFS:
            diffs = [100 * (a - cells[ref][s]["agents"][org]["accuracy_after"]) for a, s in zip(accs, seeds)]
            mean, se = _mean_se(diffs)
            row[ref] = {"mean": mean, "se": se, "verdict": _verdict(mean, se)}
        slices = [cells[method][s]["agents"][org].get("slice_curves") or {} for s in seeds]
        row["slices"] = {k: statistics.fmean(sc[k][-1][1] for sc in slices) for k in slices[0]}
        rows.append(row)
    return rows


def _fmt(d: dict[str, Any]) -> str:
    se = f" ± {d['se']:.1f}" if d["se"] is not None else ""
    return f"{d['mean']:+.1f}{se} ({d['verdict']})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("setting")
    p.add_argument("--methods", nargs="+", required=True)
    p.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    data = load_results(args.results)
    cells = {m: {c["seed"]: c for c in cs} for (s, m), cs in data.items() if s == args.setting}
    missing = [r for r in REFS if r not in cells]
    if missing:
        print(f"org_gains: no {', '.join(missing)} cells for {args.setting} in {args.results}", file=sys.stderr)
        return 2
    rows = [r for m in args.methods for r in org_rows(cells, m)]
    print("| method | org | seeds | accuracy | − GSPO (pts) | − GSPO×2 (pts) | per slice |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        sl = ", ".join(f"{k} {v:.3f}" for k, v in r["slices"].items())
        seeds = ",".join(map(str, r["seeds"]))
        print(f"| `{r['method']}` | {r['org']} | {seeds} | {r['accuracy']:.3f} | {_fmt(r['gspo'])} | "
              f"{_fmt(r['gspo_x2'])} | {sl} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
