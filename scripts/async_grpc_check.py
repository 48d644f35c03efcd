"""Does the virtual clock predict a real asynchronous run? (issue 29: "one real-process run, gRPC, one org slowed for
real, that checks the virtual clock's prediction")

    python scripts/async_grpc_check.py [--rounds 16] [--slowdown 4] [--json benchmarks/issue29/grpc-check.json]

Runs ``hacrl-fed run --transport grpc`` (one ``hacrl-fed worker`` process per org, the wall clock) twice on two
small zoo agents, the second org slowed for real (``HACRL_FED_BENCH_SLOWDOWN=globex=F`` in the environment of the
run, which its worker processes inherit: :mod:`hacrl_fed.worker.pacing`; its worker sleeps ``F - 1`` times each step's
compute time): ``K = 1`` (default window), and no lead bound (``K = 1000``, ``W = rounds + 1``). From
each run's metrics.jsonl it measures each org's step durations and feeds their means to the virtual clock
(:func:`hacrl_fed.coordinator.async_schedule.simulate`), then compares (:func:`hacrl_tools.bench.clock_check.compare`)
each org's finish, its lead over the slow org, its idle time and every step's end. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from hacrl_fed.metrics import read_metrics
from hacrl_fed.worker.pacing import SLOWDOWN_ENV
from hacrl_tools.bench.clock_check import compare

ROOT = Path(__file__).resolve().parents[1]
ORGS = ("acme", "globex")  # globex is the slowed one
SLOW = "globex"


def run_config(name: str, rounds: int, staleness: int, window: int | None) -> dict[str, Any]:
    """Two zoo agents of configs/bench/model.yaml (qwen-char, gpt2-bpe) with a small batch and evaluation, over gRPC
    (the second one's slowdown is the run's environment: :func:`run_arm`)."""
    return {
        "name": name,
        "seed": 0,
        "algorithm": {"name": "hacpo"},
        "trainer": {"lr": 1.0e-4, "minibatch_size": 64, "micro_batch_size": 64},
        "generation": {"engine": "fast", "num_samples": 8, "max_new_tokens": 32, "eval_max_new_tokens": 32},
        "task": {"name": "arithmetic", "params": {"difficulty": 2}, "eval_size": 16},
        "orgs": [
            {"id": "acme", "model": {"zoo": "qwen-char"}},
            {"id": "globex", "model": {"zoo": "gpt2-bpe"}},
        ],
        "federation": {
            "rounds": rounds,
            "prompts_per_round": 8,
            "eval_every": 0,
            "min_orgs": 1,
            "staleness": staleness,
            "window": window,
            "transport": "grpc",
        },
    }


def run_arm(cfg: dict[str, Any], work: Path, timeout_s: float, slowdown: float) -> tuple[list[dict[str, Any]], float]:
    """``hacrl-fed run CONFIG --transport grpc`` in a fresh run dir under ``work``, the slow org's worker slowed
    ``slowdown`` times; its metrics records and the command's wall seconds (workers' start-up included)."""
    config, run_dir = work / f"{cfg['name']}.yaml", work / cfg["name"]
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = [sys.executable, "-m", "hacrl_fed.cli", "run", str(config), "--transport", "grpc"]
    argv += ["--run-dir", str(run_dir), "--no-progress", "--log-level", "WARNING"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env[SLOWDOWN_ENV] = f"{SLOW}={slowdown:g}"  # a benchmark's setting, not the run config's
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{cfg['name']}: hacrl-fed run exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return read_metrics(run_dir), time.monotonic() - t0


def table(arms: dict[str, Any]) -> str:
    """One line per arm and org: measured steps, then real vs predicted finish, leads, idle; the arm's MAE."""
    head = (
        f"{'arm':6} {'org':7} {'step s mean±sd (cv)':>22} {'finish real/pred (err)':>26} "
        f"{'lead@fin r/p':>12} {'max lead r/p':>12} {'idle real/pred':>15}"
    )
    lines = [head, "-" * len(head)]
    for arm, out in arms.items():
        cmp = out["schedule"]
        for org, row in cmp["orgs"].items():
            s, f, i = row["step_s"], row["finish_s"], row["idle_s"]
            lead, top = row["lead_at_finish"], row["max_lead"]
            lines.append(
                f"{arm:6} {org:7} {s['mean']:8.3f}±{s['sd']:.3f} ({s['cv']:4.2f}) "
                f"{f['real']:9.2f}/{f['predicted']:7.2f} ({f['error_pct']:+5.1f}%) "
                f"{lead['real']:6d}/{lead['predicted']:<5d} {top['real']:6d}/{top['predicted']:<5d} "
                f"{i['real']:7.2f}/{i['predicted']:<7.2f}"
            )
        call = out["call"]
        lines.append(
            f"{arm:6} step ends: MAE {cmp['step_end_mae_s']:.3f} s = {cmp['step_end_mae_pct']:.1f}% of the "
            f"{cmp['run_s']:.1f} s run (durations from call seconds: {call['step_end_mae_pct']:.1f}%)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--slowdown", type=float, default=4.0, help=f"{SLOW}'s slowdown ({SLOWDOWN_ENV})")
    p.add_argument("--work", type=Path, default=None, help="where the configs and run dirs go (default: a temp dir)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "issue29" / "grpc-check.json")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--note", default="", help="recorded in the JSON (e.g. what else the machine ran)")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="async-grpc-check-"))
    work.mkdir(parents=True, exist_ok=True)
    arms_spec = {"k1": (1, None), "open": (1000, args.rounds + 1)}
    arms, load_before = {}, os.getloadavg()
    for arm, (k, w) in arms_spec.items():
        cfg = run_config(f"grpc-check-{arm}", args.rounds, k, w)
        records, wall_s = run_arm(cfg, work, args.timeout_s, args.slowdown)
        arms[arm] = {
            "config": cfg,
            "command_wall_s": wall_s,
            "schedule": compare(records, ORGS, args.rounds, k, w, SLOW, basis="schedule"),
            "call": compare(records, ORGS, args.rounds, k, w, SLOW, basis="call"),
        }
    print(table(arms))
    out = {
        "what": "issue 29: the virtual clock's prediction against real gRPC worker processes",
        "slow_org": SLOW,
        "slowdown": args.slowdown,
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "host": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "note": args.note,
        "python": platform.python_version(),
        "arms": arms,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
