"""Per-round cost of the trust boundary in a finished run, from its metrics.jsonl.

    python scripts/security_overhead.py runs/demo-blind/metrics.jsonl

Per round (rounds >= 1) it sums, over orgs:

* ``<org>/time/seal_sign`` — the worker sealing its text for the other orgs (blind mode) and signing its batch;
* ``time/trust/<org>`` — the coordinator verifying that org's signature and screening its batch (bounds, exact
  G, rewards re-verified when it can read the text);
* ``<org>/time/trust`` — the learner verifying, opening and screening every foreign batch it received;

and divides by the round's ``time/round`` (in-process runs do every org's work in sequence, so the sum of the
parts is comparable with the round). Prints the median and the mean share, and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def round_costs(record: dict[str, float]) -> dict[str, float]:
    """``{"seal_sign", "coordinator", "learners", "round"}`` seconds of one metrics record."""
    seal = sum(v for k, v in record.items() if k.endswith("/time/seal_sign"))
    coord = sum(v for k, v in record.items() if k.startswith("time/trust/"))
    learners = sum(v for k, v in record.items() if k.endswith("/time/trust") and k.count("/") == 2)
    return {"seal_sign": seal, "coordinator": coord, "learners": learners, "round": record.get("time/round", 0.0)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    args = p.parse_args(argv)
    records = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    costs = [round_costs(r) for r in records if r.get("round", 0) >= 1 and r.get("time/round")]
    if not costs:
        print(f"{args.metrics}: no training rounds with timings", file=sys.stderr)
        return 1
    print(f"{len(costs)} rounds, median seconds per round (share of the round):")
    for part in ("seal_sign", "coordinator", "learners"):
        med = statistics.median(c[part] for c in costs)
        share = statistics.median(c[part] / c["round"] for c in costs)
        print(f"  {part:12s} {med:8.4f} s  {100 * share:6.2f} %")
    total = [(c["seal_sign"] + c["coordinator"] + c["learners"]) / c["round"] for c in costs]
    print(f"  {'all':12s} median {100 * statistics.median(total):.2f} %, mean {100 * statistics.fmean(total):.2f} % "
          f"of {statistics.median(c['round'] for c in costs):.2f} s per round")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
