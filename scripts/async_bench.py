"""Asynchronous cells against synchronous HACPO and isolated GSPO on one virtual clock (issue 29, BENCHMARKS.md
"Asynchronous rounds"):

    python scripts/async_bench.py model three [--results benchmarks/results] [--json benchmarks/issue29/async.json]

For each setting, each asynchronous method (a method whose cells have a ``clock_curve``) and each org, paired by seed
with ``--sync`` (default ``hacpo_defended_split``, the defaults) and ``--gspo`` (isolated GSPO), whose clocks follow
from the asynchronous cell's step durations (:mod:`hacrl_tools.bench.async_clock`):

- ``t95``: the clock at which the org first reaches 95 % of the synchronous run's final accuracy (same seed), in the
  synchronous run and in the asynchronous one, and their ratio (mean ± standard error over seeds; "never" counts the
  seeds where the asynchronous org did not reach it);
- at equal own rollouts: the asynchronous org's accuracy at the synchronous run's last round (its own rounds may be
  more, ``federation.org_rounds``) minus the synchronous run's final accuracy, in points;
- its final accuracy minus isolated GSPO's final accuracy, in points;
- at equal clock: both accuracies at the clock where the first of the two runs ends, their difference in points.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hacrl_tools.bench.async_clock import accuracy_at, lock_step_clock, round_step_s, time_to
from hacrl_tools.bench.report import _mean_se, load_results


def _stat(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"mean": None, "se": None, "n": 0}
    mean, se = _mean_se(values)
    return {"mean": mean, "se": se, "n": len(values)}


def org_row(arm: dict[int, Any], sync: dict[int, Any], gspo: dict[int, Any], org: str) -> dict[str, Any]:
    """One org of one asynchronous method, over the seeds all three ran."""
    seeds = sorted(set(arm) & set(sync) & set(gspo))
    t_sync, t_arm, ratio, never, d_sync, d_gspo, d_clock = [], [], [], 0, [], [], []
    for s in seeds:
        step_s = arm[s]["config"]["federation"].get("virtual_step_s", {})
        orgs = [o["id"] for o in arm[s]["config"]["orgs"]]
        a = arm[s]["agents"][org]
        y = sync[s]["agents"][org]
        sync_curve = lock_step_clock(y["curve"], round_step_s(step_s, orgs))
        target = 0.95 * y["accuracy_after"]
        ts, ta = time_to(sync_curve, target), time_to(a["clock_curve"], target)
        if ts is not None:
            t_sync.append(ts)
        if ta is None:
            never += 1
        else:
            t_arm.append(ta)
            if ts:
                ratio.append(ta / ts)
        rounds = y["curve"][-1][0]  # the synchronous run's rounds: equal own rollouts
        by_round = [[t, t, acc] for t, _, acc in a["curve"]]
        d_sync.append(100 * (accuracy_at(by_round, rounds) - y["accuracy_after"]))
        d_gspo.append(100 * (a["accuracy_after"] - gspo[s]["agents"][org]["accuracy_after"]))
        at = min(a["clock_curve"][-1][1], sync_curve[-1][1])  # equal clock: where both still run
        d_clock.append(100 * (accuracy_at(a["clock_curve"], at) - accuracy_at(sync_curve, at)))
    return {
        "org": org,
        "seeds": seeds,
        "step_s": float(arm[seeds[0]]["config"]["federation"].get("virtual_step_s", {}).get(org, 1.0))
        if seeds
        else None,
        "t95_sync": _stat(t_sync),
        "t95_async": _stat(t_arm),
        "t95_ratio": _stat(ratio),
        "t95_never": never,
        "final_minus_sync": _stat(d_sync),
        "final_minus_gspo": _stat(d_gspo),
        "equal_clock_minus_sync": _stat(d_clock),
    }


def _fmt(d: dict[str, Any], spec: str = "+.1f") -> str:
    """mean ± se; a difference (``spec`` with a sign) within two standard errors is marked not resolved."""
    if d["mean"] is None:
        return "–"
    se = f" ± {d['se']:{spec.lstrip('+')}}" if d["se"] is not None else ""
    resolved = d["se"] is None or abs(d["mean"]) > 2 * d["se"] or not spec.startswith("+")
    verdict = "" if resolved else " (n.r.)"
    return f"{d['mean']:{spec}}{se}{verdict}"


def setting_rows(data: dict, setting: str, sync: str, gspo: str) -> list[dict[str, Any]]:
    cells = {m: {c["seed"]: c for c in cs} for (s, m), cs in data.items() if s == setting}
    if sync not in cells or gspo not in cells:
        return []
    arms = sorted(
        m for m, cs in cells.items() if any("clock_curve" in a for c in cs.values() for a in c["agents"].values())
    )
    rows = []
    for m in arms:
        for org in next(iter(cells[m].values()))["agents"]:
            row = org_row(cells[m], cells[sync], cells[gspo], org)
            if row["seeds"]:
                rows.append({"setting": setting, "method": m, **row})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("settings", nargs="+")
    p.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--sync", default="hacpo_defended_split")
    p.add_argument("--gspo", default="gspo")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    data = load_results(args.results)
    rows = [r for s in args.settings for r in setting_rows(data, s, args.sync, args.gspo)]
    if not rows:
        print(f"async_bench: no asynchronous cells with {args.sync} and {args.gspo} in {args.results}", file=sys.stderr)
        return 2
    print("| setting | method | org | step | seeds | t95 sync | t95 async | ratio | never |"
          " equal rollouts − sync (pts) | final − GSPO (pts) | equal clock − sync (pts) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['setting']}` | `{r['method']}` | {r['org']} | {r['step_s']:g} | {len(r['seeds'])} | "
              f"{_fmt(r['t95_sync'], '.1f')} | {_fmt(r['t95_async'], '.1f')} | {_fmt(r['t95_ratio'], '.2f')} | "
              f"{r['t95_never']} | {_fmt(r['final_minus_sync'])} | {_fmt(r['final_minus_gspo'])} | "
              f"{_fmt(r['equal_clock_minus_sync'])} |")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
