"""Bounded harm (issue 20, SECURITY.md): each honest org under a doctored-text attack against its isolated GSPO.

    python scripts/bounded_harm.py benchmarks/screen/bounded-harm.jsonl --results benchmarks/results
    python scripts/bounded_harm.py benchmarks/screen/outcome-guard-final.jsonl --per-run   # and one row per run

Reads the JSON lines of ``scripts/screen_calibration.py`` runs (one per setting, variant, seed) and, for every honest
org of a run (not the attacker), the matrix cell ``<results>/<setting>/gspo/seed<k>.json`` of the same seed (the
same held-out prompts: the eval draw depends on the seed) at the run's number of rounds (its curve point). Prints,
per setting, variant and protocol, each honest org's final accuracy under attack, its isolated GSPO accuracy, and
the difference paired by seed (mean ± standard error over seeds); ``--json`` writes the table. ``--per-run`` first
prints one row per run: every honest org's accuracy and difference, and what the victim's outcome guard did (the
rounds it rolled back and adopted its shadow, the attacker's rows it quarantined, the screen's drops).
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


def _attack(run: dict) -> str:
    """A run's attack label: variant, attacker, duty and (other than fused) protocol."""
    by = f", by {run['attacker']}" if run.get("attacker") else ""
    by += f", doctoring {run['duty']} rounds" if run.get("duty") else ""
    by += f", doctoring {run['fraction']:g} of its rows" if run.get("fraction") else ""
    by += f", {run['protocol']}" if run.get("protocol", "fused") != "fused" else ""
    return f"{run['variant']}{by}"


def _guard_row(run: dict, setting: str, alone: dict[str, float]) -> str:
    """One run's row of ``--per-run``: honest orgs against GSPO, and the victim's guard actions."""
    attacker, victim = run.get("attacker"), run.get("victim")
    orgs = ", ".join(
        f"{org} {acc:.3f} ({100 * (acc - alone[org]):+.1f})"
        for org, acc in sorted(run["accuracy"].items())
        if org != attacker and org in alone
    )
    trace = run.get("trace") or []
    rolled = ",".join(str(t["round"]) for t in trace if t.get("rollback")) or "–"
    adopted = ",".join(str(t["round"]) for t in trace if t.get("adopted")) or "–"
    counters = run.get("counters") or {}
    quarantined = int(counters.get(f"{victim}/outcome/{attacker}/dropped_quarantine", 0))
    drops = (run.get("drops") or {}).get(f"{victim}<-{attacker}", {})
    dropped = int(drops.get("dropped_low_likelihood", 0) + drops.get("dropped_claim_outlier", 0))
    seen = run.get("adoption") or {}
    habit = f"{100 * seen.get('no_marker_share', 0):.1f} % / {100 * seen.get('trigger_share', 0):.1f} %"
    return (
        f"| {run['seed']} | `{setting}` | {_attack(run)} | {orgs} | {habit} | {rolled} / {adopted} | {quarantined} | "
        f"{dropped} of {run.get('doctored_rows', 0)} | {str(run.get('commit', ''))[:7]} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--per-run", action="store_true", help="first one row per run, with the victim's guard actions")
    args = ap.parse_args(argv)
    diffs: dict[tuple[str, str, str], list[tuple[int, float, float]]] = defaultdict(list)
    lines = [line for path in args.runs for line in path.read_text().splitlines() if line.strip()]
    if args.per_run:
        print(
            "| seed | setting | attack | honest orgs: accuracy (− alone, points) | victim's answers without a marker "
            "/ with the insertion | victim's rollbacks / adoptions (rounds) | attacker's rows quarantined at the "
            "victim | screen drops at the victim | commit |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
    for line in lines:
        run = json.loads(line)
        setting = Path(run["config"]).stem
        alone = _gspo(args.results, setting, run["seed"], run["rounds"])
        if alone is None:
            print(
                f"no isolated GSPO cell for {setting} seed {run['seed']} at round {run['rounds']}: skipped",
                file=sys.stderr,
            )
            continue
        if args.per_run:
            print(_guard_row(run, setting, alone))
        for org, acc in run["accuracy"].items():
            if org != run.get("attacker") and org in alone:
                extra = "".join(f", {kv}" for kv in run.get("set", []))  # runs of other configs stay apart
                diffs[(setting, f"{_attack(run)} (screen {run['screen']}{extra})", org)].append(
                    (run["seed"], acc, alone[org])
                )
    if args.per_run:
        print()
    common = {attack[attack.index(" (") :] for _, attack, _ in diffs}
    if len(common) == 1:  # every run with the same screen and overrides: say it once
        print(f"Every run{common.pop()}:\n")
        diffs = defaultdict(list, {(st, a[: a.index(" (")], o): v for (st, a, o), v in diffs.items()})
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
