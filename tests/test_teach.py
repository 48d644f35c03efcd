"""``trainer.teach`` (docs/ALGORITHM.md "Teach"): which rows are teach rows (hand cases), the loss (hand-computed),
the trainer's teach steps (exact micro-batching, its own optimizer, checkpointed), the intake taking them before
the likelihood screen, and the configurations refused."""

from __future__ import annotations

import math

import pytest
import torch

from hacrl_fed.algorithm.teach import teach_loss, teach_row_mask
from hacrl_fed.config import TeachConfig, load_config
from hacrl_fed.sharded.worker import check_supported
from hacrl_fed.trainer import LocalTrainer, TrainRow
from hacrl_fed.types import TrainRequest
from hacrl_fed.worker.identity_border import IdentityBorder
from hacrl_fed.worker.intake import Intake, OwnRound, Scoring
from hacrl_fed.worker.teach_rows import take_teach_rows
from tests.helpers_tiny import tiny_char_tokenizer, tiny_model
from tests.test_intake import FRESH, MAX_NEW, PROMPTS, ROUND, SOURCES, Task, make_cfg, signed_batches
from tests.test_trainer import _algo, _tcfg


def test_teach_rows_are_foreign_successes_of_groups_every_own_row_failed():
    # group 0: own 0, 0 -> failed; group 1: own 0, 1 -> solved; group 2: no own row; group 3: own 0
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 3])
    is_self = torch.tensor([True, True, False, False, True, True, False, False, True, False, False])
    assert teach_row_mask(rewards, groups, is_self).tolist() == [
        False, False, True, False,  # group 0: the foreign success only, not the foreign failure
        False, False, False,  # group 1: solved once by the learner
        False,  # group 2: no evidence the learner fails it
        False, True, False,  # group 3: a partial reward counts as a success (R > 0)
    ]
    with pytest.raises(ValueError, match="three \\[N\\] tensors"):
        teach_row_mask(rewards, groups[:-1], is_self)


def test_teach_loss_is_the_row_mean_of_per_token_nll():
    lp = torch.tensor([[-1.0, -3.0, -9.0], [-0.5, -7.0, -7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, metrics = teach_loss(lp, mask)
    # row 0: lbar = -2 (two tokens), row 1: lbar = -0.5 -> L = (2 + 0.5) / 2
    assert loss.item() == pytest.approx(1.25)
    assert metrics == {"teach/nll": pytest.approx(1.25), "teach/num_rows": 2.0}
    loss.backward()  # dL/dlp = -1 / (B * n_b) on the response tokens, 0 on padding
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, -0.25, 0.0], [-0.5, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="B >= 1"):
        teach_loss(lp[:0], mask[:0])


def _teach_rows(n=10):
    return [
        TrainRow([5 + i % 3, 6], [7 + (i * 3) % 9, 8, 9 + i % 4][: 1 + i % 3], 1.0, i, 1, False, -1.0)
        for i in range(n)
    ]


def _trainer(seed=1, **tcfg):
    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=seed)
    return LocalTrainer(model, _algo(), _tcfg(**tcfg), tok.pad_token_id), model


def test_teach_steps_lower_the_nll_of_their_rows_with_their_own_optimizer():
    trainer, model = _trainer(lr=1e-9)
    rows = _teach_rows()
    before = sum(trainer.log_prob_sums(rows))
    update_state = {k: v.clone() for k, v in model.state_dict().items()}
    out = trainer.teach(rows, TeachConfig(enabled=True, lr=1e-2, epochs=3, minibatch_size=4))
    assert out["teach/steps"] == 9.0  # 3 epochs x ceil(10 / 4)
    assert sum(trainer.log_prob_sums(rows)) > before + 1.0
    assert trainer.teach_optimizer is not None and trainer.teach_optimizer.param_groups[0]["lr"] == 1e-2
    assert not trainer.optimizer.state  # the policy update's AdamW never stepped
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in update_state.items())
    assert trainer.teach([], TeachConfig(enabled=True)) == {"teach/steps": 0.0}


def test_a_teach_step_is_the_same_whatever_the_micro_batch():
    rows = _teach_rows(7)
    weights = []
    for micro in (7, 3, 1):
        trainer, model = _trainer(micro_batch_size=micro)
        trainer.teach_optimizer = torch.optim.SGD(trainer.model_params, lr=0.1)  # linear in the gradient
        trainer.teach(rows, TeachConfig(enabled=True, minibatch_size=7))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    for w in weights[1:]:
        torch.testing.assert_close(w, weights[0], atol=1e-6, rtol=0)


def test_the_teach_optimizer_takes_trainer_lr_by_default_and_round_trips_a_checkpoint():
    trainer, _ = _trainer(lr=3e-4)
    assert "teach_optimizer" not in trainer.state_dict()  # a run without teach rows keeps no extra state
    trainer.teach(_teach_rows(4), TeachConfig(enabled=True))
    state = trainer.state_dict()
    assert state["teach_optimizer"]["param_groups"][0]["lr"] == 3e-4
    fresh, _ = _trainer(lr=3e-4)
    fresh.load_state_dict(state)
    restored = fresh.teach_optimizer.state_dict()
    assert restored["param_groups"][0]["lr"] == 3e-4
    step = [s["step"] for s in restored["state"].values()]
    assert step and all(float(s) == 1.0 for s in step)
    # a state saved before any teach step (a rollback to an earlier reference, the shadow's) drops the moments
    fresh.load_state_dict(_trainer(lr=3e-4)[0].state_dict())
    assert fresh.teach_optimizer is None


def _row(group, reward, is_self, source, resp=(7, 8)):
    return TrainRow([5, 6], list(resp), reward, group, source, is_self, -1.0)


def test_take_teach_rows_keeps_what_the_screen_dropped_within_the_context_and_max_rows():
    rows = [
        _row(0, 0.0, True, 0), _row(0, 0.0, True, 0), _row(0, 1.0, False, 1), _row(0, 1.0, False, 2),
        _row(0, 1.0, False, 2, resp=[7] * 40), _row(0, 1.0, False, 1, resp=()),  # too long; no tokens
        _row(1, 1.0, True, 0), _row(1, 1.0, False, 1),  # solved by the learner
    ]
    admitted = rows[:3] + rows[6:]  # the screen dropped source 2's rows
    taken, metrics = take_teach_rows(rows, admitted, ["me", "a", "b"], TeachConfig(enabled=True), 20, seed=0)
    assert taken == [rows[2], rows[3]]
    assert metrics == {"teach/num_rows": 2.0, "teach/num_in_update": 1.0, "teach/a/num_rows": 1.0,
                       "teach/b/num_rows": 1.0}
    many = [_row(0, 0.0, True, 0)] + [_row(0, 1.0, False, 1, resp=[7, 8 + i]) for i in range(9)]
    cfg = TeachConfig(enabled=True, max_rows=3)
    first, _ = take_teach_rows(many, many, ["me", "a"], cfg, None, seed=4)
    again, metrics = take_teach_rows(many, many, ["me", "a"], cfg, None, seed=4)
    assert first == again and len(first) == 3 and metrics["teach/num_rows"] == 3.0
    assert [many.index(r) for r in first] == sorted(many.index(r) for r in first)  # kept in their order


def test_the_intake_takes_teach_rows_before_the_likelihood_screen(tmp_path):
    """``odd`` sends successes the learner's scorer finds implausible (the screen drops them all): where every own
    row of a prompt failed, they are teach rows all the same; the other sources' successes too, and no failure."""
    cfg, tok = make_cfg(), tiny_char_tokenizer()
    teach = TeachConfig(enabled=True)
    door = Intake(cfg, "me", selection=cfg.trainer.selection, screen=cfg.trainer.likelihood_screen, uses_cross=True,
                  task=Task(), tokenizer=tok, eos_id=tok.eos_token_id, teach=teach)
    ids = {p.prompt_id: tok(p.messages[0].content, add_special_tokens=False)["input_ids"] for p in PROMPTS}
    own_rows = [TrainRow(list(ids[p.prompt_id]), [7, 8, 9, 10], 0.0 if p.prompt_id == 10 else float(j), p.prompt_id,
                         0, True, -0.5, [-0.5] * 4, n_bytes=4) for p in PROMPTS for j in range(2)]
    own = OwnRound("run", ROUND, "arithmetic", PROMPTS, MAX_NEW, ids, own_rows, FRESH)
    request = TrainRequest("run", ROUND, "me", PROMPTS, (), {},
                           source_batches=tuple(signed_batches(cfg, tmp_path)))
    names = sorted({"me", *SOURCES} - {"forger", "stale", "liar", "messy"})

    def score(rows):
        return [-1000.0 if names[r.source] == "odd" else -0.5 * len(r.response_ids) for r in rows]

    border = IdentityBorder(cfg, "me", tmp_path)
    admitted = door.admit(request, own, seed=1, opener=border.opener("run", ROUND, FRESH),
                          scoring=Scoring(score, 60, {}))
    assert admitted.teach_rows and {r.group for r in admitted.teach_rows} == {10}
    assert all(r.reward > 0 and not r.is_self and r.response_ids for r in admitted.teach_rows)
    by_source = {names[r.source] for r in admitted.teach_rows}
    assert "odd" in by_source and "zero" not in by_source
    assert not any(names[r.source] == "odd" for r in admitted.rows)  # the screen kept none of odd's rows
    m = admitted.metrics(request)
    assert m["teach/odd/num_rows"] == 2.0 and m["teach/num_rows"] == len(admitted.teach_rows)
    assert m["teach/num_in_update"] == m["teach/num_rows"] - 2.0  # odd's two: taken, not in the update
    off = Intake(cfg, "me", selection=cfg.trainer.selection, screen=cfg.trainer.likelihood_screen, uses_cross=True,
                 task=Task(), tokenizer=tok, eos_id=tok.eos_token_id)
    assert off.teach is None


def test_teach_is_refused_on_a_sharded_org_naming_the_field():
    cfg = load_config({
        "name": "t", "orgs": [{"id": "char", "model": {"zoo": "micro-qwen-char"}, "sharding": {"ranks": 2}}],
        "trainer": {"outcome_guard": {"enabled": False}, "teach": {"enabled": True}},
    })
    with pytest.raises(ValueError, match=r"orgs\[0\]\.trainer\.teach\.enabled=true with orgs\[0\]\.sharding\.ranks=2"):
        check_supported(cfg, "char", world_size=2)


def test_teach_config_fields_are_bounded():
    for bad in ({"lr": 0}, {"epochs": 0}, {"minibatch_size": 0}, {"max_rows": 0}):
        with pytest.raises(ValueError):
            TeachConfig(**bad)
    assert TeachConfig().enabled is False and TeachConfig().lr is None and math.isfinite(TeachConfig().minibatch_size)


def test_a_worker_runs_its_teach_steps_after_the_update_on_the_foreign_successes_it_failed(tmp_path):
    from hacrl_fed.worker import build_worker
    from tests.test_worker_selection import ORGS, plan_for

    def cfg(teach):
        return load_config({
            "name": "teach", "seed": 3, "orgs": ORGS, "algorithm": {"name": "hacpo"},
            "trainer": {"lr": 1e-3, "minibatch_size": 16, "micro_batch_size": 8, "selection": {"rule": "all"},
                        "likelihood_screen": {"enabled": False}, "outcome_guard": {"enabled": False},
                        "teach": {"enabled": teach, "minibatch_size": 4}},
            "generation": {"num_samples": 4, "max_new_tokens": 12, "eval_max_new_tokens": 12},
            "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
            "security": {"signing": False, "reverify_rewards": False}})

    reports = {}
    for teach in (False, True):
        a, b = build_worker(cfg(teach), "char", run_dir=tmp_path / f"a{teach}"), build_worker(
            cfg(teach), "bpe", run_dir=tmp_path / f"b{teach}")
        plan = plan_for(a)
        own = a.generate(plan).rollouts
        foreign = tuple(r.__class__(**{**r.__dict__, "reward": 1.0}) for r in b.generate(plan).rollouts)
        reports[teach] = a.train(TrainRequest("run", 1, "char", plan.prompts, foreign, {"char": 0.5, "bpe": 0.25}))
    failed = {p for p in {r.prompt_id for r in own} if all(r.reward == 0 for r in own if r.prompt_id == p)}
    # every one of bpe's rows there with a token is a teach row (an empty response that stopped is its EOS)
    expected = sum(1 for r in foreign if r.prompt_id in failed and (r.response or r.finish_reason == "stop"))
    assert failed and expected  # the micro model fails the task
    m = reports[True].metrics
    assert m["teach/num_rows"] == expected == m["teach/bpe/num_rows"]
    assert m["teach/steps"] == math.ceil(expected / 4) and m["teach/nll"] > 0
    assert not any(k.startswith("teach/") for k in reports[False].metrics)
    for k in ("train/num_cross", "train/loss"):  # the policy update itself is the same
        assert m[k] == reports[False].metrics[k]
