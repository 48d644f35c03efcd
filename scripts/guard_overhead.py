"""The outcome guard's cost per org (issue 44): a defended learner's time per round and peak memory against the
same learner with the guard off, from two run dirs of the same config run side by side (at the same time, so the
machine's load falls on both alike):

    hacrl-fed run configs/bench/three.yaml --transport grpc --run-dir ON --set federation.rounds=8 \\
        federation.eval_every=0 trainer.outcome_guard.enabled=true      # and OFF with ...enabled=false
    python scripts/guard_overhead.py --run on=ON --run off=OFF [--json F]

Per org (``--transport grpc``: each org's worker is its own process, so its peak RSS is its own): the learner's CPU
seconds per round (``<org>/cpu/generate + <org>/cpu/train``: the worker's whole generate and train calls, the guard's
reference, shadow, validations and final split included; CPU seconds, which a loaded machine moves much less than
wall seconds), the same in wall seconds (``time/generate + time/verify + time/train``), and the peak RSS
(``<org>/perf/*/peak_rss_mb``, the process's running maximum); the ratio on / off of the per-round means with its
standard error (delta method over the rounds of each run), then the median ratio over the orgs. The guard's own
phases (wall seconds per round of the defended run): ``time/outcome_reference``, ``time/outcome_shadow``,
``time/outcome``, ``time/outcome_counterfactual``; and where its CPU seconds go (``cpu/outcome_<part>``, per round of
the defended run: ``generate`` the validations' greedy generation, ``verify`` their tokenizing and judging,
``swap`` putting a stash's weights on the engine and back, ``stash`` the reference's file, ``shadow_score``,
``shadow_update`` and ``shadow_stash`` the shadow's scoring pass, update and weight swaps through its files).

A short run validates in most of its rounds (each of the first ``every``, and the last with its final split), a
long one in few, so ``--project R`` also states each org's ratio projected to an ``R``-round run of the same
schedule (``--every``, the guard's): each defended round's CPU seconds minus the guard-off mean per round is its
extra, averaged per kind of round (``plain``: no validation; ``first``: the reference and a validation; ``val``: a
validation; ``val_cf``: a validation and the comparison with the shadow; ``last``: a validation and the last
round's choice), and the ``R`` rounds' kinds are counted from the schedule (docs/ALGORITHM.md "Outcome guard").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

GUARD = ("outcome_reference", "outcome_shadow", "outcome", "outcome_counterfactual")


def per_round(run_dir: Path) -> dict[str, dict[str, list[float]]]:
    """Per org: per train round, ``cpu`` and ``wall`` seconds of the learner, ``rss`` (MiB) and the guard's phases."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    orgs = sorted({k.split("/")[0] for r in rows for k in r if k.endswith("/cpu/train")})
    out: dict[str, dict[str, list[float]]] = {}
    for org in orgs:
        rounds = [r for r in rows if f"{org}/cpu/train" in r]

        def get(r: dict[str, Any], k: str, org: str = org) -> float:
            return float(r.get(f"{org}/{k}", 0.0))

        out[org] = {
            "cpu": [get(r, "cpu/generate") + get(r, "cpu/train") for r in rounds],
            "wall": [get(r, "time/generate") + get(r, "time/verify") + get(r, "time/train") for r in rounds],
            "rss": [
                max(
                    (v for k, v in r.items() if k.startswith(f"{org}/perf/") and k.endswith("peak_rss_mb")), default=0.0
                )
                for r in rounds
            ],
            **{g: [get(r, f"time/{g}") for r in rounds] for g in GUARD},
            **{
                p: [get(r, p) for r in rounds]
                for p in sorted({k[len(org) + 1 :] for r in rounds for k in r if k.startswith(f"{org}/cpu/outcome_")})
            },
        }
    return out


def kind(r: dict[str, Any], org: str) -> str:
    """The kind of a defended round (module doc) from its metrics."""
    if f"{org}/time/outcome_reference" in r:
        return "first"
    if f"{org}/outcome/final_accuracy" in r:
        return "last"
    if not r.get(f"{org}/outcome/validated"):
        return "plain"
    return "val_cf" if f"{org}/outcome/cf_lost" in r else "val"


def schedule(rounds: int, every: int) -> dict[str, int]:
    """How many rounds of each kind an ``rounds``-round run has (the guard's ``due`` and the counterfactual's)."""
    count = dict.fromkeys(("first", "val", "val_cf", "last", "plain"), 0)
    for t in range(1, rounds + 1):
        cf = t % every == 0
        due = cf or t <= every
        k = "first" if t == 1 else "last" if t == rounds else ("val_cf" if cf else "val") if due else "plain"
        count[k] += 1
    return count


def projected(run_dir: Path, org: str, off_mean: float, rounds: int, every: int) -> float:
    """The org's on / off ratio over an ``rounds``-round run (module doc)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    extra: dict[str, list[float]] = {}
    for r in rows:
        if f"{org}/cpu/train" in r:
            cpu = float(r.get(f"{org}/cpu/generate", 0.0)) + float(r[f"{org}/cpu/train"])
            extra.setdefault(kind(r, org), []).append(cpu - off_mean)
    count = schedule(rounds, every)
    missing = [k for k, n in count.items() if n and k not in extra]
    if missing:
        raise SystemExit(f"{run_dir}: no defended round of kind {missing} to project from")
    total = sum(n * statistics.fmean(extra[k]) for k, n in count.items() if n)
    return 1.0 + total / (rounds * off_mean)


def ratio(on: list[float], off: list[float]) -> tuple[float, float]:
    """``mean(on) / mean(off)`` and its standard error (delta method, rounds as independent draws)."""
    m1, m0 = statistics.fmean(on), statistics.fmean(off)
    v1 = statistics.variance(on) / len(on) if len(on) > 1 else 0.0
    v0 = statistics.variance(off) / len(off) if len(off) > 1 else 0.0
    r = m1 / m0
    return r, r * math.sqrt(v1 / m1**2 + v0 / m0**2)


def table(on: dict[str, Any], off: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per org both runs have: the time ratios with SE, the peak RSS ratio, the guard's phases."""
    rows = []
    for org in sorted(set(on) & set(off)):
        a, b = on[org], off[org]
        cpu, cpu_se = ratio(a["cpu"], b["cpu"])
        wall, wall_se = ratio(a["wall"], b["wall"])
        peak_on, peak_off = max(a["rss"]), max(b["rss"])
        phases = {g: round(statistics.fmean(a[g]), 3) for g in GUARD}
        parts = {
            k.removeprefix("cpu/outcome_"): round(statistics.fmean(v), 3) for k, v in a.items() if k.startswith("cpu/")
        }
        rows.append(
            {
                "org": org,
                "rounds": len(a["cpu"]),
                "cpu_on": statistics.fmean(a["cpu"]),
                "cpu_off": statistics.fmean(b["cpu"]),
                "cpu_ratio": cpu,
                "cpu_ratio_se": cpu_se,
                "wall_ratio": wall,
                "wall_ratio_se": wall_se,
                "rss_on_mb": peak_on,
                "rss_off_mb": peak_off,
                "rss_ratio": peak_on / peak_off,
                "guard_wall_s": phases,
                "guard_cpu_s": parts,
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="append", required=True, metavar="LABEL=DIR", help="on=DIR and off=DIR")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--project", type=int, default=0, help="also the ratio projected to a run of this many rounds")
    p.add_argument("--every", type=int, default=4, help="the guard's trainer.outcome_guard.every (default 4)")
    args = p.parse_args()
    dirs = dict(spec.partition("=")[::2] for spec in args.run)
    rows = table(per_round(Path(dirs["on"])), per_round(Path(dirs["off"])))
    print("| org | rounds | CPU s/round on | off | on/off (CPU) | on/off (wall) | peak RSS on / off (MiB) | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['org']} | {r['rounds']} | {r['cpu_on']:.1f} | {r['cpu_off']:.1f} | {r['cpu_ratio']:.2f} ± "
            f"{r['cpu_ratio_se']:.2f} | {r['wall_ratio']:.2f} ± {r['wall_ratio_se']:.2f} | {r['rss_on_mb']:.0f} / "
            f"{r['rss_off_mb']:.0f} | {r['rss_ratio']:.2f} |"
        )
    for key in ("cpu_ratio", "wall_ratio", "rss_ratio"):
        print(f"median {key} over {len(rows)} orgs: {statistics.median(r[key] for r in rows):.2f}")
    for r in rows if args.project else []:
        r["projected_cpu_ratio"] = projected(Path(dirs["on"]), r["org"], r["cpu_off"], args.project, args.every)
        print(f"{r['org']}: CPU ratio projected to {args.project} rounds: {r['projected_cpu_ratio']:.2f}")
    if args.project:
        print(
            f"median projected over {len(rows)} orgs: {statistics.median(r['projected_cpu_ratio'] for r in rows):.2f}"
        )
    for r in rows:
        print(f"{r['org']} guard phases (wall s/round, defended run): {r['guard_wall_s']}")
        if r["guard_cpu_s"]:
            print(f"{r['org']} guard CPU s/round by part (defended run): {r['guard_cpu_s']}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
