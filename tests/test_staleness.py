"""The decoupled cross loss (hacrl_fed/algorithm/staleness.py; docs/ALGORITHM.md "Asynchronous rounds")."""

import dataclasses
import math
import random

import pytest
import torch

from hacrl_fed.algorithm import POLICY_LOSSES, PolicyLossConfig, get_algorithm, gspo_loss, hacpo_loss, name_sources
from hacrl_fed.algorithm.staleness import (
    behaviour_weight,
    decoupled_gradient_rows,
    hacpo_decoupled_loss,
    staleness_summary,
)
from hacrl_fed.config import AlgorithmConfig

CFG = PolicyLossConfig()  # alpha 1, weights in [0.8, 1] (filter), GSPO clip 3e-4 / 4e-4


def _cfg(**kw) -> PolicyLossConfig:
    return PolicyLossConfig(**{**CFG.__dict__, **kw})


def _hand_case():
    """Four rows: self (r = w = 1), cross w = 0.9 (v 2, A 0.5), cross w = 0.5 (A -1), cross r = 1.01 (A 1)."""
    lbar = torch.tensor([-1.0, -1.0, -1.0, -1.0 + math.log(1.01)], dtype=torch.float64, requires_grad=True)
    prox = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    mu = torch.tensor([-1.0, -1.0 - math.log(0.9), -1.0 - math.log(0.5), -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 0.5, -1.0, 1.0], dtype=torch.float64)
    is_self = torch.tensor([True, False, False, False])
    v = torch.tensor([1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    return lbar, prox, mu, adv, is_self, v


@pytest.mark.parametrize("mode", ["filter", "clamp"])
def test_hand_computed_loss_and_gradient(mode):
    lbar, prox, mu, adv, is_self, v = _hand_case()
    loss, metrics = hacpo_decoupled_loss(lbar, prox, mu, adv, is_self, v, _cfg(cross_weight_mode=mode))
    loss.backward()
    # J = sg(w_hat^2) v min(rA, clamp(r)A): 1, 0.81 * 2 * 0.5, (0 | 0.8^2 * -1), 1 * min(1.01, 1.0004)
    row2 = 0.0 if mode == "filter" else -0.64
    assert loss.item() == pytest.approx(-(1.0 + 0.81 + row2 + 1.0004) / 4, abs=1e-12)
    # dJ/dlbar = w_hat^2 v A r where GSPO's clip takes the unclipped term, else 0; loss = -mean
    grad2 = 0.0 if mode == "filter" else 0.64
    assert lbar.grad.tolist() == pytest.approx([-0.25, -0.25 * 0.81, grad2 / 4, 0.0], abs=1e-12)
    assert metrics["hacpo_decoupled/num_cross"] == 3 and metrics["hacpo_decoupled/num_cross_in_band"] == 2
    assert metrics["hacpo_decoupled/num_cross_prox_clip_high"] == 1
    assert metrics["hacpo_decoupled/num_cross_grad"] == (1 if mode == "filter" else 2)
    assert metrics["hacpo_decoupled/cross_log_w_min"] == pytest.approx(math.log(0.5))


def test_the_behaviour_weight_carries_no_gradient():
    lbar, prox, mu, adv, is_self, v = _hand_case()
    prox.requires_grad_(True)
    mu.requires_grad_(True)
    v.requires_grad_(True)
    loss, _ = hacpo_decoupled_loss(lbar, prox, mu, adv, is_self, v, _cfg(cross_weight_mode="clamp"))
    loss.backward()
    assert prox.grad is None and mu.grad is None and v.grad is None  # sg(w), sg(v): constants
    assert lbar.grad.abs().sum() > 0


def _random_rows(n=40, seed=0, spread=0.4):
    g = torch.Generator().manual_seed(seed)
    prox = -1.5 + torch.rand(n, generator=g, dtype=torch.float64)
    lbar = prox + 1e-3 * torch.randn(n, generator=g, dtype=torch.float64)  # a few steps after the round began
    mu = prox + spread * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[::7] = 0.0
    is_self = torch.rand(n, generator=g) < 0.3
    mu = torch.where(is_self, prox, mu)  # own rows: the same pre-update weights sampled them
    v = torch.where(is_self, 1.0, 0.1 + 3 * torch.rand(n, generator=g, dtype=torch.float64))
    src = torch.where(is_self, 0, torch.randint(1, 4, (n,), generator=g))
    ages = torch.where(is_self, 0, torch.randint(0, 3, (n,), generator=g))
    return lbar, prox, mu, adv, is_self, v, src, ages


def _loop_reference(lbar, prox, mu, adv, v, cfg):
    """Per row, in plain Python: the objective and its derivative with respect to lbar."""
    objs, grads = [], []
    for x, p, b, a, c in zip(lbar.tolist(), prox.tolist(), mu.tolist(), adv.tolist(), v.tolist()):
        m = cfg.max_abs_log_ratio
        r = math.exp(min(m, max(-m, x - p)))
        w = math.exp(min(m, max(-m, p - b)))
        inside = cfg.cross_weight_min <= w <= cfg.cross_weight_max
        if cfg.cross_weight_mode == "filter":
            w_hat = w if inside else 0.0
        else:
            w_hat = min(cfg.cross_weight_max, max(cfg.cross_weight_min, w))
        lo, hi = 1 - cfg.self_clip_low, 1 + cfg.self_clip_high
        unclipped, clipped = r * a, min(hi, max(lo, r)) * a
        k = w_hat ** (1 + cfg.alpha) * c
        objs.append(k * min(unclipped, clipped))
        takes_r = (a > 0 and r <= hi) or (a < 0 and r >= lo)
        grads.append(k * a * r if takes_r and abs(x - p) <= m else 0.0)
    return objs, grads


@pytest.mark.parametrize("mode", ["filter", "clamp"])
@pytest.mark.parametrize("alpha", [1.0, 3.0])
def test_vectorised_loss_matches_a_per_row_loop(mode, alpha):
    lbar, prox, mu, adv, is_self, v, src, ages = _random_rows()
    cfg = _cfg(cross_weight_mode=mode, alpha=alpha)
    x = lbar.clone().requires_grad_(True)
    loss, metrics = hacpo_decoupled_loss(x, prox, mu, adv, is_self, v, cfg, source_ids=src, ages=ages)
    loss.backward()
    objs, grads = _loop_reference(lbar, prox, mu, adv, v, cfg)
    n = len(objs)
    assert loss.item() == pytest.approx(-sum(objs) / n, rel=1e-12)
    assert x.grad.tolist() == pytest.approx([-g / n for g in grads], rel=1e-9, abs=1e-15)
    has_grad = decoupled_gradient_rows(lbar, prox, mu, adv, cfg)
    assert has_grad.tolist() == [g != 0 for g in grads]
    assert metrics["hacpo_decoupled/num_cross_grad"] == sum(g != 0 for g, s in zip(grads, is_self.tolist()) if not s)


def test_per_source_and_age_metrics_match_a_loop():
    lbar, prox, mu, adv, is_self, v, src, ages = _random_rows(n=60, seed=3)
    _, metrics = hacpo_decoupled_loss(lbar, prox, mu, adv, is_self, v, CFG, source_ids=src, ages=ages)
    names = ["own", "a", "b", "c"]
    out = staleness_summary(name_sources(metrics, names))  # as the trainer combines them: sources named first
    lw = (prox - mu).tolist()
    for a in range(3):
        for j in (None, 1, 2, 3):
            sel = [i for i in range(60) if not is_self[i] and ages[i] == a and (j is None or src[i] == j)]
            tag = "" if j is None else f"/{names[j]}"
            head = f"hacpo_decoupled/age{a}"
            assert out[f"{head}/num_cross{tag}"] == len(sel)
            inside = [i for i in sel if 0.8 <= math.exp(lw[i]) <= 1.0]
            assert out[f"{head}/cross_in_band_frac{tag}"] == pytest.approx(len(inside) / len(sel))
            mean = sum(lw[i] for i in sel) / len(sel)
            std = math.sqrt(sum((lw[i] - mean) ** 2 for i in sel) / len(sel))
            assert out[f"{head}/log_w_mean{tag}"] == pytest.approx(mean, abs=1e-12)
            assert out[f"{head}/log_w_std{tag}"] == pytest.approx(std, abs=1e-9)
    assert sum(v for k, v in out.items() if k.endswith("/num_cross") and "/age" in k) == int((~is_self).sum())


def test_on_own_rows_it_is_gspo():
    lbar, prox, mu, adv, _, _, _, _ = _random_rows(seed=5)
    is_self = torch.ones(len(lbar), dtype=torch.bool)
    x1, x2 = lbar.clone().requires_grad_(True), lbar.clone().requires_grad_(True)
    loss, _ = hacpo_decoupled_loss(x1, prox, prox, adv, is_self, torch.ones_like(adv), CFG)
    ref, _ = gspo_loss(x2, prox, adv, clip_low=CFG.self_clip_low, clip_high=CFG.self_clip_high)
    loss.backward()
    ref.backward()
    assert loss.item() == ref.item()
    assert torch.equal(x1.grad, x2.grad)


@pytest.mark.parametrize("alpha", [1.0, 3.0])
def test_at_step_0_of_a_synchronous_round_filter_gives_hacpo_s_gradient(alpha):
    """Age 0 and pi_prox == pi_theta (step 0): r = 1 and w = exp(lbar - lbar_mu) = s, HACPO's ratio. With the filter
    bounds at the first step's band [1 - delta, 1], the gradient is HACPO's, s^(1+alpha) v A on in-band rows and 0
    elsewhere; the loss value equals HACPO's on every in-band row (out-of-band rows: 0 instead of HACPO's constant
    c^(1+alpha) v A). With clamp it is HACPO's value on every row, and in-band rows have HACPO's gradient."""
    lbar, _, mu, adv, is_self, v, _, _ = _random_rows(seed=7, spread=0.2)
    mu = torch.where(is_self, lbar, mu)  # own rows: sampled by these very weights
    cfg = _cfg(alpha=alpha, cross_weight_min=1.0 - CFG.cross_clip_delta)
    xd, xh = lbar.clone().requires_grad_(True), lbar.clone().requires_grad_(True)
    dec, _ = hacpo_decoupled_loss(xd, lbar, mu, adv, is_self, v, cfg)
    ref, ref_metrics = hacpo_loss(xh, mu, adv, is_self, v, 0, cfg)
    dec.backward()
    ref.backward()
    torch.testing.assert_close(xd.grad, xh.grad, rtol=1e-12, atol=1e-15)
    s = torch.exp(lbar - mu)
    in_band = (s >= 0.8) & (s <= 1.0)
    assert 0 < int((in_band & ~is_self).sum()) < int((~is_self).sum())  # the case has rows on both sides
    c = torch.clamp(s, 0.8, 1.0)
    out_of_band = torch.where(in_band | is_self, 0.0, c ** (1 + alpha) * v * adv).sum() / len(lbar)
    assert dec.item() == pytest.approx(ref.item() + out_of_band.item(), rel=1e-12, abs=1e-15)
    xc = lbar.clone().requires_grad_(True)
    clamped, _ = hacpo_decoupled_loss(xc, lbar, mu, adv, is_self, v, _cfg(alpha=alpha, cross_weight_mode="clamp"))
    clamped.backward()
    assert clamped.item() == pytest.approx(ref.item(), rel=1e-12)
    torch.testing.assert_close(xc.grad[in_band | is_self], xh.grad[in_band | is_self], rtol=1e-12, atol=1e-15)
    assert bool((xc.grad[~in_band & ~is_self & (adv != 0)] != 0).all())  # clamp: no row silently loses its gradient


def test_band_stays_today_s_loss_and_decoupled_is_selected_by_config():
    band, decoupled = AlgorithmConfig(), AlgorithmConfig(cross_staleness="decoupled")
    spec = get_algorithm("hacpo")
    assert band.cross_staleness == "band" and spec.policy_loss(band) == "hacpo" and not spec.needs_proximal(band)
    assert spec.policy_loss(decoupled) == "hacpo_decoupled" and spec.needs_proximal(decoupled)
    assert get_algorithm("gspo").policy_loss(decoupled) == "gspo"
    with pytest.raises(ValueError, match="cross_staleness"):
        AlgorithmConfig(name="gspo", cross_staleness="decoupled")
    with pytest.raises(ValueError, match="cross_weight_max"):
        AlgorithmConfig(cross_weight_max=0.9)
    assert "hacpo_decoupled" in POLICY_LOSSES


def test_bad_inputs_are_refused():
    lbar, prox, mu, adv, is_self, v = _hand_case()
    with pytest.raises(ValueError, match="ages"):
        hacpo_decoupled_loss(lbar, prox, mu, adv, is_self, v, CFG, ages=torch.tensor([0, -1, 0, 0]))
    with pytest.raises(ValueError, match="cross_weight_mode"):
        behaviour_weight(prox, mu, _cfg(cross_weight_mode="soft"))
    with pytest.raises(ValueError, match="same N"):
        hacpo_decoupled_loss(lbar, prox[:3], mu, adv, is_self, v, CFG)


def test_a_hostile_claim_cannot_raise_the_weight_above_its_bound():
    """A source publishing a very low lbar_mu (a huge w) weighs at most w_max ** (1 + alpha) (clamp), 0 (filter)."""
    rng = random.Random(0)
    n = 8
    lbar = torch.tensor([-1.0 - rng.random() for _ in range(n)], dtype=torch.float64)
    mu = lbar - 50.0  # claimed log-prob far below the learner's: w = e^50 before the +-M clamp
    adv, is_self, v = torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.bool), torch.ones(n)
    for mode, bound in (("clamp", 1.0), ("filter", 0.0)):
        x = lbar.clone().requires_grad_(True)
        loss, _ = hacpo_decoupled_loss(x, lbar, mu, adv, is_self, v, _cfg(cross_weight_mode=mode))
        loss.backward()
        assert loss.item() == pytest.approx(-bound)
        assert torch.all(x.grad.abs() <= bound / n + 1e-15)


# -- the trainer's hook and a synchronous run ---------------------------------------------------------------------


def _trainer(**algo):
    from hacrl_fed.config import TrainerConfig
    from hacrl_fed.trainer import LocalTrainer
    from tests.helpers_tiny import PAPER_ALGORITHM, PAPER_TRAINER, tiny_char_tokenizer, tiny_model

    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=1)
    tcfg = TrainerConfig(**{**PAPER_TRAINER, "lr": 1.0, "minibatch_size": 64, "micro_batch_size": 4})
    trainer = LocalTrainer(model, AlgorithmConfig(**{**PAPER_ALGORITHM, **algo}), tcfg, tok.pad_token_id)
    trainer.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    return trainer


def _train_rows(n=18, seed=0):
    from hacrl_fed.trainer import TrainRow

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        is_self = i % 3 == 0
        resp = [rng.randrange(5, 20) for _ in range(rng.randint(1, 6))]
        prompt = [rng.randrange(5, 20) for _ in range(rng.randint(1, 4))]
        rows.append(
            TrainRow(
                prompt,
                resp,
                float(rng.random() < 0.5),
                i % 3,
                0 if is_self else 1 + i % 2,
                is_self,
                0.0,
                [0.0] * len(resp) if is_self else None,
            )
        )
    return rows


def _on_policy(trainer, rows, offsets):
    """Own rows' old lbar = the learner's own pre-update value; cross rows' source lbar = the learner's + offset."""
    sums = trainer.log_prob_sums(rows)
    return [
        dataclasses.replace(
            r,
            old_seq_log_prob=s / len(r.response_ids) + (0 if r.is_self else o),
            old_token_log_probs=[s / len(r.response_ids)] * len(r.response_ids),
        )
        for r, s, o in zip(rows, sums, offsets)
    ]


def test_first_step_of_a_synchronous_round_equals_hacpo_s_with_the_filter():
    """One mini-batch, SGD: the decoupled filter's first step is HACPO's (derived in the docs), through the trainer."""
    rng = random.Random(1)
    offsets = [rng.choice([0.05, 0.1, 0.5, -0.1]) for _ in range(18)]  # w = e^-offset: in and out of [0.8, 1]
    params = []
    for staleness in ("band", "decoupled"):
        trainer = _trainer(cross_staleness=staleness)
        rows = _on_policy(trainer, _train_rows(), offsets)
        metrics = trainer.update(rows, 0, [0.5, 0.25, 1.0], names=["own", "a", "b"])
        params.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    torch.testing.assert_close(params[0], params[1], rtol=0, atol=1e-6)
    assert metrics["hacpo_decoupled/age0/num_cross/a"] + metrics["hacpo_decoupled/age0/num_cross/b"] == 12
    assert 0 < metrics["hacpo_decoupled/cross_in_band_frac"] < 1
    assert "hacpo_decoupled/age0/log_w_std/a" in metrics and "hacpo/cross_in_band_frac" not in metrics


def test_proximal_log_probs_come_from_the_pre_update_weights_and_skipping_is_exact():
    trainer = _trainer(cross_staleness="decoupled", cross_weight_mode="clamp")
    rows = _on_policy(trainer, _train_rows(seed=2), [0.2] * 18)
    with_prox = trainer.with_proximal(rows)
    sums = trainer.log_prob_sums(rows)
    for r, s in zip(with_prox, sums):
        assert r.prox_log_prob_sum is None if r.is_self else r.prox_log_prob_sum == pytest.approx(s, abs=1e-4)
        assert r.prox_seq_log_prob() == pytest.approx(s / len(r.response_ids), abs=1e-6)
    out = []
    for skip in (True, False):
        trainer = _trainer(cross_staleness="decoupled", cross_weight_mode="clamp")
        trainer.cfg = trainer.cfg.model_copy(update={"skip_no_gradient_rows": skip, "minibatch_size": 6})
        trainer.update(rows, 0, [0.5, 0.25, 1.0])
        out.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-6)


def test_a_synchronous_in_process_run_with_the_decoupled_loss(tmp_path):
    """End to end: two orgs, two rounds, cross_staleness: decoupled; every key it logs is documented."""
    from hacrl_fed.config import load_config
    from hacrl_fed.coordinator import Coordinator
    from hacrl_fed.coordinator.inprocess import InProcessTransport
    from hacrl_fed.metrics import RunLogger, read_metrics
    from hacrl_fed.worker import build_worker
    from tests.test_docs import ORGS, documented_keys, key_pattern

    cfg = load_config(
        {
            "name": "decoupled",
            "seed": 0,
            "orgs": ORGS,
            "algorithm": {"name": "hacpo", "cross_staleness": "decoupled", "cross_weight_mode": "clamp"},
            "trainer": {"lr": 1e-3, "minibatch_size": 64, "micro_batch_size": 32, "selection": {"rule": "all"}},
            "generation": {"num_samples": 4, "max_new_tokens": 16, "eval_max_new_tokens": 16},
            "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
            "federation": {"rounds": 2, "prompts_per_round": 4, "eval_every": 2, "min_orgs": 1},
        }
    )
    workers = {o.id: build_worker(cfg, o.id, run_dir=tmp_path) for o in cfg.orgs}
    with RunLogger(tmp_path, tensorboard=False) as logger:
        summary = Coordinator(cfg, InProcessTransport(workers), tmp_path, logger=logger).run()
    assert summary.rounds_completed == 2
    records = read_metrics(tmp_path)
    keys = {k for rec in records for k in rec}
    for org, other in (("acme", "globex"), ("globex", "acme")):
        assert any(k == f"{org}/hacpo_decoupled/age0/num_cross/{other}" for k in keys), sorted(keys)
        assert f"{org}/hacpo_decoupled/num_cross" in keys and f"{org}/hacpo/num_cross" not in keys
    patterns = [key_pattern(k) for k in documented_keys()]
    assert not [k for k in keys if not any(p.fullmatch(k) for p in patterns)]


def test_the_trainer_reports_each_row_s_age():
    """A driver sets TrainRow.age; the update's metrics split the cross rows by it (sources named)."""
    trainer = _trainer(cross_staleness="decoupled")
    rows = _on_policy(trainer, _train_rows(seed=3), [0.1] * 18)
    rows = [dataclasses.replace(r, age=0 if r.is_self else 1 + r.source) for r in rows]  # source 1: 2, source 2: 3
    metrics = trainer.update(rows, 0, [0.5, 0.25, 1.0], names=["own", "a", "b"])
    assert metrics["hacpo_decoupled/age2/num_cross/a"] == 6 and metrics["hacpo_decoupled/age3/num_cross/b"] == 6
    assert "hacpo_decoupled/age0/num_cross" not in metrics  # own rows are not counted in the cross histogram
    assert metrics["hacpo_decoupled/age2/log_w_mean/a"] == pytest.approx(-0.1, abs=1e-4)  # w = e^-offset
