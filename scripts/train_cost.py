"""A learner's train cost per round from kept bench runs (BENCHMARKS.md "A per-source budget at 2 and 8 orgs").

    python scripts/train_cost.py --run a2=KEEP/model/hacpo_defended/seed0 --run a8=KEEP/count8/hacpo_defended/seed0

Each ``--run LABEL=DIR`` names a run dir kept by ``hacrl-fed bench learning --keep-runs`` (its ``metrics.jsonl``).
Per org: the means over the training rounds (the first one left out: warm-up) of ``<org>/cpu/train`` (the worker's
CPU seconds of the whole train call: screening, selection, re-tokenizing, scoring, the update), ``<org>/cpu/update``,
``<org>/time/train`` (the update's wall seconds) and ``<org>/select/selected``; one JSON object per run and org on
stdout, then a Markdown table of ``cpu/train`` for the orgs every run has, with each run's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

KEYS = {
    "cpu_train": "cpu/train",
    "cpu_update": "cpu/update",
    "wall_update": "time/train",
    "selected": "select/selected",
}


def per_org(run_dir: Path, skip: int = 1) -> dict[str, dict[str, float]]:
    """Per org of the run: the mean of each of :data:`KEYS` over its train rounds after the first ``skip``."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    orgs = sorted({k.split("/")[0] for r in rows for k in r if k.endswith("/cpu/train")})
    out: dict[str, dict[str, float]] = {}
    for org in orgs:
        rounds = [r for r in rows if f"{org}/cpu/train" in r][skip:]
        out[org] = {name: statistics.fmean(r.get(f"{org}/{key}", 0.0) for r in rounds) for name, key in KEYS.items()}
        out[org]["rounds"] = float(len(rounds))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="LABEL=DIR", help="a kept run dir (repeatable)")
    p.add_argument("--skip", type=int, default=1, help="leading train rounds left out (default 1)")
    args = p.parse_args()
    runs = {}
    for spec in args.run:
        label, _, path = spec.partition("=")
        runs[label] = per_org(Path(path), args.skip)
        for org, values in runs[label].items():
            print(json.dumps({"run": label, "org": org, **{k: round(v, 4) for k, v in values.items()}}))
    common = sorted(set.intersection(*(set(r) for r in runs.values())))
    first = next(iter(runs))
    print("\n| org | " + " | ".join(f"`{label}` cpu/train s" for label in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for org in common:
        base = runs[first][org]["cpu_train"]
        cells = [f"{r[org]['cpu_train']:.3f} ({r[org]['cpu_train'] / base:.2f}×)" for r in runs.values()]
        print(f"| {org} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
