"""The demo's in-process round, two checkouts side by side (BENCHMARKS.md "Fast engine: generation and demo rounds").

    .venv/bin/python scripts/demo_rounds.py --base /path/to/old/checkout --base-set generation.engine=hf \
        --new . --new-set generation.engine=fast --pairs 3 --out benchmarks/system/demo-rounds.json

Runs ``configs/demo.yaml`` for ``--rounds`` rounds in each checkout (its own ``.venv``), alternating base, new, new,
base, base, new, ... so that drifts in the machine's load hit both sides alike. Per run: medians over rounds 2..R of
``time/round``, of the per-org ``time/generate`` and ``time/train`` summed over orgs, and the rows that ran
backward. Prints the table and the per-pair ratios (mean and standard error) and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hacrl_fed.cli.common import add_set_flag
from hacrl_fed.lifecycle import OFFLINE_ENV
from hacrl_fed.metrics import read_metrics


def _medians(run_dir: Path) -> dict[str, float]:
    recs = read_metrics(run_dir)
    rounds = [r for r in recs if "time/round" in r and r.get("round", 0) >= 2]

    def summed(r: dict, suffix: str) -> float:
        return sum(v for k, v in r.items() if k.endswith(suffix))

    return {
        "round_s": statistics.median(r["time/round"] for r in rounds),
        "generate_s": statistics.median(summed(r, "/time/generate") for r in rounds),
        "train_s": statistics.median(summed(r, "/time/train") for r in rounds),
        "backward_rows": statistics.median(summed(r, "/train/num_backward") for r in rounds),
        "rounds_measured": len(rounds),
    }


def _run(checkout: Path, sets: list[str], rounds: int, run_dir: Path) -> dict:
    env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(checkout)}
    cmd = [str(checkout / ".venv/bin/python"), "-m", "hacrl_fed.cli", "run", "configs/demo.yaml", "--no-progress"]
    cmd += ["--run-dir", str(run_dir), "--set", f"federation.rounds={rounds}", *sets]
    subprocess.run(cmd, cwd=checkout, env=env, check=True, capture_output=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return {"commit": commit.stdout.strip(), "set": sets, **_medians(run_dir)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True)
    add_set_flag(ap, flag="--base-set", dest="base_set", help="overrides of the base checkout's runs")
    ap.add_argument("--new", type=Path, default=Path("."))
    add_set_flag(ap, flag="--new-set", dest="new_set", help="overrides of the new checkout's runs")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    order = [("base", "new"), ("new", "base")] * args.pairs
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="demo-rounds-") as tmp:
        for p, pair in enumerate(order[: args.pairs]):
            for side in pair:
                checkout, sets = (args.base, args.base_set) if side == "base" else (args.new, args.new_set)
                res = _run(checkout.resolve(), sets, args.rounds, Path(tmp) / f"{p}-{side}")
                runs.append({"pair": p, "side": side, **res})
                print(f"pair {p} {side:4s} {res['commit']} round {res['round_s']:.3f} s  generate "
                      f"{res['generate_s']:.3f}  train {res['train_s']:.3f}  backward rows {res['backward_rows']:.0f}")
    ratios = []
    for p in range(args.pairs):
        side = {r["side"]: r for r in runs if r["pair"] == p}
        ratios.append(side["base"]["round_s"] / side["new"]["round_s"])
    mean = statistics.mean(ratios)
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    print(f"round speed-up base/new per pair: {', '.join(f'{r:.2f}' for r in ratios)}; mean {mean:.2f} (SE {se:.2f})")
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "ratios": ratios, "mean": mean, "se": se}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
