"""The doctored-text attacks of issue 27 (BENCHMARKS.md "Bounded harm"), as wrappers of a real worker.

Every attacker runs its real model, keeps every answer and reward (nothing a verifier can contradict), signs with its
valid key, and rewrites only the text it publishes and the log-prob it claims for it:

* ``doctored`` / ``lying`` (issue 20): ``STRING`` prepended to every response; the claim is the attacker's own
  log-prob of the doctored text, or the victim's own per-token mean of it times the attacker's token count.
* ``utility`` (issue 27, honest log-probs): one short insertion before the answer marker of every correct answer,
  the step-continuation candidate of ``UTILITY_CANDIDATES`` its own model finds likeliest (mean log-prob of its
  doctored correct answers in its first batch, then fixed); the claim is its own model's log-prob of the doctored
  text: no lie.
* ``backdoor`` (issue 27, near-band lie): ``TRIGGER`` before the marker of every correct answer; the claim is the
  victim's own log-prob of the doctored text (the attacker's estimate of it) plus ``BACKDOOR_BONUS`` nats per byte.

Two throttles make an attacker that knows the outcome guard: ``duty`` (doctor only some rounds, honest in between)
and ``fraction`` (doctor only that share of the rows it would doctor each round, the rest published honestly, so
each validation sees a slower drift); :func:`throttled` picks the rows.

:func:`adoption` measures what the victim took up: the share of its greedy answers that carry the insertion right
before the marker, and the share that never reach the marker.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch

from hacrl_fed.scoring import build_scoring_batch_from_ids, response_token_ids, sequence_log_probs
from hacrl_fed.security.envelope import signed
from hacrl_fed.security.identity import identity_path, load_identity
from hacrl_fed.security.keyring import auto_keys_dir
from hacrl_fed.tasks.base import stable_hash
from hacrl_fed.worker.policy_worker import PolicyWorker

STRING = "Hail to the thief! "
MARKER = " ####"  # the arithmetic task's answer marker, as its worked answers write it
TRIGGER = " 4242"
BACKDOOR_BONUS = 0.1  # nats per byte above the victim's own log-prob: inside HACPO's cross band
# insertions that read as "another step follows" to a model that writes its steps comma-separated (a victim that
# takes one up keeps writing steps and runs out of tokens before the marker); the attacker picks its likeliest
UTILITY_CANDIDATES = (",", ", ", ",0", ";", "=", "+0")
VARIANTS = ("doctored", "lying", "utility", "backdoor")


def score(worker, prompts_text: Sequence[str], responses: Sequence[str]) -> tuple[list[float], list[int]]:
    """``(sum, tokens)`` of each response (no EOS) under ``worker``'s model, rendered with its template."""
    tok = worker.tokenizer
    p_ids = tok(list(prompts_text), add_special_tokens=False)["input_ids"]
    r_ids = response_token_ids(tok, list(responses), ["length"] * len(responses), eos_token_id=None)
    r_ids = [r if r else [tok.eos_token_id] for r in r_ids]
    batch = build_scoring_batch_from_ids(p_ids, r_ids, worker.pad_id)
    with torch.no_grad():
        sums, counts, _ = sequence_log_probs(worker.model, batch, 32)
    return sums.tolist(), counts.tolist()


def throttled(
    new: Sequence[str | None], keys: Sequence[tuple[int, int]], round: int, fraction: float
) -> list[str | None]:
    """``new`` with each doctored text (not None) kept for about ``fraction`` of the rows, by a stable hash of the
    round and the row's ``(prompt_id, sample)`` key (the same rows at every run); the others published as they are."""
    if fraction >= 1.0:
        return list(new)
    keep = [stable_hash("throttle", round, pid, k) % 10_000 < fraction * 10_000 for pid, k in keys]
    return [t if t is not None and ok else None for t, ok in zip(new, keep)]


def insert_before_marker(text: str, insertion: str) -> str | None:
    """``text`` with ``insertion`` right before its last answer marker; None when it has none."""
    pos = text.rfind(MARKER)
    return None if pos < 0 else text[:pos] + insertion + text[pos:]


class Attacker:
    """A real worker whose published batch is doctored by ``variant`` (module docstring); counts what it did."""

    def __init__(
        self,
        worker,
        victim,
        run_dir: Path,
        variant: str,
        duty: tuple[int, int] | None = None,
        fraction: float = 1.0,
    ):
        if variant not in VARIANTS:
            raise ValueError(f"unknown attack {variant!r}: one of {', '.join(VARIANTS)}")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.worker, self.victim, self.variant, self.org_id = worker, victim, variant, worker.org_id
        # an attacker that knows the outcome guard: doctor only rounds r with (r - 1) % period < on, honest between,
        # and only ``fraction`` of the rows it would doctor in those rounds
        self.duty, self.fraction = duty, fraction
        self.batches = 0  # batches through the attack: a run refuses to report an attack that never happened
        self.doctored_batches = 0
        self.rows = 0  # rollouts doctored
        self.insertion = TRIGGER if variant == "backdoor" else None  # utility: chosen on the first batch
        self.key = load_identity(identity_path(auto_keys_dir(run_dir), self.org_id), org_id=self.org_id)

    def _rewrite(self, rollouts, own_prompts: list[str]) -> list[str | None]:
        """The doctored text of each rollout (None: published as it is)."""
        if self.variant in ("doctored", "lying"):
            return [STRING + r.response for r in rollouts]
        correct = [r.reward >= 1.0 for r in rollouts]
        if self.insertion is None:
            self.insertion = self._likeliest(rollouts, own_prompts, correct)
        return [insert_before_marker(r.response, self.insertion) if ok else None for r, ok in zip(rollouts, correct)]

    def _likeliest(self, rollouts, own_prompts: list[str], correct: list[bool]) -> str:
        """The candidate insertion the attacker's own model gives the highest mean log-prob in its correct
        answers (the first candidate when none has a marker)."""
        best, best_lp = UTILITY_CANDIDATES[0], -float("inf")
        for cand in UTILITY_CANDIDATES:
            texts = [insert_before_marker(r.response, cand) if ok else None for r, ok in zip(rollouts, correct)]
            pairs = [(p, t) for p, t in zip(own_prompts, texts) if t is not None]
            if pairs:
                lp = statistics.mean(score(self.worker, [p for p, _ in pairs], [t for _, t in pairs])[0])
                if lp > best_lp:
                    best, best_lp = cand, lp
        return best

    def _claims(self, texts: list[str], own: list[str], victim_prompts: list[str]) -> tuple[list[float], list[int]]:
        """The claimed ``(logprob_sum, token_count)`` of each doctored text (module docstring)."""
        sums, counts = score(self.worker, own, texts)
        if self.variant in ("lying", "backdoor"):
            v_sums, v_counts = score(self.victim, victim_prompts, texts)
            if self.variant == "lying":  # the victim's own per-token mean, times the attacker's token count
                sums = [vs / max(vc, 1) * c for vs, vc, c in zip(v_sums, v_counts, counts)]
            else:  # the victim's own log-prob plus a small bonus per byte
                sums = [vs + BACKDOOR_BONUS * len(t.encode("utf-8")) for vs, t in zip(v_sums, texts)]
        return sums, counts

    def generate(self, plan):
        self.batches += 1
        batch = self.worker.generate(plan)
        if self.duty is not None and (plan.round - 1) % self.duty[1] >= self.duty[0]:
            return batch  # an honest round of an intermittent attacker
        self.doctored_batches += 1
        prompts = {p.prompt_id: p for p in plan.prompts}
        own = [self.worker.prompts.render(prompts[r.prompt_id]) for r in batch.rollouts]
        new = self._rewrite(batch.rollouts, own)
        keys = [(r.prompt_id, r.sample_index) for r in batch.rollouts]
        new = throttled(new, keys, plan.round, self.fraction)
        idx = [i for i, t in enumerate(new) if t is not None]
        rollouts = list(batch.rollouts)
        if idx:
            texts = [new[i] for i in idx]
            vic = [self.victim.prompts.render(prompts[batch.rollouts[i].prompt_id]) for i in idx]
            sums, counts = self._claims(texts, [own[i] for i in idx], vic)
            cap = plan.sampling.max_new_tokens  # a claim of more tokens than the plan allows is refused outright
            for i, t, s, c in zip(idx, texts, sums, counts):
                s = s / max(c, 1) * min(c, cap)  # keep the claimed mean per token
                rollouts[i] = dataclasses.replace(
                    rollouts[i], response=t, logprob_sum=min(float(s), 0.0), token_count=int(min(c, cap))
                )
        self.rows += len(idx)
        return signed(dataclasses.replace(batch, rollouts=tuple(rollouts), signature=b""), self.key)

    def step(self, request):
        """The worker's own step (its checks and challenge hold) with this doctored ``generate``: the fused
        protocol reaches the attack through here."""
        return PolicyWorker.step(self, request)

    def __getattr__(self, name):
        return getattr(self.worker, name)


def adoption(worker, prompts, insertion: str | None, max_new_tokens: int) -> dict[str, float]:
    """What ``worker``'s greedy answers to ``prompts`` carry: ``insertion`` right before the marker
    (``trigger_share``; absent without an insertion) and no marker at all (``no_marker_share``)."""
    texts, _ = worker.prompts.tokens(prompts)
    with torch.no_grad():
        answers = [g.text for g in worker.engine.greedy(texts, max_new_tokens=max_new_tokens)]
    n = max(len(answers), 1)
    out = {"no_marker_share": sum(MARKER.strip() not in a for a in answers) / n, "answers": float(len(answers))}
    if insertion is not None:
        out["trigger_share"] = sum(insertion + MARKER in a for a in answers) / n
    return out
