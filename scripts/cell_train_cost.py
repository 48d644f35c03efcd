"""A learner's train cost at n orgs against 2, from the committed matrix cells (BENCHMARKS.md "A per-source budget
at 2 and 8 orgs"; issue 27: "a learner's train cost at 8 orgs within 1.5x of its cost at 2 (agent-count cells)").

    python scripts/cell_train_cost.py --methods hacpo_defended hacpo_defended_split --orgs acme globex

Per method, org and seed, from ``benchmarks/results/<setting>/<method>/seed<k>.json``: the wall seconds of the
org's train calls per round (``agents.<org>.time_train_s / rounds``: screening, selection, re-tokenizing, scoring
and the update; wall time, so it moves with the machine's load while the cell ran) and the foreign rows it trained
on per round (``cross_sequences_trained / rounds``, which the load does not move), in ``--small`` (n = 2) and
``--large`` (n = 8), and the ratio large / small. One JSON object per line, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def per_round(cell: dict, org: str) -> tuple[float, float]:
    """``(train wall s, foreign rows trained)`` per round of ``org`` in a cell's JSON."""
    agent, rounds = cell["agents"][org], cell["rounds"]
    return agent["time_train_s"] / rounds, agent["cross_sequences_trained"] / rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--small", default="model", help="the setting with 2 orgs")
    p.add_argument("--large", default="count8", help="the setting with n orgs")
    p.add_argument("--methods", nargs="+", required=True)
    p.add_argument("--orgs", nargs="+", default=["acme", "globex"], help="orgs both settings have")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = p.parse_args()
    rows = []
    for method in args.methods:
        for seed in args.seeds:
            paths = [args.results / s / method / f"seed{seed}.json" for s in (args.small, args.large)]
            if not all(path.is_file() for path in paths):
                continue
            small, large = (json.loads(path.read_text()) for path in paths)
            for org in args.orgs:
                (t2, f2), (tn, fn) = per_round(small, org), per_round(large, org)
                row = {
                    "method": method,
                    "seed": seed,
                    "org": org,
                    "train_s_small": round(t2, 3),
                    "train_s_large": round(tn, 3),
                    "ratio": round(tn / t2, 2),
                    "foreign_small": round(f2, 1),
                    "foreign_large": round(fn, 1),
                }
                print(json.dumps(row))
                rows.append(row)
    print(f"\n| method | seed | org | train s/round, {args.small} | {args.large} | ratio | foreign rows/round |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r['method']}` | {r['seed']} | {r['org']} | {r['train_s_small']:.3f} | {r['train_s_large']:.3f} | "
            f"{r['ratio']:.2f}× | {r['foreign_small']:.0f} → {r['foreign_large']:.0f} |"
        )


if __name__ == "__main__":
    main()
