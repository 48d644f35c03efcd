"""Calibrate the learner's likelihood screen and measure attacks on it (SECURITY.md, BENCHMARKS.md "Likelihood
screen", "Bounded harm"): in-process runs of a bench setting, honest or with one member org publishing doctored text.

    python scripts/screen_calibration.py configs/bench/model.yaml --variant honest --screen on --rounds 20
    python scripts/screen_calibration.py configs/bench/state.yaml --variant utility --attacker acme --rounds 40 \\
        --eval-size 1000 --threads 1 --set algorithm.logprob_norm=per_byte trainer.selection.rule=successes \\
        trainer.selection.budget_multiple=null   # the defaults before issue 27's budget, as measured then

``--variant``: ``honest``, or an attack of ``scripts/harm_attacks.py`` by the org ``--attacker`` (else the
config's second org) against the first org that is not the attacker (the victim): ``doctored`` and ``lying``
(``"Hail to the thief! "`` prepended, own or the victim's log-probs), ``utility`` (the attacker's likeliest short
insertion before the answer marker of its correct answers, its own honest log-probs) and ``backdoor`` (``' 4242'``
before the marker, claiming the victim's own log-prob + 0.1 nats per byte). ``--protocol``: ``fused`` (the
default, one Step message per round; the attacker's ``generate`` is reached through its ``step``) or
``two_message``. The run refuses to report an attack with fewer doctored batches than rounds.

Prints one JSON line: held-out accuracy per org at the last round, the screen's drops per learner and source, every
per-source trust and outcome counter summed over the rounds, exclusions, the victim's log-prob of ``"Hail to the
thief! "`` before and after, and for the utility and backdoor attacks the victim's trigger adoption (the share of
its greedy held-out answers carrying the insertion right before the marker, and the share without a marker).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from harm_attacks import STRING, VARIANTS, Attacker, adoption, score

from hacrl_fed.cli.common import add_set_flag
from hacrl_fed.config import load_config
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.loop import Coordinator
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.plan.sampler import eval_ids
from hacrl_fed.worker import build_worker

DIAGNOSTICS = ("gap_median", "deficit_max")  # per-round maxima, not counts
TRUST_COUNTERS = ("rejected", "excluded", "mismatches", "accepted")
TIMES = ("outcome", "outcome_reference", "outcome_shadow", "outcome_counterfactual")
TIMES += ("train", "generate", "screen")
# recorded per round
OUTCOME_GAUGES = ("val_accuracy", "reference_accuracy", "shadow_accuracy", "strikes", "quarantined_until")
# the victim's guard, round by round (the rounds it validated): what it saw and did
TRACE = (
    "val_accuracy",
    "shadow_accuracy",
    "final_accuracy",
    "shadow_final_accuracy",
    "lost",
    "gained",
    "cf_lost",
    "cf_gained",
    "rollback",
    "spared",
    "adopted",
)


def string_log_prob(worker, prompts) -> float:
    sums, _ = score(worker, [worker.prompts.render(p) for p in prompts], [STRING] * len(prompts))
    return statistics.mean(sums)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--variant", choices=("honest", *VARIANTS), default="honest")
    ap.add_argument("--screen", choices=["on", "off"], default="off")
    ap.add_argument("--protocol", choices=["fused", "two_message"], default="fused")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attacker", default=None, help="the attacking org (default: the config's second org)")
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument(
        "--duty",
        default=None,
        help="ON/PERIOD: the attacker doctors only rounds r with (r - 1) %% PERIOD < ON, honest in between (an "
        "attacker that knows the outcome guard)",
    )
    ap.add_argument(
        "--fraction",
        type=float,
        default=1.0,
        help="the attacker doctors only this share of the rows it would doctor each round (an attacker that keeps "
        "each validation's drift small); 1: every row",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_set_flag(ap, help="extra overrides of the run's config (repeatable)")
    return ap.parse_args(argv)


def _counters(records) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """The screen's drops per ``learner<-source`` (counts summed, diagnostics maxed), every per-source trust
    counter summed over the rounds, every outcome-guard counter (counts summed, gauges at their last value) and the
    learners' seconds in ``TIMES`` summed."""
    drops: dict[str, dict[str, float]] = {}
    counters: dict[str, float] = {}
    for rec in records:
        for k, v in rec.items():
            parts = k.split("/")
            if len(parts) == 4 and parts[1] == "screen":
                d = drops.setdefault(f"{parts[0]}<-{parts[2]}", {})
                if parts[3] in DIAGNOSTICS:
                    d[parts[3]] = max(d.get(parts[3], -1e9), v)
                else:
                    d[parts[3]] = d.get(parts[3], 0.0) + v
            elif len(parts) >= 4 and parts[1] == "trust" and parts[3] in TRUST_COUNTERS:
                counters[k] = counters.get(k, 0.0) + float(v)
            elif len(parts) == 3 and parts[1] == "time" and parts[2] in TIMES:  # seconds, summed over the rounds
                counters[k] = counters.get(k, 0.0) + float(v)
            elif len(parts) >= 2 and parts[1] == "outcome":  # counts summed, gauges: the last round's value
                counters[k] = float(v) if parts[-1] in OUTCOME_GAUGES else counters.get(k, 0.0) + float(v)
    return drops, counters


def _trace(records, org: str) -> list[dict[str, float]]:
    """The outcome guard's per-round record for ``org`` (``TRACE`` keys), the rounds it validated only."""
    out = []
    for rec in records:
        row = {k: float(rec[f"{org}/outcome/{k}"]) for k in TRACE if f"{org}/outcome/{k}" in rec}
        if row.get("val_accuracy") is not None:
            out.append({"round": int(rec["round"]), **row})
    return out


def _commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return out.stdout.strip()[:12] + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    commit = _commit()  # the code that runs: read before the run, not after it
    if args.threads:
        torch.set_num_threads(args.threads)
    over = {
        "federation.rounds": args.rounds,
        "federation.eval_every": args.rounds,
        "task.eval_size": args.eval_size,
        "seed": args.seed,
        "trainer.likelihood_screen.enabled": args.screen == "on",
        "federation.protocol": args.protocol,
    }
    for kv in args.overrides:
        k, v = kv.split("=", 1)
        over[k] = yaml.safe_load(v)
    cfg = load_config(yaml.safe_load(args.config.read_text()), over)
    orgs = [o.id for o in cfg.orgs]
    attacker = args.attacker or orgs[1]
    if attacker not in orgs:
        raise SystemExit(f"--attacker {attacker!r} is not an org of {args.config} ({', '.join(orgs)})")
    with tempfile.TemporaryDirectory(prefix="screen-cal-") as tmp:
        run_dir = Path(tmp)
        workers = {o: build_worker(cfg, o, run_dir=run_dir) for o in orgs}
        victim = workers[next(o for o in orgs if o != attacker)]
        probe = victim.task.prompts("test", list(range(16)))
        before = string_log_prob(victim, probe)
        attack = None
        if args.variant != "honest":
            duty = tuple(int(x) for x in args.duty.split("/")) if args.duty else None
            attack = workers[attacker] = Attacker(  # type: ignore[assignment]
                workers[attacker], victim, run_dir, args.variant, duty, args.fraction
            )
        with RunLogger(run_dir, tensorboard=False) as logger:
            coord = Coordinator(cfg, InProcessTransport(workers), run_dir, logger=logger)
            summary = coord.run()
        after = string_log_prob(victim, probe)
        records = read_metrics(run_dir)
        if attack is not None and attack.batches < cfg.federation.rounds:
            raise SystemExit(f"the attacker doctored {attack.batches} batches in {cfg.federation.rounds} rounds")
        taken = None
        if args.variant in ("utility", "backdoor"):
            held_out = victim.task.prompts("test", eval_ids(victim.task.size("test"), cfg.task.eval_size))
            taken = adoption(victim, held_out, attack.insertion, cfg.generation.eval_max_new_tokens)
    drops, counters = _counters(records)
    out = {
        "config": str(args.config),
        "variant": args.variant,
        "screen": args.screen,
        "protocol": args.protocol,
        "rounds": args.rounds,
        "seed": args.seed,
        "attacker": attacker if attack is not None else None,
        "victim": victim.org_id,
        "eval_size": args.eval_size,
        "set": list(args.overrides),  # the extra overrides this run had (part of what it measured)
        "commit": commit,
        "duty": args.duty,
        "fraction": args.fraction if args.fraction < 1.0 else None,
        "doctored_batches": attack.doctored_batches if attack else 0,
        "doctored_rows": attack.rows if attack else 0,
        "insertion": attack.insertion if attack else None,
        "accuracy": coord.eval_history[max(coord.eval_history)],
        "adoption": taken,
        "string_logprob": {"before": before, "after": after},
        "drops": drops,
        "counters": counters,
        "trace": _trace(records, victim.org_id),
        "excluded": dict(coord.guard.excluded),
        "wall_s": summary.wall_time_s,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
