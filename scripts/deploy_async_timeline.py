"""Where a Flower deployment step's seconds go, lock-step vs asynchronous rounds (issue 29, deliverable 3):

    python scripts/deploy_async_timeline.py [--rounds 4] [--staleness 1 0] [--json F]

One run of the smoke config (micro agents, real policy workers) on a loopback deployment per ``federation.staleness``
value (``hacrl-fed bench system``'s deployment case: :mod:`hacrl_tools.deploy_local`, the SuperNodes' DEBUG logs read
by :mod:`hacrl_tools.bench.deploy_timeline`). Prints, per run, the median seconds of each piece of a round message's
cycle ± the standard error of the mean over the SuperNodes' round messages, and the fixed cost per step an org sees
(``cycle - app``: everything but the ClientApp's own work); ``--json`` writes the runs. One run per value: a
difference between runs is machine load as much as protocol unless it is far past the pieces' errors.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hacrl_fed.config import load_config
from hacrl_tools.bench.deploy_timeline import PIECES
from hacrl_tools.bench.system import SMOKE, _deployment_settings, _run_deployment
from hacrl_tools.deploy_local import identity_overrides


def one_run(rounds: int, staleness: int, timeout_s: float) -> dict[str, Any]:
    """The smoke config at ``federation.staleness=staleness`` on a fresh loopback deployment: its timeline."""
    base = [f"federation.rounds={rounds}", "federation.eval_every=0", "task.eval_size=8"]
    base.append(f"federation.staleness={staleness}")
    orgs = [o.id for o in load_config(SMOKE, base).orgs]
    dep_dir = Path(tempfile.mkdtemp(prefix="hacrl-dep-"))  # short: unix socket paths must fit
    overrides = [*base, *identity_overrides(dep_dir / "identity_set", orgs)]
    env, run_config = _deployment_settings(overrides, dep_dir / "run", None, None)
    try:
        started, run_s, _, pieces = _run_deployment(dep_dir, env, orgs, overrides, run_config, timeout_s)
    finally:
        shutil.rmtree(dep_dir, ignore_errors=True)
    return {"staleness": staleness, "rounds": rounds, "start_s": started, "run_s": run_s, "timeline": pieces}


def table(runs: list[dict[str, Any]]) -> str:
    """One column per run: each piece's median ± SE, the cycle, and the fixed cost per step (cycle - app)."""
    lines = ["| piece | " + " | ".join(f"K = {r['staleness']}" for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
    for piece in [p for p, _, _ in PIECES] + ["cycle"]:
        cells = [f"{r['timeline'][piece]:.3f} ± {r['timeline'][piece + '_se']:.3f}" for r in runs]
        lines.append(f"| {piece} | " + " | ".join(cells) + " |")
    fixed = [r["timeline"]["cycle"] - r["timeline"]["app"] for r in runs]
    lines.append("| fixed cost / step (cycle - app) | " + " | ".join(f"{x:.3f}" for x in fixed) + " |")
    lines.append("| messages | " + " | ".join(f"{r['timeline']['messages']:.0f}" for r in runs) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 0], help="one run per value (K)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    p.add_argument("--json", type=Path, default=None, help="write the runs here")
    args = p.parse_args()
    runs = [one_run(args.rounds, k, args.timeout) for k in args.staleness]
    print(table(runs))
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
