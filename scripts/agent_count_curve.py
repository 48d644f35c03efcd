"""The agent-count curve (issue 15, BENCHMARKS.md "Agent-count curve"): each org's gain over its isolated GSPO and
its per-org cost per round against the number of orgs n, for every foreign row and for budgeted rules.

    python scripts/agent_count_curve.py --results benchmarks/results --json benchmarks/issue15/agent-count.json

n = 2 is the matrix's `model` setting, 3 `three`, 4 `count4`, 8 `count8` (the same task and hyper-parameters; each
larger setting holds the smaller one's orgs). Per (n, method, org): the final held-out accuracy minus the same
seed's isolated `gspo` cell, in points, mean ± standard error over seeds; and the org's own wall seconds per round
in the train call and in generation (``time_train_s`` / ``time_generate_s`` of the cell over its rounds), mean over
seeds (wall time: it moves with whatever else the machine ran beside the cell). With two orgs `peer_sample`'s
budget of 1x own rows never binds (the one peer offers exactly as many rows), so its n = 2 point is the `all`
cell; `successes` has its own cells at every n.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

SETTINGS = {2: "model", 3: "three", 4: "count4", 8: "count8"}
METHODS = ("hacpo_per_byte", "hacpo_per_byte_successes", "hacpo_per_byte_peer_sample")


def _cells(results: Path, setting: str, method: str) -> dict[int, dict]:
    out = {}
    for path in sorted((results / setting / method).glob("seed*.json")):
        cell = json.loads(path.read_text())
        out[int(cell["seed"])] = cell
    return out


def _mean_se(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return statistics.fmean(values), se


def curve(results: Path) -> list[dict]:
    """One row per (n, method, org) that has cells and an isolated GSPO cell of the same seed."""
    rows = []
    for n, setting in SETTINGS.items():
        alone = _cells(results, setting, "gspo")
        for method in METHODS:
            # two orgs: peer_sample's budget never binds (it is the all cell)
            source = "hacpo_per_byte" if n == 2 and method == "hacpo_per_byte_peer_sample" else method
            cells = _cells(results, setting, source)
            if not cells:
                continue
            for org in next(iter(cells.values()))["agents"]:
                gains = [
                    100 * (c["agents"][org]["accuracy_after"] - alone[s]["agents"][org]["accuracy_after"])
                    for s, c in cells.items()
                    if s in alone
                ]
                mean, se = _mean_se(gains)
                per_round = [
                    (c["agents"][org]["time_train_s"] / c["rounds"], c["agents"][org]["time_generate_s"] / c["rounds"])
                    for c in cells.values()
                ]
                rows.append(
                    {
                        "n": n,
                        "setting": setting,
                        "method": method,
                        "org": org,
                        "seeds": sorted(s for s in cells if s in alone),
                        "gain_vs_gspo": mean,
                        "se": se,
                        "train_s_per_round": statistics.fmean(t for t, _ in per_round),
                        "generate_s_per_round": statistics.fmean(g for _, g in per_round),
                        "sequences_trained": statistics.fmean(
                            c["agents"][org]["sequences_trained"] for c in cells.values()
                        ),
                    }
                )
    return rows


def _fmt(mean: float | None, se: float | None) -> str:
    if mean is None:
        return "–"
    return f"{mean:+.1f}" + (f" ± {se:.1f}" if se is not None else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = curve(args.results)
    if not rows:
        print(f"no cells of {', '.join(SETTINGS.values())} under {args.results}", file=sys.stderr)
        return 1
    heads = [f"`{m}` {what}" for m in METHODS for what in ("gain", "train s/round")]
    print("| n | org | seeds (per method) | " + " | ".join(heads) + " |")
    print("|---|---|---|" + "---|" * len(heads))
    by_key = {(r["n"], r["org"], r["method"]): r for r in rows}
    for n, org in dict.fromkeys((r["n"], r["org"]) for r in rows):
        cols, seeds = [], []
        for m in METHODS:
            r = by_key.get((n, org, m))
            cols += [_fmt(r["gain_vs_gspo"], r["se"]), f"{r['train_s_per_round']:.3f}"] if r else ["–", "–"]
            seeds.append(str(len(r["seeds"])) if r else "0")
        print(f"| {n} | {org} | {'/'.join(seeds)} | " + " | ".join(cols) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
