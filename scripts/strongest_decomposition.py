"""Why the strongest org gains little: decompose each org's update round by round in a real run (issue 30).

    python scripts/strongest_decomposition.py --setting three --method hacpo_defended gspo_x2 --seed 0 \
        --rounds 30 --eval-size 200 --out benchmarks/issue30/decomposition.json

Each (setting, method) runs as the matrix cell of that name (configs/bench/matrix.yaml) for ``--rounds`` rounds, one
torch thread, and every org's own-row advantages are compared with GSPO's over ``--ref-size`` own rows (the
setting's G; GSPO×2's group of 2G is compared with its two halves). Figures and their reading:
hacrl_tools/bench/strongest.py and BENCHMARKS.md "Why the strongest org gains little". The JSON is appended to
(one entry per run) so the pieces can run one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", nargs="+", default=["three", "size"])
    p.add_argument("--method", nargs="+", default=["hacpo_defended", "gspo_x2"])
    p.add_argument("--seed", type=int, nargs="+", default=[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--ref-size", type=int, default=8, help="own rows of the reference group (the setting's G)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra config overrides")
    p.add_argument(
        "--org-rule",
        nargs="*",
        default=[],
        metavar="ORG=RULE",
        help="this org's trainer.selection.rule (the others keep the method's), e.g. acme=all",
    )
    p.add_argument("--out", type=Path, help="the JSON the runs are appended to")
    p.add_argument("--table", type=Path, nargs="*", help="print the markdown table of these JSONs and exit")
    p.add_argument("--orgs", nargs="*", default=[], help="--table: only these orgs")
    p.add_argument("--compare", type=Path, nargs="*", help="print the accuracy comparison of these JSONs and exit")
    args = p.parse_args()

    if args.table:
        from hacrl_tools.bench.strongest import TABLE_HEAD, table_rows

        runs = [run for path in args.table for run in json.loads(path.read_text())["runs"]]
        print("\n".join([TABLE_HEAD, *table_rows(runs, args.orgs)]))
        return 0
    if args.compare:
        from hacrl_tools.bench.strongest import compare_rows

        runs = [run for path in args.compare for run in json.loads(path.read_text())["runs"]]
        print("| setting | org | method | seeds | final accuracy (per seed) | − gspo_x2, points (paired) |")
        print("|---|---|---|---|---|---|")
        print("\n".join(compare_rows(runs)))
        return 0
    if args.out is None:
        p.error("--out is required (or --table)")
    import torch

    from hacrl_fed.config import parse_overrides
    from hacrl_tools.bench.strongest import run_decomposition

    torch.set_num_threads(1)
    extra = parse_overrides(list(args.set)) if args.set else {}
    org_rules = dict(item.split("=", 1) for item in args.org_rule)
    runs = json.loads(args.out.read_text())["runs"] if args.out.exists() else []
    for setting in args.setting:
        for method in args.method:
            for seed in args.seed:
                t0 = time.time()
                res = run_decomposition(
                    setting,
                    method,
                    seed,
                    rounds=args.rounds,
                    eval_size=args.eval_size,
                    ref_size=args.ref_size,
                    extra=extra,
                    org_rules=org_rules,
                )
                res["extra"] = extra
                runs.append(res)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
                acme = res["orgs"].get("acme", {})
                print(
                    f"{setting}/{method}/seed{seed}: {time.time() - t0:.0f}s acme after {acme.get('accuracy_after')}"
                    f" mean_shift {acme.get('mean_shift')}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
