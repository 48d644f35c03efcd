#!/usr/bin/env python3
"""Run a config for several seeds and print held-out accuracy before → after per org (plus JSON).

    .venv/bin/python scripts/demo_seeds.py configs/demo.yaml --seeds 0 1 2 [--transport grpc] [--set k=v ...]

Each seed runs `hacrl-fed run CONFIG --set seed=S` in its own run dir under --out; runs are sequential (the
machine's cores go to one run at a time). Results: a table on stdout and <out>/seeds.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hacrl_fed.cli.common import add_set_flag
from hacrl_fed.metrics import eval_curves, read_metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default="runs/seeds")
    p.add_argument("--transport", default="inprocess", choices=["inprocess", "grpc"])
    add_set_flag(p, help="override a config field of every seed's run (repeatable)")
    args = p.parse_args(argv)
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    results = []
    for seed in args.seeds:
        run_dir = out / f"seed{seed}"
        cmd = [sys.executable, "-m", "hacrl_fed.cli", "run", args.config, "--run-dir", str(run_dir), "--no-progress",
               "--transport", args.transport, "--set", f"seed={seed}", *args.overrides]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            print(f"seed {seed}: failed ({proc.returncode}): {proc.stderr.strip()[-500:]}", file=sys.stderr)
            return 1
        for org, curve in sorted(eval_curves(read_metrics(run_dir)).items()):
            results.append({"seed": seed, "org": org, "before": curve[0][1], "after": curve[-1][1],
                            "best": max(v for _, v in curve), "rounds": curve[-1][0], "wall_s": round(wall, 1)})
        print(f"seed {seed}: {wall:.0f} s", file=sys.stderr)
    print(f"{'org':10s} {'seed':>4s} {'before':>7s} {'after':>7s} {'delta':>7s} {'wall_s':>7s}")
    for r in results:
        print(f"{r['org']:10s} {r['seed']:4d} {r['before']:7.3f} {r['after']:7.3f} {r['after'] - r['before']:+7.3f} "
              f"{r['wall_s']:7.0f}")
    for org in sorted({r["org"] for r in results}):
        deltas = [r["after"] - r["before"] for r in results if r["org"] == org]
        print(f"{org:10s} median delta over {len(deltas)} seeds: {statistics.median(deltas):+.3f}")
    (out / "seeds.json").write_text(json.dumps(results, indent=2))
    print(f"results: {out / 'seeds.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
