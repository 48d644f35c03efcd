"""Bounded harm (issue 20, SECURITY.md): each honest org under a doctored-text attack against its isolated GSPO.

    python scripts/bounded_harm.py benchmarks/screen/bounded-harm.jsonl --results benchmarks/results

Reads the JSON lines of ``scripts/screen_calibration.py`` runs (one per setting, variant, seed) and, for every honest
org of a run (not the attacker), the matrix cell ``<results>/<setting>/gspo/seed<k>.json`` of the same seed (the
same held-out prompts: the eval draw depends on the seed) at the run's number of rounds (its curve point). Prints,
per setting and variant, each honest org's final accuracy under attack, its isolated GSPO accuracy, and the
difference paired by seed (mean ± standard error over seeds); ``--json`` writes the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def _gspo(results: Path, setting: str, seed: int, rounds: int) -> dict[str, float] | None:
    """Each org's isolated GSPO accuracy after ``rounds`` rounds: the cell's curve point at that round (a run of
    fewer rounds than the cell trains exactly the cell's first rounds), None without the cell or the point."""
    cell = results / setting / "gspo" / f"seed{seed}.json"
    if not cell.exists():
        return None
    agents = json.loads(cell.read_text())["agents"]
    at = {org: [acc for r, _, acc in a["curve"] if r == rounds] for org, a in agents.items()}
    return {org: accs[0] for org, accs in at.items() if accs} or None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    diffs: dict[tuple[str, str, str], list[tuple[int, float, float]]] = defaultdict(list)
    for line in args.runs.read_text().splitlines():
        if not line.strip():
            continue
        run = json.loads(line)
        setting = Path(run["config"]).stem
        alone = _gspo(args.results, setting, run["seed"], run["rounds"])
        if alone is None:
            print(
                f"no isolated GSPO cell for {setting} seed {run['seed']} at round {run['rounds']}: skipped",
                file=sys.stderr,
            )
            continue
        for org, acc in run["accuracy"].items():
            if org != run.get("attacker") and org in alone:
                extra = "".join(f", {kv}" for kv in run.get("set", []))  # runs of other configs stay apart
                by = f", by {run['attacker']}" if run.get("attacker") else ""
                by += f", doctoring {run['duty']} rounds" if run.get("duty") else ""
                diffs[(setting, f"{run['variant']}{by} (screen {run['screen']}{extra})", org)].append(
                    (run["seed"], acc, alone[org])
                )
    rows = []
    print("| setting | attack | honest org | seeds | under attack | isolated GSPO | difference ± SE |")
    print("|---|---|---|---|---|---|---|")
    for (setting, attack, org), vals in sorted(diffs.items()):
        d = [a - g for _, a, g in vals]
        se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        row = {
            "setting": setting,
            "attack": attack,
            "org": org,
            "seeds": [s for s, _, _ in vals],
            "attacked": statistics.mean(a for _, a, _ in vals),
            "gspo": statistics.mean(g for _, _, g in vals),
            "diff": statistics.mean(d),
            "se": se,
        }
        rows.append(row)
        print(
            f"| `{setting}` | {attack} | {org} | {len(vals)} | {row['attacked']:.3f} | {row['gspo']:.3f} | "
            f"{100 * row['diff']:+.1f} ± {100 * se:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
