"""Policy losses: hand-computed values, GSPO reduction, the cross band, alpha, loop references, GRPO, k3 KL."""

import math
import random

import pytest
import torch

from hacrl_fed.algorithm import (
    PolicyLossConfig, PolicyLossInputs, cross_lower_bound, get_policy_loss, grpo_loss, gspo_loss,
    hacpo_loss, kl_k3, naive_loss, sequence_mean_log_prob,
)

CFG = PolicyLossConfig()


def ref_hacpo_objective(lp, old, a, is_self, v, m, cfg=CFG):
    """Scalar reference of one row's objective value (docs/ALGORITHM.md)."""
    s = math.exp(max(-cfg.max_abs_log_ratio, min(cfg.max_abs_log_ratio, lp - old)))
    if is_self:
        return min(s * a, min(max(s, 1 - cfg.self_clip_low), 1 + cfg.self_clip_high) * a)
    lower = min(1.0, 1 - cfg.cross_clip_delta + m * cfg.cross_clip_step)
    c = min(max(s, lower), 1.0)
    return c * c ** cfg.alpha * v * a


def ref_hacpo_grad(lp, old, a, is_self, v, m, cfg=CFG):
    """d objective / d lp per row, written out by hand."""
    raw = lp - old
    if abs(raw) > cfg.max_abs_log_ratio:
        return 0.0
    s = math.exp(raw)
    if is_self:
        lo, hi = 1 - cfg.self_clip_low, 1 + cfg.self_clip_high
        clipped = (a > 0 and s > hi) or (a < 0 and s < lo)
        return 0.0 if clipped else s * a
    lower = min(1.0, 1 - cfg.cross_clip_delta + m * cfg.cross_clip_step)
    if s < lower or s > 1.0:
        return 0.0
    return s ** (cfg.alpha + 1) * v * a  # d/dlp [c * sg(c)^alpha] = c^(alpha+1)


def _run(lp, old, a, is_self, v, m, cfg=CFG):
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    loss, metrics = hacpo_loss(x, torch.tensor(old, dtype=torch.float64), torch.tensor(a, dtype=torch.float64),
                               torch.tensor(is_self), torch.tensor(v, dtype=torch.float64), m, cfg)
    loss.backward()
    return loss, x.grad, metrics


def test_hand_computed_mixed_batch():
    # self row: s = e^0.0001 inside the GSPO band; cross rows: s = 0.9 (in band at m=0) and 0.5 (below 0.8)
    lp = [-1.0, math.log(0.9) - 2.0, math.log(0.5) - 2.0]
    old = [-1.0001, -2.0, -2.0]
    loss, grad, metrics = _run(lp, old, [2.0, 1.5, -1.0], [True, False, False], [1.0, 2.0, 0.5], 0)
    s0 = math.exp(0.0001)
    obj = [s0 * 2.0, 0.9 * 0.9 * 2.0 * 1.5, 0.8 * 0.8 * 0.5 * -1.0]
    assert loss.item() == pytest.approx(-sum(obj) / 3, rel=1e-9)
    assert grad.tolist() == pytest.approx([-s0 * 2.0 / 3, -0.81 * 3.0 / 3, 0.0], rel=1e-9)
    assert metrics["hacpo/cross_clip_low_frac"] == 0.5
    assert metrics["hacpo/cross_lower_bound"] == pytest.approx(0.8)
    assert metrics["hacpo/num_self"] == 1 and metrics["hacpo/num_cross"] == 2


def test_self_only_equals_gspo():
    torch.manual_seed(0)
    lp = (torch.randn(32, dtype=torch.float64) * 1e-3).requires_grad_()
    old = torch.zeros(32, dtype=torch.float64)
    adv = torch.randn(32, dtype=torch.float64)
    l1, _ = hacpo_loss(lp, old, adv, torch.ones(32, dtype=torch.bool), torch.rand(32), 3, CFG)
    (g1,) = torch.autograd.grad(l1, lp)
    l2, _ = gspo_loss(lp, old, adv)
    (g2,) = torch.autograd.grad(l2, lp)
    assert torch.allclose(l1, l2) and torch.allclose(g1, g2)


@pytest.mark.parametrize("m", [0, 1, 4, 8, 20])
def test_cross_zero_gradient_outside_band_and_band_tightens(m):
    lower = cross_lower_bound(m)
    assert lower == pytest.approx(min(1.0, 0.8 + 0.025 * m))
    ratios = torch.linspace(0.5, 1.3, 81, dtype=torch.float64)
    lp = ratios.log().clone().requires_grad_()
    n = ratios.numel()
    loss, _ = hacpo_loss(lp, torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64),
                         torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.float64), m, CFG)
    loss.backward()
    inside = (ratios >= lower - 1e-12) & (ratios <= 1.0 + 1e-12)
    assert torch.all(lp.grad[~inside] == 0)
    assert torch.all(lp.grad[inside & (ratios > lower + 1e-9) & (ratios < 1 - 1e-9)] < 0)


def test_lower_bound_monotone_and_capped():
    bounds = [cross_lower_bound(m) for m in range(20)]
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    assert bounds[-1] == 1.0 and bounds[0] == pytest.approx(0.8)
    assert cross_lower_bound(3, delta=0.1, delta_step=0.05) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        cross_lower_bound(-1)


@pytest.mark.parametrize("alpha", [0.0, 1.0, 3.0])
def test_alpha_scales_gradient_as_c_power_alpha_plus_one(alpha):
    cfg = PolicyLossConfig(alpha=alpha)
    c = torch.tensor([0.85, 0.9, 0.95, 1.0], dtype=torch.float64)
    lp = c.log().clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0, 0.5, 1.0], dtype=torch.float64)
    v = torch.tensor([1.0, 0.5, 2.0, 10.0], dtype=torch.float64)
    loss, _ = hacpo_loss(lp, torch.zeros(4, dtype=torch.float64), adv, torch.zeros(4, dtype=torch.bool), v, 0, cfg)
    loss.backward()
    assert torch.allclose(lp.grad, -(c ** (alpha + 1)) * v * adv / 4)


@pytest.mark.parametrize("seed", range(6))
def test_loss_and_grad_equal_loop_reference(seed):
    rng = random.Random(seed)
    cfg = PolicyLossConfig(alpha=rng.choice([1.0, 3.0]), cross_clip_delta=rng.choice([0.2, 0.3]))
    n = rng.randint(1, 40)
    old = [rng.uniform(-3, -0.1) for _ in range(n)]
    lp = [o + rng.choice([rng.gauss(0, 0.2), rng.gauss(0, 1e-4), rng.uniform(-15, 15)]) for o in old]
    a = [rng.gauss(0, 1) for _ in range(n)]
    is_self = [rng.random() < 0.4 for _ in range(n)]
    v = [rng.choice([0.1, 0.5, 1.0, 3.0, 10.0]) for _ in range(n)]
    m = rng.randint(0, 10)
    loss, grad, _ = _run(lp, old, a, is_self, v, m, cfg)
    want = -sum(ref_hacpo_objective(*row, m, cfg) for row in zip(lp, old, a, is_self, v)) / n
    assert loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    want_grad = [-ref_hacpo_grad(*row, m, cfg) / n for row in zip(lp, old, a, is_self, v)]
    assert grad.tolist() == pytest.approx(want_grad, rel=1e-8, abs=1e-12)


def test_self_clip_band_metrics_and_zero_gradient():
    s = torch.tensor([0.999, 1.0, 1.0001, 1.001], dtype=torch.float64)
    lp = s.log().clone().requires_grad_()
    loss, metrics = hacpo_loss(lp, torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64),
                               torch.ones(4, dtype=torch.bool), torch.ones(4), 0, CFG)
    loss.backward()
    assert lp.grad[3] == 0 and lp.grad[0] != 0  # A > 0: clipped above 1 + 4e-4 only
    assert metrics["hacpo/self_clip_low_frac"] == 0.25 and metrics["hacpo/self_clip_high_frac"] == 0.25
    assert metrics["hacpo/self_ratio_max"] == pytest.approx(1.001)


def test_bad_inputs():
    z = torch.zeros(3)
    with pytest.raises(ValueError, match="same N"):
        hacpo_loss(z, torch.zeros(2), z, z.bool(), z, 0)
    with pytest.raises(ValueError, match="empty"):
        hacpo_loss(torch.zeros(0), torch.zeros(0), torch.zeros(0), torch.zeros(0).bool(), torch.zeros(0), 0)


def test_sequence_mean_log_prob():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert sequence_mean_log_prob(lp, mask).tolist() == [-2.0, -4.0, 0.0]
    with pytest.raises(ValueError):
        sequence_mean_log_prob(lp, mask[:, :2])


def test_grpo_token_level_hand_computed():
    lp = torch.tensor([[0.0, math.log(1.5)], [math.log(0.5), 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 2, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = grpo_loss(lp, old, adv, mask)
    # row0: tokens r=1 -> 1; r=1.5 (A>0) clipped to 1.28; row1: r=0.5 (A<0) -> min(-0.5, -0.8) = -0.8
    assert loss.item() == pytest.approx(-(1.0 + 1.28 - 0.8) / 3)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-1 / 3, 0.0, 0.0, 0.0])
    assert metrics["grpo/clip_high_frac"] == pytest.approx(1 / 3)


def test_kl_k3():
    lp = torch.tensor([-1.0, -2.0, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, -30.0], dtype=torch.float64)
    kl = kl_k3(lp, ref)
    assert kl[0].item() == 0.0
    assert kl[1].item() == pytest.approx(math.e - 1 - 1)
    assert kl[2].item() == pytest.approx(math.exp(-10) + 10 - 1)  # r clamped at -10
    assert torch.all(kl >= 0)
    kl.sum().backward()
    assert lp.grad[1].item() == pytest.approx(1 - math.e)


def _inputs(n=6, is_self=None, t=4):
    torch.manual_seed(1)
    mask = torch.ones(n, t)
    mask[0, 2:] = 0
    lp = (torch.randn(n, t) * 0.01 - 1).requires_grad_()
    old_tok = lp.detach() + torch.randn(n, t) * 1e-4
    return PolicyLossInputs(
        token_log_probs=lp, response_mask=mask, old_seq_log_probs=sequence_mean_log_prob(old_tok, mask),
        advantages=torch.randn(n), is_self=torch.ones(n, dtype=torch.bool) if is_self is None else is_self,
        capability_coefficient=torch.ones(n), old_token_log_probs=old_tok)


def test_registry_losses_dispatch():
    cfg = PolicyLossConfig()
    inp = _inputs()
    l_h, _ = get_policy_loss("hacpo")(inp, 0, cfg)
    l_g, mg = get_policy_loss("gspo")(inp, 0, cfg)
    l_n, mn = get_policy_loss("naive")(inp, 0, cfg)
    assert torch.allclose(l_h, l_g) and torch.allclose(l_g, l_n)
    assert "gspo/clip_low_frac" in mg and "naive/ratio_mean" in mn
    l_r, mr = get_policy_loss("grpo")(inp, 0, cfg)
    assert torch.isfinite(l_r) and "grpo/clip_high_frac" in mr
    mixed = _inputs(is_self=torch.tensor([True, True, False, False, True, False]))
    with pytest.raises(ValueError, match="own rows"):
        get_policy_loss("gspo")(mixed, 0, cfg)
    inp.old_token_log_probs = None
    with pytest.raises(ValueError, match="old_token_log_probs"):
        get_policy_loss("grpo")(inp, 0, cfg)
    with pytest.raises(KeyError, match="registered"):
        get_policy_loss("ppo")


def test_naive_is_gspo_on_every_row_against_the_source():
    from hacrl_fed.algorithm import naive_loss

    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = torch.tensor([-1.0, -1.5, -0.9])  # e.g. a foreign row far from its source's lbar
    adv = torch.tensor([1.0, -1.0, 0.5])
    l_n, m = naive_loss(lp, old, adv)
    l_g, _ = gspo_loss(lp, old, adv)
    assert torch.equal(l_n, l_g) and "naive/clip_low_frac" in m


# --- one source of truth: the run config's algorithm section ----------------------------------------------------


def test_loss_config_is_built_from_the_algorithm_config_and_shares_its_defaults():
    import dataclasses

    from hacrl_fed.algorithm import ALGORITHMS
    from hacrl_fed.config import AlgorithmConfig

    names = [f.name for f in dataclasses.fields(PolicyLossConfig)]
    assert set(names) <= set(AlgorithmConfig.model_fields)  # named as in the config
    assert PolicyLossConfig() == PolicyLossConfig.from_algorithm(AlgorithmConfig())
    algo = AlgorithmConfig(self_clip_low=0.01, alpha=3.0, cross_clip_step=0.05, grpo_clip_high=0.3)
    cfg = PolicyLossConfig.from_algorithm(algo)
    assert all(getattr(cfg, n) == getattr(algo, n) for n in names)
    assert all(AlgorithmConfig(name=name).name == name for name in ALGORITHMS)  # the config takes the registry's
    with pytest.raises(ValueError, match="Input should be 'hacpo', 'gspo', 'grpo' or 'naive'"):
        AlgorithmConfig(name="ppo")


def test_pure_functions_default_to_the_config_defaults():
    import inspect

    from hacrl_fed.algorithm import (
        CapabilityTracker, capability_ratios, capability_coefficients, group_advantages, hacpo_advantages, kl_k3, naive_loss,
    )
    from hacrl_fed.algorithm.advantages import ADV_EPS
    from hacrl_fed.algorithm.capability import CAPABILITY_FLOOR
    from hacrl_fed.config import AlgorithmConfig

    d = AlgorithmConfig()

    def defaults(fn):
        return {k: p.default for k, p in inspect.signature(fn).parameters.items()
                if p.default is not inspect.Parameter.empty}

    assert defaults(cross_lower_bound) == {"delta": d.cross_clip_delta, "delta_step": d.cross_clip_step}
    assert defaults(kl_k3) == {"max_abs_log_ratio": d.max_abs_log_ratio}
    for fn in (gspo_loss, naive_loss):
        assert {k: v for k, v in defaults(fn).items() if k not in ("prefix", "is_self", "source_ids")} == {
            "clip_low": d.self_clip_low, "clip_high": d.self_clip_high, "max_abs_log_ratio": d.max_abs_log_ratio}
    assert defaults(grpo_loss) == {"clip_low": d.grpo_clip_low, "clip_high": d.grpo_clip_high,
                                   "max_abs_log_ratio": d.max_abs_log_ratio}
    assert defaults(hacpo_advantages) == {"reward_max": d.reward_max, "ratio_min": d.ratio_min,
                                          "ratio_max": d.ratio_max, "eps": ADV_EPS,
                                          "calibrate": d.advantage_calibration,
                                          "baseline_rows": None}  # a per-call mask (None: every row), no config value
    assert defaults(group_advantages) == {"eps": ADV_EPS} and ADV_EPS == 1e-6  # fixed since issue 42
    for fn in (capability_ratios, capability_coefficients):
        assert defaults(fn) == {"ratio_min": d.ratio_min, "ratio_max": d.ratio_max}
    tracker = CapabilityTracker()
    assert (tracker.window, tracker.floor, tracker.ratio_min, tracker.ratio_max, tracker.warmup_rounds) == (
        d.capability_window, CAPABILITY_FLOOR, d.ratio_min, d.ratio_max, d.warmup_rounds)
    assert CAPABILITY_FLOOR == 1e-8  # fixed since issue 42
    algo = AlgorithmConfig(capability_window=3, warmup_rounds=2, ratio_max=4.0)
    t = CapabilityTracker.from_algorithm(algo)
    assert (t.window, t.warmup_rounds, t.ratio_max) == (3, 2, 4.0)


# -- switches beyond the paper and shares (docs/ALGORITHM.md "Switches beyond the paper") ------------------------


def test_sequence_log_prob_per_given_length():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert torch.allclose(sequence_mean_log_prob(lp, mask), torch.tensor([-2.0, -0.5]))
    # lengths > 0 replace the token count; <= 0 keeps it
    out = sequence_mean_log_prob(lp, mask, torch.tensor([12.0, 0.0]))
    assert torch.allclose(out, torch.tensor([-6.0 / 12.0, -0.5]))
    with pytest.raises(ValueError, match="lengths"):
        sequence_mean_log_prob(lp, mask, torch.tensor([1.0]))


def test_hacpo_cross_clip_off_uses_the_raw_ratio():
    # one cross row far below the band: clipped, it has no gradient; unclipped, objective = s * s^alpha * v * A
    lp = torch.tensor([-1.0, -3.0], requires_grad=True)
    old = torch.tensor([-1.0, -2.0])
    adv, is_self, v = torch.tensor([0.0, 2.0]), torch.tensor([True, False]), torch.tensor([1.0, 0.5])
    cfg_off = PolicyLossConfig(cross_clip=False, alpha=1.0)
    loss, m = hacpo_loss(lp, old, adv, is_self, v, 0, cfg_off)
    s = math.exp(-1.0)
    assert loss.item() == pytest.approx(-(s * s * 0.5 * 2.0) / 2)
    loss.backward()
    # d/dlp of -(s * sg(s) * v * A)/2 = -(s * sg(s) * v * A)/2 (ds/dlp = s)
    assert lp.grad[1].item() == pytest.approx(-(s * s * 0.5 * 2.0) / 2)
    assert m["hacpo/cross_in_band_frac"] == 1.0 and m["hacpo/cross_grad_frac"] == 1.0
    lp2 = lp.detach().clone().requires_grad_(True)
    loss_on, m_on = hacpo_loss(lp2, old, adv, is_self, v, 0, PolicyLossConfig())
    loss_on.backward()
    assert lp2.grad[1].item() == 0.0 and m_on["hacpo/cross_clip_low_frac"] == 1.0
    assert m_on["hacpo/cross_grad_frac"] == 0.0


def test_shares_are_recomputed_from_counts_and_dropped_over_empty_sets():
    from hacrl_fed.algorithm import FRACTION_COUNTS, fractions_from_counts

    summed = {"hacpo/num_cross": 8.0, "hacpo/num_cross_in_band": 2.0, "hacpo/cross_in_band_frac": 0.125,
              "hacpo/num_self": 0.0, "hacpo/self_clip_low_frac": 0.0, "hacpo/num_self_clip_low": 0.0}
    out = fractions_from_counts(summed)
    assert out["hacpo/cross_in_band_frac"] == 0.25  # 2 of 8, not the mean of per-step shares
    assert "hacpo/self_clip_low_frac" not in out
    # every share a loss reports has its count and denominator in the table
    lp, old = torch.tensor([-1.0, -1.2, -0.9]), torch.tensor([-1.0, -1.0, -1.0])
    adv, is_self, v = torch.tensor([1.0, -1.0, 0.5]), torch.tensor([True, False, False]), torch.ones(3)
    for _, metrics in (hacpo_loss(lp, old, adv, is_self, v, 0), naive_loss(lp, old, adv, is_self=is_self),
                       gspo_loss(lp, old, adv)):
        for k in metrics:
            if k.endswith("_frac"):
                num, den = FRACTION_COUNTS[k]
                assert metrics[k] == pytest.approx(metrics[num] / metrics[den])


def test_naive_reports_how_many_foreign_rows_carry_gradient():
    # A > 0 with s far above the band: clipped (no gradient); A < 0 with s far above: gradient (one-sided clip)
    lp = torch.tensor([0.0, -0.5, -0.5], requires_grad=True)
    old = torch.tensor([0.0, -1.0, -1.0])
    adv, is_self = torch.tensor([0.0, 1.0, -1.0]), torch.tensor([True, False, False])
    loss, m = naive_loss(lp, old, adv, is_self=is_self)
    loss.backward()
    assert lp.grad[1].item() == 0.0 and lp.grad[2].item() != 0.0
    assert m["naive/num_cross"] == 2 and m["naive/cross_grad_frac"] == 0.5


def test_per_source_counts_split_the_cross_rows_by_source():
    from hacrl_fed.algorithm import fractions_from_counts, name_sources

    # rows: self; source 1 in the band; source 1 below; source 2 above; source 2 in the band with A = 0
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0])
    lp = old + torch.log(torch.tensor([1.0, 0.9, 0.5, 1.5, 0.95]))
    adv, is_self = torch.tensor([1.0, 1.0, -1.0, 1.0, 0.0]), torch.tensor([True, False, False, False, False])
    src = torch.tensor([0, 1, 1, 2, 2])
    _, m = hacpo_loss(lp, old, adv, is_self, torch.ones(5), 0, source_ids=src)
    assert (m["hacpo/num_cross@1"], m["hacpo/num_cross_in_band@1"], m["hacpo/num_cross_clip_low@1"]) == (2, 1, 1)
    assert (m["hacpo/num_cross@2"], m["hacpo/num_cross_clip_high@2"], m["hacpo/num_cross_grad@2"]) == (2, 1, 0)
    assert m["hacpo/num_cross_grad@1"] == 1 and "hacpo/num_cross@0" not in m  # self rows have no source pair
    out = fractions_from_counts(name_sources(m, ["acme", "globex", "initech"]))
    assert out["hacpo/cross_in_band_frac/globex"] == 0.5 and out["hacpo/cross_clip_high_frac/initech"] == 0.5
    assert out["hacpo/cross_grad_frac/initech"] == 0.0 and out["hacpo/cross_in_band_frac"] == 0.5
    assert name_sources({"hacpo/num_cross@3": 1.0}, None) == {"hacpo/num_cross/src3": 1.0}
    # naive: the same split of its gradient-carrying foreign rows
    _, n = naive_loss(lp, old, adv, is_self=is_self, source_ids=src)
    assert n["naive/num_cross@1"] == 2 and n["naive/num_cross_grad@1"] == 1 and n["naive/num_cross_grad@2"] == 0
    # without source ids nothing per source is reported
    _, plain = hacpo_loss(lp, old, adv, is_self, torch.ones(5), 0)
    assert not any("@" in k for k in plain)


def test_per_source_shares_without_rows_are_dropped():
    from hacrl_fed.algorithm import fractions_from_counts

    out = fractions_from_counts({"hacpo/num_cross/globex": 0.0, "hacpo/num_cross_in_band/globex": 0.0,
                                 "hacpo/cross_in_band_frac/globex": 0.3})
    assert "hacpo/cross_in_band_frac/globex" not in out


# --- which rows a loss has a gradient for (trainer.skip_no_gradient_rows) -------------------------------------


def test_rows_with_gradient_hand_computed():
    from hacrl_fed.algorithm import PolicyLossConfig, rows_with_gradient

    cfg = PolicyLossConfig(self_clip_low=0.1, self_clip_high=0.1, cross_clip_delta=0.2, cross_clip_step=0.05)
    old = torch.zeros(8)
    # ratios s = exp(lbar): self rows (first 4), cross rows (last 4); step 0: cross band [0.8, 1]
    s = torch.tensor([1.05, 1.2, 0.85, 1.0, 0.9, 0.7, 1.1, 0.9])
    adv = torch.tensor([1.0, 1.0, -1.0, 0.0, 1.0, 1.0, -1.0, 0.0])
    is_self = torch.tensor([True] * 4 + [False] * 4)
    got = rows_with_gradient(s.log(), old, adv, is_self, 0, cfg, cross_band=True)
    # self: in band A>0 yes; A>0 above band no; A<0 below band no; A=0 no | cross: in band yes; below no; above no;
    # in band but A=0 no
    assert got.tolist() == [True, False, False, False, True, False, False, False]
    # step 2 narrows the band to [0.9, 1]: 0.9 stays (inclusive)
    assert rows_with_gradient(s.log(), old, adv, is_self, 2, cfg, cross_band=True)[4]
    assert not rows_with_gradient(s.log(), old, adv, is_self, 3, cfg, cross_band=True)[4]
    # naive: GSPO's clip on every row; A>0 below the band keeps its gradient, A<0 above keeps it
    naive = rows_with_gradient(s.log(), old, adv, is_self, 0, cfg, cross_band=False)
    assert naive.tolist() == [True, False, False, False, True, True, True, False]
    # the log-ratio clamp cuts the gradient
    far = torch.tensor([-30.0] * 8)
    assert not rows_with_gradient(far, old, adv, is_self, 0, PolicyLossConfig(max_abs_log_ratio=20.0),
                                  cross_band=False).any()


@pytest.mark.parametrize("loss_name", ["hacpo", "naive"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_rows_match_autograd(loss_name, seed):
    """Every row with a nonzero gradient of the registered loss is marked, and every marked row has one."""
    from hacrl_fed.algorithm import PolicyLossConfig, PolicyLossInputs, get_gradient_rows, get_policy_loss

    g = torch.Generator().manual_seed(seed)
    n = 64
    cfg = PolicyLossConfig(cross_clip_delta=0.2, cross_clip_step=0.05, max_abs_log_ratio=1.0)
    lbar = (torch.rand(n, generator=g) * 1.6 - 1.2).requires_grad_(True)  # log-ratios in [-1.2, 0.4]
    adv = torch.randint(-1, 2, (n,), generator=g).float()
    is_self = torch.rand(n, generator=g) < 0.3
    inputs = PolicyLossInputs(lbar[:, None], torch.ones(n, 1), torch.zeros(n), adv, is_self,
                              torch.rand(n, generator=g) + 0.5)
    for step in (0, 2):
        loss, _ = get_policy_loss(loss_name)(inputs, step, cfg)
        (grad,) = torch.autograd.grad(loss, lbar)
        marked = get_gradient_rows(loss_name)(lbar.detach(), inputs, step, cfg)
        assert torch.equal(marked, grad != 0)
        assert 0 < int(marked.sum()) < n
