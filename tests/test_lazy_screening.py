"""Lazy screening for ``peer_sample`` (hacrl_fed/worker/intake.py ``screen_sources(lazy=...)``): sources are opened
and checked in the selection's seeded source order only until its budget is full, the rest are counted
``trust/<source>/unscreened`` and never opened, a forged or lying source costs a check and is passed over, and the
rows the selection takes are exactly those it takes after a full screen."""

from __future__ import annotations

import dataclasses

import pytest

from hacrl_fed.algorithm.selection import select_rollouts, source_order
from hacrl_fed.config import load_config
from hacrl_fed.security.envelope import RejectedBatch
from hacrl_fed.types import ChatMessage, Prompt, Rollout, RolloutBatch, TrainRequest
from hacrl_fed.worker.intake import LazyTake, screen_sources

G, MAX_NEW = 2, 8
SOURCES = ["o1", "o2", "o3", "o4", "o5"]
PROMPTS = tuple(Prompt(pid, (ChatMessage("user", f"{pid}+0"),), str(pid)) for pid in (10, 20))


def make_cfg(n_orgs: int = len(SOURCES)):
    orgs = [{"id": o, "model": {"zoo": "micro-qwen-char"}} for o in ["me", *SOURCES[:n_orgs]]]
    return load_config({
        "name": "lazy", "seed": 0, "orgs": orgs, "algorithm": {"name": "hacpo"},
        "generation": {"num_samples": G, "max_new_tokens": MAX_NEW, "eval_max_new_tokens": MAX_NEW},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
        "federation": {"prompts_per_round": len(PROMPTS)},
        "security": {"signing": True},
    })


def batch_of(src: str, reward: float = 1.0) -> RolloutBatch:
    rollouts = tuple(
        Rollout(src, 3, p.prompt_id, j, "the answer is 0", "stop", reward, -2.0, 3) for p in PROMPTS for j in range(G)
    )
    return RolloutBatch("run", 3, src, rollouts, reward)


class Opener:
    """``open_source`` as the worker passes it: records which sources it opened; ``forged`` ones fail their
    signature check."""

    def __init__(self, forged=()):
        self.opened: list[str] = []
        self.forged = set(forged)

    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        self.opened.append(batch.org_id)
        if batch.org_id in self.forged:
            raise RejectedBatch("bad_signature", f"batch of {batch.org_id}: bad signature")
        return batch


def screen(batches, *, lazy=None, opener=None, cfg=None):
    request = TrainRequest("run", 3, "me", PROMPTS, (), {}, source_batches=tuple(batches))
    verify = lambda text, ref: 1.0  # noqa: E731  every claim of 1.0 holds, a claim of 0.0 is a mismatch
    return screen_sources(cfg or make_cfg(), "me", request, prompts=PROMPTS, task="arithmetic", verify=verify,
                          open_source=opener or Opener(), lazy=lazy)


def take(budget, seed=5):
    return LazyTake(order=lambda names: source_order(names, seed), budget=budget)


@pytest.mark.parametrize("budget", [0, 1, 4, 5, 9, 100])
def test_only_the_sources_the_budget_reaches_are_opened(budget):
    order = source_order(SOURCES, 5)
    per_source = len(PROMPTS) * G  # 4 rows each
    reached = order[: min(len(order), -(-budget // per_source))]  # ceil(budget / 4) sources
    opener = Opener()
    accepted, metrics = screen([batch_of(s) for s in SOURCES], lazy=take(budget), opener=opener)
    assert opener.opened == reached
    assert {r.org_id for r in accepted} == set(reached)
    for s in SOURCES:
        assert metrics[f"trust/{s}/received"] == per_source
        assert metrics[f"trust/{s}/unscreened"] == (0 if s in reached else per_source)
        assert metrics[f"trust/{s}/checked"] == (per_source if s in reached else 0)


@pytest.mark.parametrize("budget", [0, 1, 3, 4, 5, 8, 11, 100])
@pytest.mark.parametrize("seed", [0, 1, 5])
def test_a_lazy_screen_selects_what_a_full_screen_selects(budget, seed):
    own = [dataclasses.make_dataclass("Own", ["group", "reward"])(p.prompt_id, 0.0) for p in PROMPTS]
    batches = [batch_of(s) for s in reversed(SOURCES)]  # arrival order differs from the names' order
    full, _ = screen(batches)
    lazy, _ = screen(batches, lazy=take(budget, seed))
    a, _ = select_rollouts(full, own, "peer_sample", budget, None, seed)
    b, _ = select_rollouts(lazy, own, "peer_sample", budget, None, seed)
    assert a == b and len(a) == min(budget, len(full))


def test_a_forged_or_lying_source_costs_a_check_and_the_next_source_fills_the_budget():
    order = source_order(SOURCES, 5)
    forged, liar = order[0], order[1]
    batches = [batch_of(s, reward=0.0 if s == liar else 1.0) for s in SOURCES]  # the liar's claims contradict
    opener = Opener(forged=[forged])
    accepted, metrics = screen(batches, lazy=take(4), opener=opener)
    assert opener.opened == order[:3]  # forged (refused), liar (excluded), then an honest source fills the budget
    assert {r.org_id for r in accepted} == {order[2]}
    assert metrics[f"trust/{forged}/rejected/bad_signature"] == 4
    assert metrics[f"trust/{liar}/excluded"] == 1.0 and metrics[f"trust/{liar}/mismatches"] == 4
    assert all(metrics[f"trust/{s}/unscreened"] == 4 for s in order[3:])


def test_a_duplicate_batch_is_counted_before_anything_is_opened():
    opener = Opener()
    _, metrics = screen([batch_of("o1"), batch_of("o1"), batch_of("o2")], lazy=take(100), opener=opener)
    assert sorted(opener.opened) == ["o1", "o2"]
    assert metrics["trust/o1/rejected/duplicate_source"] == 4


def test_without_lazy_every_source_is_screened_and_no_unscreened_count_appears():
    opener = Opener()
    _, metrics = screen([batch_of(s) for s in SOURCES], opener=opener)
    assert opener.opened == SOURCES
    assert not any(k.endswith("/unscreened") for k in metrics)
