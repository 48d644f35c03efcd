"""trainer.selection in the worker: rows left out are never re-tokenized or scored, the counts reach the TrainReport
and metrics.jsonl, and rule ``all`` without a budget is bit-identical to the code path without selection."""

import math

import pytest
import torch

from hacrl_fed.config import load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.metrics import RunLogger, read_metrics
from hacrl_fed.types import RoundPlan, SamplingParams, TrainRequest
from hacrl_fed.worker import build_worker, intake

ORGS = [{"id": "char", "model": {"zoo": "micro-qwen-char"}}, {"id": "bpe", "model": {"zoo": "micro-gpt2-bpe"}}]


def make_cfg(selection=None, **extra):
    data = {"name": "sel", "seed": 3, "orgs": ORGS, "algorithm": {"name": "hacpo"},
            "trainer": {"lr": 1e-3, "minibatch_size": 16, "micro_batch_size": 8, "selection": selection or {"rule": "all"},
                        "likelihood_screen": {"enabled": False}},  # the screen has its own tests
            "generation": {"num_samples": 4, "max_new_tokens": 12, "eval_max_new_tokens": 12},
            "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
            "security": {"signing": False, "reverify_rewards": False}}
    data.update(extra)
    return load_config(data)


def plan_for(worker, round_=1, n=4):
    prompts = tuple(worker.task.prompts("train", list(range(round_ * 10, round_ * 10 + n))))
    return RoundPlan("run", round_, "arithmetic", prompts, SamplingParams(max_new_tokens=12, num_samples=4, seed=11))


def no_selection(foreign, *args, **kwargs):
    """The code path before selection existed: every screened foreign rollout goes on to be scored."""
    return list(foreign), {}


def one_update(cfg, tmp_path, foreign_rewards):
    """Generate with both orgs, then train ``char`` on ``bpe``'s rollouts (rewards replaced by ``foreign_rewards``
    so the joint groups are not uniform); returns the learner and its report."""
    a, b = build_worker(cfg, "char", run_dir=tmp_path / "a"), build_worker(cfg, "bpe", run_dir=tmp_path / "b")
    plan = plan_for(a)
    a.generate(plan)
    rb = b.generate(plan)
    foreign = tuple(
        r.__class__(**{**r.__dict__, "reward": float(foreign_rewards(i))}) for i, r in enumerate(rb.rollouts)
    )
    return a, a.train(TrainRequest("run", 1, "char", plan.prompts, foreign, {"char": 0.5, "bpe": 0.25}))


@pytest.fixture
def scored(monkeypatch):
    """Counts the foreign responses the learner re-tokenizes (each one it scores and trains on)."""
    calls: list[int] = []
    real = intake.response_token_ids

    def spy(tokenizer, texts, *args, **kwargs):
        calls.append(len(texts))
        return real(tokenizer, texts, *args, **kwargs)

    monkeypatch.setattr(intake, "response_token_ids", spy)
    return calls


@pytest.mark.parametrize(
    ("selection", "expected"),
    [({"rule": "peer_sample", "budget": 5}, 5), ({"rule": "successes"}, 6),
     ({"rule": "peer_sample", "budget_multiple": 0.5}, 8)],
)
def test_rows_left_out_are_never_scored(tmp_path, scored, selection, expected):
    # 16 foreign rows, 6 of them successes (rows 0, 3, 6, 9, 12, 15)
    _, report = one_update(make_cfg(selection), tmp_path, lambda i: i % 3 == 0)
    m = report.metrics
    assert sum(scored) == expected == m["select/selected"] == m["select/bpe/selected"]
    assert m["train/num_cross"] + m["train/foreign_unscored"] == expected
    assert m["select/offered"] == 16 and m["train/foreign_received"] == 16
    assert m["select/dropped_rule"] + m["select/dropped_budget"] == 16 - expected
    if "budget" in selection or "budget_multiple" in selection:
        assert m["select/budget"] == expected and m["select/dropped_budget"] == 16 - expected


def test_all_without_budget_scores_every_row_and_counts_them(tmp_path, scored):
    _, report = one_update(make_cfg(), tmp_path, lambda i: i % 2)
    m = report.metrics
    assert sum(scored) == 16 and m["select/bpe/offered"] == m["select/bpe/selected"] == 16
    assert m["select/bpe/dropped_rule"] == m["select/bpe/dropped_budget"] == 0 and "select/budget" not in m


def test_all_update_is_bit_identical_to_the_path_without_selection(tmp_path, monkeypatch):
    cfg = make_cfg()
    a, with_sel = one_update(cfg, tmp_path / "with", lambda i: i % 2)
    monkeypatch.setattr(intake, "select_rollouts", no_selection)
    b, without = one_update(cfg, tmp_path / "without", lambda i: i % 2)
    for (name, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(x, y), name
    assert any(k.startswith("select/") for k in with_sel.metrics)
    assert _comparable(with_sel.metrics) == _comparable(without.metrics)


def _comparable(metrics):
    """Everything but wall and CPU times, perf counters and the selection counts (absent on the old path)."""
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "cpu/", "perf/", "select/"))}


def run(cfg, run_dir):
    workers = {o.id: build_worker(cfg, o.id, run_dir=run_dir) for o in cfg.orgs}
    with RunLogger(run_dir, tensorboard=False) as logger:
        Coordinator(cfg, InProcessTransport(workers), run_dir, logger=logger).run()
    return workers, read_metrics(run_dir)


RUN = {"federation": {"rounds": 2, "prompts_per_round": 4, "eval_every": 0, "checkpoint_every": 0, "min_orgs": 1}}


def _record_values(records, skip=("wall_time",)):
    out = []
    for rec in records:
        out.append({k: v for k, v in rec.items() if k not in skip and "/time/" not in k and "/cpu/" not in k
                    and not k.startswith("time/") and "/perf/" not in k and "/select/" not in k})
    return out


def test_all_run_is_bit_identical_to_the_path_without_selection(tmp_path, monkeypatch):
    cfg = make_cfg(**RUN)
    workers_a, rec_a = run(cfg, tmp_path / "with")
    monkeypatch.setattr(intake, "select_rollouts", no_selection)
    workers_b, rec_b = run(cfg, tmp_path / "without")
    assert [r["round"] for r in rec_a] == [0, 1, 2]
    assert any("char/select/bpe/selected" in r for r in rec_a) and not any("char/select/offered" in r for r in rec_b)
    for org in ("char", "bpe"):
        for t in (1, 2):
            a, b = rec_a[t], rec_b[t]
            assert a[f"round/{org}/accuracy"] == b[f"round/{org}/accuracy"]  # rewards
            assert a[f"{org}/train/loss"] == b[f"{org}/train/loss"] and math.isfinite(a[f"{org}/train/loss"])
        for (name, x), (_, y) in zip(workers_a[org].model.named_parameters(), workers_b[org].model.named_parameters()):
            assert torch.equal(x, y), (org, name)
    assert _record_values(rec_a) == _record_values(rec_b)


def test_budgeted_run_counts_in_metrics_jsonl(tmp_path, scored):
    cfg = make_cfg({"rule": "peer_sample", "budget_multiple": 0.5}, **RUN)
    _, records = run(cfg, tmp_path / "run")
    for rec in records[1:]:
        for org, src in (("char", "bpe"), ("bpe", "char")):
            assert rec[f"{org}/select/budget"] == 8 and rec[f"{org}/select/{src}/selected"] == 8
            assert rec[f"{org}/select/{src}/offered"] == 16 and rec[f"{org}/select/{src}/dropped_budget"] == 8
            assert rec[f"{org}/train/num_cross"] + rec[f"{org}/train/foreign_unscored"] == 8
    assert scored == [8] * 4  # 2 rounds x 2 learners, 8 rows scored each


FOUR = [{"id": o, "model": {"zoo": z}} for o, z in
        (("char", "micro-qwen-char"), ("bpe", "micro-gpt2-bpe"), ("char2", "micro-qwen-char"), ("bpe2", "micro-gpt2-bpe"))]


@pytest.mark.parametrize("encrypt", [False, True], ids=["signed", "blind"])
def test_peer_sample_screens_lazily_in_a_signed_run_and_trains_as_a_full_screen_would(tmp_path, monkeypatch, encrypt):
    # 4 signed orgs, 16 own rows each, a budget of 1x own rows: each learner takes one whole peer a round and never
    # opens (or, blind, decrypts) the other two batches; with the lazy screen switched off it screens all three and
    # takes the same rows
    cfg = make_cfg({"rule": "peer_sample", "budget_multiple": 1.0}, orgs=FOUR,
                   security={"signing": True, "reverify_rewards": True, "encrypt": encrypt}, **RUN)
    workers_a, rec_a = run(cfg, tmp_path / "lazy")
    for rec in rec_a[1:]:
        for org in ("char", "bpe", "char2", "bpe2"):
            peers = [o for o in ("char", "bpe", "char2", "bpe2") if o != org]
            assert rec[f"{org}/select/budget"] == 16 and rec[f"{org}/select/selected"] == 16
            assert sorted(rec[f"{org}/trust/{p}/unscreened"] for p in peers) == [0, 16, 16]
            assert sum(rec[f"{org}/trust/{p}/checked"] for p in peers) == 16
            assert rec[f"{org}/trust/foreign_accepted"] == 16 and rec[f"{org}/train/foreign_received"] == 48
    monkeypatch.setattr(intake, "lazy_take", lambda *a: None)
    workers_b, rec_b = run(cfg, tmp_path / "full")
    assert all(rec_b[t]["char/trust/foreign_accepted"] == 48 for t in (1, 2))
    for org in workers_a:
        for t in (1, 2):
            assert rec_a[t][f"{org}/train/loss"] == rec_b[t][f"{org}/train/loss"]
            assert rec_a[t][f"{org}/select/selected"] == rec_b[t][f"{org}/select/selected"]
        for x, y in zip(workers_a[org].model.parameters(), workers_b[org].model.parameters()):
            assert torch.equal(x, y), org
