"""Calibrate the learner's likelihood screen (SECURITY.md, BENCHMARKS.md "Likelihood screen"): short in-process
runs of a bench setting, honest or with one member org publishing doctored text, screen on and off.

    python scripts/screen_calibration.py configs/bench/model.yaml --variant honest --screen on --rounds 20

``--variant``: ``honest``; ``doctored`` (the attacker, ``--attacker`` or else the second org of the config, inserts
``--string`` at the start of every response it publishes, answers unchanged, log-probs its own model's of the
doctored text, signed with its valid key); ``lying`` (the same text, but each claimed log-prob is the victim's own
per-token mean of it times the attacker's token count: the claim that puts HACPO's cross ratio at 1 for the
victim, the first org that is not the attacker). Prints one JSON line: held-out accuracy per org at the last
round, the screen's drops per learner and source, and the victim's log-prob of the string (sum, nats, mean over 16
held-out prompts) before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from hacrl_fed.cli.common import add_set_flag
from hacrl_fed.config import load_config
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.loop import Coordinator
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.scoring import build_scoring_batch_from_ids, response_token_ids, sequence_log_probs
from hacrl_fed.security.envelope import signed
from hacrl_fed.security.identity import identity_path, load_identity
from hacrl_fed.security.keyring import auto_keys_dir
from hacrl_fed.worker import build_worker
from hacrl_fed.worker.policy_worker import PolicyWorker

STRING = "Hail to the thief! "


def _score(worker, prompts_text: list[str], responses: list[str]) -> tuple[list[float], list[int]]:
    """``(sum, tokens)`` of each response (no EOS) under ``worker``'s model, rendered with its template."""
    tok = worker.tokenizer
    p_ids = tok(prompts_text, add_special_tokens=False)["input_ids"]
    r_ids = response_token_ids(tok, responses, ["length"] * len(responses), eos_token_id=None)
    r_ids = [r if r else [tok.eos_token_id] for r in r_ids]
    batch = build_scoring_batch_from_ids(p_ids, r_ids, worker.pad_id)
    sums, counts, _ = sequence_log_probs(worker.model, batch, 32)
    return sums.tolist(), counts.tolist()


class Doctor:
    """The attacker: a real worker whose published batch carries ``STRING`` in every response."""

    def __init__(self, worker, victim, run_dir: Path, lying: bool):
        self.worker, self.victim, self.lying, self.org_id = worker, victim, lying, worker.org_id
        self.batches = 0  # batches doctored: the run refuses to report an attack that never happened
        self.key = load_identity(identity_path(auto_keys_dir(run_dir), self.org_id), org_id=self.org_id)

    def generate(self, plan):
        self.batches += 1
        batch = self.worker.generate(plan)
        prompts = {p.prompt_id: p for p in plan.prompts}
        texts = [STRING + r.response for r in batch.rollouts]
        own = [self.worker.prompts.render(prompts[r.prompt_id]) for r in batch.rollouts]
        sums, counts = _score(self.worker, own, texts)
        if self.lying:  # the victim's own per-token mean, as an attacker with a similar model would estimate it
            v_sums, v_counts = _score(
                self.victim, [self.victim.prompts.render(prompts[r.prompt_id]) for r in batch.rollouts], texts
            )
            sums = [vs / max(vc, 1) * c for vs, vc, c in zip(v_sums, v_counts, counts)]
        cap = plan.sampling.max_new_tokens  # a claim of more tokens than the plan allows is refused outright
        sums = [s / max(c, 1) * min(c, cap) for s, c in zip(sums, counts)]  # keep the claimed mean per token
        counts = [min(c, cap) for c in counts]
        rollouts = tuple(
            dataclasses.replace(r, response=t, logprob_sum=min(float(s), 0.0), token_count=int(c))
            for r, t, s, c in zip(batch.rollouts, texts, sums, counts)
        )
        return signed(dataclasses.replace(batch, rollouts=rollouts, signature=b""), self.key)

    def step(self, request):
        """The worker's own step (its checks and challenge hold) with this doctored ``generate``."""
        return PolicyWorker.step(self, request)

    def __getattr__(self, name):
        return getattr(self.worker, name)


def string_log_prob(worker, prompts) -> float:
    with torch.no_grad():
        sums, _ = _score(worker, [worker.prompts.render(p) for p in prompts], [STRING] * len(prompts))
    return statistics.mean(sums)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--variant", choices=["honest", "doctored", "lying"], default="honest")
    ap.add_argument("--screen", choices=["on", "off"], default="off")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attacker", default=None, help="the attacking org (default: the config's second org)")
    ap.add_argument("--eval-size", type=int, default=100)
    add_set_flag(ap, help="extra overrides of the run's config (repeatable)")
    args = ap.parse_args(argv)
    raw = yaml.safe_load(args.config.read_text())
    over = {
        "federation.rounds": args.rounds,
        "federation.eval_every": args.rounds,
        "task.eval_size": args.eval_size,
        "seed": args.seed,
        "trainer.likelihood_screen.enabled": args.screen == "on",
        # two messages per round: the coordinator then calls the attacker's generate() (the fused Step would run
        # the wrapped worker's own generate and publish undoctored text); the numbers are the fused protocol's
        "federation.protocol": "two_message",
    }
    for kv in args.overrides:
        k, v = kv.split("=", 1)
        over[k] = yaml.safe_load(v)
    cfg = load_config(raw, over)
    orgs = [o.id for o in cfg.orgs]
    with tempfile.TemporaryDirectory(prefix="screen-cal-") as tmp:
        run_dir = Path(tmp)
        workers = {o: build_worker(cfg, o, run_dir=run_dir) for o in orgs}
        attacker = args.attacker or orgs[1]
        if attacker not in orgs:
            ap.error(f"--attacker {attacker!r} is not an org of {args.config} ({', '.join(orgs)})")
        victim = workers[next(o for o in orgs if o != attacker)]
        probe = victim.task.prompts("test", list(range(16)))
        before = string_log_prob(victim, probe)
        if args.variant != "honest":
            workers[attacker] = Doctor(workers[attacker], victim, run_dir, lying=args.variant == "lying")
        with RunLogger(run_dir, tensorboard=False) as logger:
            coord = Coordinator(cfg, InProcessTransport(workers), run_dir, logger=logger)
            summary = coord.run()
        after = string_log_prob(victim, probe)
        records = read_metrics(run_dir)
        doctored = workers[attacker].batches if isinstance(workers[attacker], Doctor) else 0
        if args.variant != "honest" and doctored < cfg.federation.rounds:
            raise SystemExit(f"the attacker doctored {doctored} batches in {cfg.federation.rounds} rounds")
    final = coord.eval_history[max(coord.eval_history)]
    drops: dict[str, dict[str, float]] = {}
    for rec in records:
        for k, v in rec.items():
            parts = k.split("/")
            if len(parts) == 4 and parts[1] == "screen":
                d = drops.setdefault(f"{parts[0]}<-{parts[2]}", {})
                if parts[3] in ("gap_median", "deficit_max"):
                    d[parts[3]] = max(d.get(parts[3], -1e9), v)
                else:
                    d[parts[3]] = d.get(parts[3], 0.0) + v
    out = {
        "config": str(args.config),
        "variant": args.variant,
        "screen": args.screen,
        "rounds": args.rounds,
        "seed": args.seed,
        "attacker": attacker if args.variant != "honest" else None,
        "victim": victim.org_id,
        "eval_size": args.eval_size,
        "set": list(args.overrides),  # the extra overrides this run had (part of what it measured)
        "doctored_batches": doctored,
        "accuracy": final,
        "string_logprob": {"before": before, "after": after},
        "drops": drops,
        "excluded": dict(coord.guard.excluded),
        "wall_s": summary.wall_time_s,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
