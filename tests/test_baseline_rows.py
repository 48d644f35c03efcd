"""``algorithm.baseline_rows`` (docs/ALGORITHM.md "Baseline rows"): HACPO's group statistics over the learner's own
rows and the foreign rows inside the step-0 cross band. Hand-computed cases, the default's numbers unchanged, and
the trainer's step-0 mask."""

import dataclasses
import math

import pytest
import torch

from hacrl_fed.algorithm import group_advantages, hacpo_advantages
from hacrl_fed.config import AlgorithmConfig
from hacrl_fed.scoring import build_scoring_batch_from_ids, token_log_probs
from hacrl_fed.trainer import LocalTrainer, TrainRow
from tests.helpers_tiny import PAPER_ALGORITHM, PAPER_TRAINER, tiny_char_tokenizer, tiny_model

R3 = 1 / math.sqrt(3)  # sqrt(1/3): the Bessel std of {1, 0, 1} and of {1, 1, 0}

# group 0: own success, own failure (source 0), a foreign success in band and one out of band (source 1)
REWARDS, GROUPS, SOURCES = [1.0, 0.0, 1.0, 1.0], [0, 0, 0, 0], [0, 0, 1, 1]
IN_BAND = torch.tensor([True, True, True, False])


def test_an_out_of_band_success_leaves_the_mean_and_the_std():
    # joint: mu = 3/4, std = sqrt((3 * 0.25^2 + 0.75^2) / 3) = 0.5 -> own success 0.5, own failure -1.5
    joint = hacpo_advantages(REWARDS, GROUPS, SOURCES, 0, [1.0, 1.0])
    assert joint.tolist() == pytest.approx([0.5, -1.5, 0.5, 0.5], rel=1e-5)
    # in band: mu = 2/3 over {1, 0, 1}, std = sqrt(1/3); the out-of-band row still gets A from those
    a = hacpo_advantages(REWARDS, GROUPS, SOURCES, 0, [1.0, 1.0], baseline_rows=IN_BAND)
    up, down = (1 / 3) / R3, -(2 / 3) / R3
    assert a.tolist() == pytest.approx([up, down, up, up], rel=1e-5)


def test_the_capability_weight_applies_over_the_baseline_rows_only():
    # w(0, 1) = clamp(0.5 / 1) = 0.5: mu = (1 + 0 + 0.5 * 1) / 3 = 0.5, std = sqrt(1/3) of the raw rewards
    a = hacpo_advantages(REWARDS, GROUPS, SOURCES, 0, [0.5, 1.0], baseline_rows=IN_BAND)
    assert a.tolist() == pytest.approx([0.5 / R3, -0.5 / R3, 0.5 / R3, 0.5 / R3], rel=1e-5)


def test_a_group_uniform_over_its_baseline_rows_gets_zero():
    rewards, groups, sources = [1.0, 1.0, 0.0], [0, 0, 0], [0, 0, 1]
    joint = hacpo_advantages(rewards, groups, sources, 0, [1.0, 1.0])
    assert joint.tolist() == pytest.approx([(1 / 3) / R3, (1 / 3) / R3, -(2 / 3) / R3], rel=1e-5)
    a = hacpo_advantages(rewards, groups, sources, 0, [1.0, 1.0], baseline_rows=torch.tensor([True, True, False]))
    assert a.tolist() == [0.0, 0.0, 0.0]


def test_a_group_with_no_baseline_rows_gets_zero_and_the_others_are_untouched():
    rewards, groups, sources = [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1], [0, 0, 1, 1]
    mask = torch.tensor([True, True, False, False])
    a = hacpo_advantages(rewards, groups, sources, 0, [1.0, 1.0], baseline_rows=mask)
    # group 0: mean 0.5, std sqrt(0.5) -> +-0.5 / sqrt(0.5); group 1 (only foreign rows, none in band): 0
    assert a.tolist() == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0.0, 0.0], rel=1e-5)
    assert torch.isfinite(a).all()


def test_every_row_in_the_baseline_is_the_default_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(40, generator=gen, dtype=torch.float64).round()
    groups, sources = torch.arange(40) % 7, torch.arange(40) % 3
    cap = [0.3, 0.9, 0.6]
    default = hacpo_advantages(rewards, groups, sources, 1, cap)
    full = hacpo_advantages(rewards, groups, sources, 1, cap, baseline_rows=torch.ones(40, dtype=torch.bool))
    assert torch.equal(default, full)
    at_rounds = hacpo_advantages(rewards, groups, sources, 1, ([0.9] * 40, [cap[j] for j in sources.tolist()]))
    assert torch.equal(default, at_rounds)


def test_the_per_round_form_takes_the_mask_too():
    a = hacpo_advantages(REWARDS, GROUPS, SOURCES, 0, ([0.5] * 4, [0.5, 0.5, 1.0, 1.0]), baseline_rows=IN_BAND)
    assert torch.equal(a, hacpo_advantages(REWARDS, GROUPS, SOURCES, 0, [0.5, 1.0], baseline_rows=IN_BAND))


def test_self_rows_only_is_gspo_with_or_without_the_mask():
    rewards, groups = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0], [0, 0, 0, 1, 1, 1]
    gspo = group_advantages(rewards, groups)
    for mask in (None, torch.ones(6, dtype=torch.bool)):
        assert torch.equal(hacpo_advantages(rewards, groups, [0] * 6, 0, [0.2], baseline_rows=mask), gspo)


def test_the_mask_must_keep_the_own_rows_and_fit_the_rows():
    with pytest.raises(ValueError, match="own rows"):
        hacpo_advantages(REWARDS, GROUPS, SOURCES, 0, [1.0, 1.0], baseline_rows=torch.tensor([False, True, True, True]))
    with pytest.raises(ValueError, match="bool"):
        hacpo_advantages(REWARDS, GROUPS, SOURCES, 0, [1.0, 1.0], baseline_rows=torch.ones(3, dtype=torch.bool))


# ------------------------------------------------------------------------------------------------- config


def test_config_field_default_and_refusals():
    assert AlgorithmConfig().baseline_rows == "in_band"  # the default since issue 42 (hacpo)
    assert AlgorithmConfig(baseline_rows="joint").baseline_rows == "joint"
    for name in ("gspo", "grpo", "naive"):  # no cross band: every row, and the resolved config says so
        assert AlgorithmConfig(name=name).baseline_rows == "joint"
        assert AlgorithmConfig(**AlgorithmConfig(name=name).model_dump()).baseline_rows == "joint"
    with pytest.raises(ValueError, match="baseline_rows: in_band needs"):
        AlgorithmConfig(name="gspo", baseline_rows="in_band")
    with pytest.raises(ValueError, match="baseline_rows"):  # in_band_solved: measured and removed (issue 42)
        AlgorithmConfig(baseline_rows="in_band_solved")


def test_config_describe_lists_baseline_rows(capsys):
    from hacrl_fed.cli import main

    assert main(["config", "--describe"]) == 0
    assert "algorithm.baseline_rows  (joint | in_band)  default in_band" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------- the trainer


def _trainer(**algo):
    from hacrl_fed.config import TrainerConfig

    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=1)
    cfg = TrainerConfig(**{**PAPER_TRAINER, "lr": 1e-9, "minibatch_size": 8, "micro_batch_size": 8})
    return model, tok, LocalTrainer(model, AlgorithmConfig(**{**PAPER_ALGORITHM, **algo}), cfg, tok.pad_token_id)


def _rows(model, tok):
    """Own success and failure; a foreign success from source 1 published at lbar + 0.05 (s = 0.95, in
    band) and one from source 2 published at lbar + 1 (s = exp(-1) < 1 - delta: out of band at step 0)."""
    prompt, resp = [5, 6, 7], [8, 9, 10, 11]
    with torch.no_grad():
        lp, _ = token_log_probs(model, build_scoring_batch_from_ids([prompt], [resp], tok.pad_token_id))
    lbar = float(lp.sum()) / len(resp)
    return [TrainRow(prompt, resp, 1.0, 0, 0, True, lbar, [lbar] * 4),
            TrainRow(prompt, resp, 0.0, 0, 0, True, lbar, [lbar] * 4),
            TrainRow(prompt, resp, 1.0, 0, 1, False, lbar + 0.05),
            TrainRow(prompt, resp, 1.0, 0, 2, False, lbar + 1.0)]


def test_a_foreign_row_outside_the_step0_band_leaves_the_baseline():
    model, tok, trainer = _trainer(baseline_rows="in_band")
    rows = _rows(model, tok)
    assert trainer.prepare(rows).statistics_rows.tolist() == [True, True, True, False]
    m = trainer.update(rows, 0, [1.0, 1.0, 1.0], names=["k", "a", "b"])
    assert m["hacpo/baseline_cross_frac"] == 0.5 and m["hacpo/num_baseline_cross"] == 1.0
    assert m["hacpo/baseline_cross_frac/a"] == 1.0 and m["hacpo/baseline_cross_frac/b"] == 0.0
    assert m["time/baseline_rows"] >= 0.0
    # the hand-computed in_band advantages (first test): own mean (up + down) / 2, each foreign row `up`
    up, down = (1 / 3) / R3, -(2 / 3) / R3
    assert m["hacpo/adv_mean/k"] == pytest.approx((up + down) / 2, rel=1e-5)
    assert m["hacpo/adv_mean/b"] == pytest.approx(up, rel=1e-5)


def test_joint_and_in_band_without_a_band_keep_every_row():
    model, tok, joint = _trainer(baseline_rows="joint")
    rows = _rows(model, tok)
    assert joint.prepare(rows).statistics_rows is None
    m = joint.update(rows, 0, [1.0, 1.0, 1.0], names=["k", "a", "b"])
    assert "hacpo/baseline_cross_frac" not in m and m["hacpo/adv_mean/b"] == pytest.approx(0.5, rel=1e-5)
    model, tok, no_band = _trainer(baseline_rows="in_band", cross_clip=False)
    rows = _rows(model, tok)
    assert no_band.prepare(rows).statistics_rows.all()
    assert torch.equal(no_band.advantages(rows, 0, [1.0] * 3, no_band.prepare(rows)),
                       joint.advantages(rows, 0, [1.0] * 3))


def test_a_row_the_screen_scored_is_not_scored_again_and_gets_the_same_mask(monkeypatch):
    model, tok, trainer = _trainer(baseline_rows="in_band")
    rows = _rows(model, tok)
    expected = trainer.prepare(rows).statistics_rows.tolist()  # scores the two foreign rows itself
    sums = iter(trainer.log_prob_sums([r for r in rows if not r.is_self]))
    prescored = [r if r.is_self else dataclasses.replace(r, pre_log_prob_sum=next(sums)) for r in rows]

    def never(batch):
        raise AssertionError(f"scored {len(batch)} rows again")

    monkeypatch.setattr(trainer, "log_prob_sums", never)
    assert trainer.prepare(prescored).statistics_rows.tolist() == expected == [True, True, True, False]
