"""LocalTrainer: micro-batching is exact, schedule/ordering, KL term, per-algorithm row selection."""

import math
import random
from pathlib import Path

import pytest
import torch

from hacrl_fed.algorithm import get_algorithm
from hacrl_fed.config import AlgorithmConfig, TrainerConfig
from hacrl_fed.trainer import LocalTrainer, TrainRow
from hacrl_fed.worker.intake import Scoring, admit_rows, update_metrics
from hacrl_fed.worker.ledger import Ledger
from tests.helpers_tiny import PAPER_ALGORITHM, PAPER_TRAINER, tiny_char_tokenizer, tiny_model



def _algo(**kw) -> AlgorithmConfig:
    """The paper's HACPO (helpers_tiny.PAPER_ALGORITHM): these tests are of the update's mechanics."""
    return AlgorithmConfig(**{**PAPER_ALGORITHM, **kw})


def _tcfg(**kw) -> TrainerConfig:
    """Every foreign row, no likelihood screen (helpers_tiny.PAPER_TRAINER)."""
    return TrainerConfig(**{**PAPER_TRAINER, **kw})

def _rows(n=12, seed=0, cross=True):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        is_self = (not cross) or i % 3 == 0
        resp = [rng.randrange(5, 20) for _ in range(rng.randint(1, 6))]
        rows.append(TrainRow([rng.randrange(5, 20) for _ in range(rng.randint(1, 4))], resp, float(rng.random() < .5),
                             i % 3, 0 if is_self else 1 + i % 2, is_self, -2.5 + rng.random(),
                             [-2.5] * len(resp) if is_self else None))
    return rows


def _train(algorithm, micro, rows, kl_beta=0.0, lr=1e-2, minibatch=6, sgd=False):
    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=1)
    trainer = LocalTrainer(model, _algo(name=algorithm, kl_beta=kl_beta),
                           _tcfg(lr=lr, minibatch_size=minibatch, micro_batch_size=micro), tok.pad_token_id)
    if sgd:  # updates linear in the gradient: float summation-order noise stays ~1e-9 (Adam would amplify it)
        trainer.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    # as the intake admits them: no cross rows for an algorithm that uses none, its last two stages, the update
    rows = [r for r in rows if r.is_self or get_algorithm(algorithm).uses_cross]
    names, ledger = [str(s) for s in range(3)], Ledger()
    rows = admit_rows(rows, names, Scoring.of(trainer), trainer.cfg.likelihood_screen, ledger)
    metrics = update_metrics(trainer.update(rows, 0, [0.5, 0.25, 1.0]), rows, ledger)
    return model, metrics


@pytest.mark.parametrize("algorithm", ["hacpo", "naive", "grpo", "gspo"])
def test_micro_batching_is_exact(algorithm):
    rows = _rows(cross=algorithm in ("hacpo", "naive"))
    m1, met1 = _train(algorithm, 1, rows, lr=1.0, sgd=True)
    m2, met2 = _train(algorithm, 64, rows, lr=1.0, sgd=True)
    m0 = _train(algorithm, 64, [], lr=1.0, sgd=True)[0]
    assert any(not torch.equal(a, b) for a, b in zip(m0.parameters(), m2.parameters()))
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert met1["train/loss"] == pytest.approx(met2["train/loss"], rel=1e-4, abs=1e-6)
    assert met1["train/steps"] == 2


def test_kl_term_changes_update_and_is_reported():
    rows = _rows()
    # mini-batches of 2: the 4 self rows (ordered first) span steps 0 and 1; KL applies to self tokens only
    m0, met0 = _train("hacpo", 4, rows, lr=1e-2, minibatch=2)
    m1, met1 = _train("hacpo", 4, rows, kl_beta=1.0, lr=1e-2, minibatch=2)
    assert met0["train/kl"] == 0.0 and met1["train/kl"] > 0.0
    # step 0 starts at the reference (KL 0, zero gradient); step 1 sees a positive KL that changes the update
    assert any(not torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters()))


def test_baselines_drop_cross_rows():
    rows = _rows()
    _, met = _train("gspo", 4, rows)
    assert met["train/num_cross"] == 0 and met["train/num_self"] == sum(r.is_self for r in rows)
    _, met = _train("naive", 4, rows)
    assert met["train/num_cross"] == sum(not r.is_self for r in rows)


def test_unscoreable_rows_still_count_in_the_group_baseline():
    rows = _rows(cross=False)
    extra = TrainRow([5, 6], [], 1.0, rows[0].group, 0, True, -1.0, [])  # a response with no learner tokens
    m_without, met_without = _train("gspo", 64, rows, lr=1.0, sgd=True)
    m_with, met_with = _train("gspo", 64, rows + [extra], lr=1.0, sgd=True)
    assert met_with["train/num_rows"] == met_without["train/num_rows"]  # not trained on
    assert any(not torch.allclose(a, b) for a, b in zip(m_without.parameters(), m_with.parameters()))


# --- numerics and memory options (trainer.precision, trainer.gradient_checkpointing) ----------------------------


def _trainer(precision="model", dtype=torch.float32, checkpointing=False, kl_beta=0.0, lr=1e-2, skip=True):
    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=1).to(dtype)
    cfg = _tcfg(lr=lr, minibatch_size=6, micro_batch_size=4, precision=precision,
                        gradient_checkpointing=checkpointing)
    return model, _every_row_backward(LocalTrainer(model, _algo(name="hacpo", kl_beta=kl_beta), cfg, tok.pad_token_id),
                                      not skip)


def _every_row_backward(trainer, every_row=True):
    """``trainer`` with every row through forward and backward (no gradient-rows prefilter; the reference the skip
    is checked against) when ``every_row``."""
    if every_row:
        trainer.gradient_rows = None
    return trainer


def test_update_reports_tokens_trained():
    rows = _rows()
    _, met = _train("hacpo", 4, rows)
    assert met["train/num_tokens"] == sum(len(r.prompt_token_ids) + len(r.response_ids) for r in rows)


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_update():
    rows = _rows()
    plain, t_plain = _trainer(skip=False)
    ckpt, t_ckpt = _trainer(checkpointing=True, kl_beta=0.5, skip=False)  # every row forward and backward
    _, t_ref = _trainer(kl_beta=0.5)
    t_plain.optimizer = torch.optim.SGD(plain.parameters(), lr=1.0)
    t_ckpt.optimizer = torch.optim.SGD(ckpt.parameters(), lr=1.0)
    layers = [m for m in ckpt.modules() if getattr(m, "_hacrl_checkpointed", False)]
    assert len(layers) == 2 and not any(getattr(m, "_hacrl_checkpointed", False) for m in t_ckpt.ref_model.modules())
    calls = []
    for layer in layers:  # the recompute calls the layer's forward directly: count its MLP's calls
        layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    t_plain.update(rows, 0, [0.5, 0.25, 1.0])
    t_ckpt.algo = t_plain.algo  # same objective (no KL) for the comparison; the KL copy was made before wrapping
    t_ckpt.ref_model = None
    t_ckpt.update(rows, 0, [0.5, 0.25, 1.0])
    for a, b in zip(plain.parameters(), ckpt.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    # 2 steps x micro-batches (4 + 2 rows per step) x 2 layers, each run once forward and once more in backward
    assert len(calls) == 2 * 2 * 2 * 2
    with torch.no_grad():  # no recompute without grad (generation, scoring)
        calls.clear()
        ckpt(torch.tensor([[5, 6, 7]]))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="gradient_checkpointing"):
        from hacrl_fed.models.training_mode import checkpoint_layers

        checkpoint_layers(torch.nn.Linear(2, 2))


def test_bf16_master_keeps_fp32_masters_and_bf16_model():
    rows = _rows()
    model, trainer = _trainer("bf16-master", dtype=torch.bfloat16, lr=1e-2)
    ref, ref_trainer = _trainer("model", dtype=torch.float32, lr=1e-2)
    with torch.no_grad():  # the fp32 reference starts from the same (bf16-representable) weights
        for a, b in zip(ref.parameters(), model.parameters()):
            a.copy_(b.float())
    before = [m.clone() for m in trainer.master]
    met = trainer.update(rows, 0, [0.5, 0.25, 1.0])
    ref_trainer.update(rows, 0, [0.5, 0.25, 1.0])
    assert math.isfinite(met["train/loss"]) and met["train/steps"] == 2
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in trainer.master)
    assert all(s.dtype == torch.float32 for st in trainer.optimizer.state.values() for s in st.values()
               if torch.is_tensor(s) and s.dim() > 0)
    for p, m in zip(model.parameters(), trainer.master):
        assert torch.equal(p, m.to(torch.bfloat16))  # the model holds the rounded masters
    # the fp32 masters moved as an fp32 run would (same AdamW steps, bf16 forward noise only)
    with torch.no_grad():
        moved = float(sum((m - b).abs().sum() for m, b in zip(trainer.master, before)))
        moved_ref = float(sum((r - b).abs().sum() for r, b in zip(ref.parameters(), before)))
    assert moved == pytest.approx(moved_ref, rel=0.1)
    # tiny updates survive in the masters even where bf16 cannot represent them
    model2, small = _trainer("bf16-master", dtype=torch.bfloat16, lr=1e-7)
    start = [m.clone() for m in small.master]
    small.update(rows, 0, [0.5, 0.25, 1.0])
    assert any(not torch.equal(a, b) for a, b in zip(small.master, start))
    # checkpoint round trip restores the exact masters
    state = trainer.state_dict()
    assert len(state["master"]) == len(trainer.master)
    _, fresh = _trainer("bf16-master", dtype=torch.bfloat16)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(fresh.master, trainer.master))


def test_bf16_autocast_trains_fp32_weights_close_to_fp32():
    rows = _rows()
    model, trainer = _trainer("bf16-autocast", lr=1e-2)
    ref, ref_trainer = _trainer("model", lr=1e-2)
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    trainer.update(rows, 0, [0.5, 0.25, 1.0])
    ref_trainer.update(rows, 0, [0.5, 0.25, 1.0])
    assert torch.bfloat16 in seen  # the forward ran under bf16 autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        diff = sum((a - b).abs().sum() for a, b in zip(model.parameters(), ref.parameters()))
    total = sum(p.numel() for p in model.parameters())
    assert float(diff) / total < 2e-3  # lr 1e-2 steps: bf16 forward noise only


@pytest.mark.parametrize("precision,dtype,needs", [("bf16-autocast", torch.bfloat16, "float32"),
                                                   ("bf16-master", torch.float32, "bfloat16")])
def test_precision_needs_matching_model_dtype(precision, dtype, needs):
    with pytest.raises(ValueError, match=f"model.dtype: {needs}"):
        _trainer(precision, dtype=dtype)


# --- the config means what it says: GRPO's token mean, LoRA dropout, the registry spec, the context ----------------


def _grpo_rows(n=8, seed=3):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        resp = [rng.randrange(5, 20) for _ in range(1 + 5 * (i % 2))]  # responses of 1 and 6 tokens
        rows.append(TrainRow([5, 6], resp, float(i % 4 < 2), i % 2, 0, True, -2.5, [-2.5] * len(resp)))
    return rows


def _train_grpo(micro):
    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=1)
    trainer = LocalTrainer(model, _algo(name="grpo"),
                           _tcfg(lr=1.0, minibatch_size=8, micro_batch_size=micro), tok.pad_token_id)
    trainer.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    return model, trainer, trainer.update(_grpo_rows(), 0, [1.0])


def test_grpo_token_mean_micro_batching_stays_exact():
    # responses of 1 and 6 tokens: weighting micro-batches by rows instead of tokens would change the update
    whole, t_whole, _ = _train_grpo(8)
    micro, t_micro, _ = _train_grpo(1)
    assert t_whole.by_tokens and t_micro.by_tokens  # micro-batches weighted by their share of the tokens
    start = tiny_model("qwen3", tiny_char_tokenizer(), seed=1)
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(whole.parameters(), start.parameters()))
    for a, b in zip(whole.parameters(), micro.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_trainer_asks_the_algorithm_spec_not_the_name(monkeypatch):
    import hacrl_fed.trainer as trainer_mod
    from hacrl_fed.algorithm import ALGORITHMS, AlgorithmSpec

    calls = []
    real = trainer_mod.capability_coefficients
    monkeypatch.setattr(trainer_mod, "capability_coefficients", lambda *a, **k: calls.append(1) or real(*a, **k))
    _train("hacpo", 4, _rows())
    assert calls  # hacpo's spec: capability cross weights
    calls.clear()
    monkeypatch.setitem(ALGORITHMS, "hacpo", AlgorithmSpec("hacpo", "hacpo", uses_cross=True, uses_capability_coefficient=False))
    _, met = _train("hacpo", 4, _rows())
    assert not calls and met["train/num_cross"] > 0
    monkeypatch.setitem(ALGORITHMS, "gspo", AlgorithmSpec("group", "naive", uses_cross=True))
    _, met = _train("gspo", 4, _rows())
    assert met["train/num_cross"] > 0 and "naive/ratio_mean" in met  # the spec, not the name, decides
    source = (Path(trainer_mod.__file__)).read_text()
    assert not any(f'== "{name}"' in source or f"== '{name}'" in source for name in ALGORITHMS)


def _lora_trainer(dropout, seed=0):
    pytest.importorskip("peft")
    from peft import LoraConfig as PeftLora, get_peft_model

    from hacrl_fed.config import LoraConfig

    tok = tiny_char_tokenizer()
    torch.manual_seed(seed)
    model = get_peft_model(tiny_model("qwen3", tok, seed=1), PeftLora(r=4, lora_alpha=8, lora_dropout=dropout,
                                                                      target_modules=["q_proj", "v_proj"]))
    model.eval()
    with torch.no_grad():  # non-zero B: the adapters' dropout then shows in the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    cfg = _tcfg(lr=1e-2, minibatch_size=6, micro_batch_size=6, lora=LoraConfig(enabled=True, dropout=dropout))
    return model, LocalTrainer(model, _algo(name="hacpo", kl_beta=0.1), cfg, tok.pad_token_id)


def test_lora_dropout_fires_only_on_the_adapters_during_the_update():
    from hacrl_fed.scoring import build_scoring_batch_from_ids, token_log_probs
    from hacrl_fed.models.training_mode import adapter_dropout

    model, trainer = _lora_trainer(0.5)
    assert len(trainer.dropout) == 4  # q_proj and v_proj of 2 layers
    seen = []
    for m in trainer.dropout:
        m.register_forward_pre_hook(lambda mod, _: seen.append(mod.training))
    ref_seen = []
    for name, m in trainer.ref_model.named_modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_pre_hook(lambda mod, _: ref_seen.append(mod.training))
    others = [m for m in model.modules() if m not in trainer.dropout and m is not model]
    trainer.update(_rows(6, cross=False), 0, [1.0])
    assert seen and all(seen)  # the adapters' dropout was on in every update forward
    assert ref_seen and not any(ref_seen)  # the frozen KL reference stayed deterministic
    assert not any(m.training for m in trainer.dropout) and not any(m.training for m in others)
    batch = build_scoring_batch_from_ids([[5, 6, 7]] * 2, [[8, 9, 10, 11]] * 2, trainer.pad_id)
    with torch.no_grad():
        eval_a, _ = token_log_probs(model, batch)
        eval_b, _ = token_log_probs(model, batch)
        train_a, _ = token_log_probs(model, batch, dropout=trainer.dropout)
        train_b, _ = token_log_probs(model, batch, dropout=trainer.dropout)
        with adapter_dropout(trainer.dropout):  # on through the block (backward's recompute included)
            assert all(m.training for m in trainer.dropout)
            token_log_probs(model, batch, dropout=trainer.dropout)
            assert all(m.training for m in trainer.dropout)
    assert torch.equal(eval_a, eval_b)  # scoring and old log-probs: deterministic
    assert not torch.allclose(train_a, train_b)  # two update forwards of the same batch differ


def test_lora_dropout_zero_keeps_the_update_deterministic():
    _, trainer = _lora_trainer(0.0)
    assert trainer.dropout == []
    models = []
    for _ in range(2):
        model, trainer = _lora_trainer(0.0)
        trainer.update(_rows(6, cross=False), 0, [1.0])
        models.append(model)
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)


def test_rows_longer_than_the_context_are_left_out_but_count_in_the_baseline():
    rows = _rows(cross=False)
    _, trainer = _trainer()
    context = trainer.context
    assert context == 512  # the tiny model's max_position_embeddings
    long_row = TrainRow([5] * 10, [6] * (context - 5), 1.0, rows[0].group, 0, True, -1.0, [-1.0] * (context - 5))
    m_without, met_without = _train("gspo", 64, rows, lr=1.0, sgd=True)
    m_with, met_with = _train("gspo", 64, rows + [long_row], lr=1.0, sgd=True)
    assert met_with["train/num_rows"] == met_without["train/num_rows"] and met_with["train/num_too_long"] == 1.0
    assert met_without["train/num_too_long"] == 0.0
    assert any(not torch.allclose(a, b) for a, b in zip(m_without.parameters(), m_with.parameters()))


def test_lora_dropout_with_gradient_checkpointing_recomputes_the_same_mask():
    from hacrl_fed.models.training_mode import checkpoint_layers

    results = []
    for ckpt in (False, True):
        model, trainer = _lora_trainer(0.5)
        trainer.ref_model = None  # no KL: the two runs must draw the same dropout masks in the same order
        if ckpt:
            assert checkpoint_layers(model) == 2
        trainer.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        torch.manual_seed(123)
        trainer.update(_rows(6, cross=False), 0, [1.0])
        results.append([p.detach().clone() for p in model.parameters() if p.requires_grad])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-6)


# -- ablation switches and shares over the whole update (docs/ALGORITHM.md "Switches beyond the paper") -----------


def _train_algo(algo: AlgorithmConfig, rows, capability, minibatch=6):
    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=1)
    trainer = LocalTrainer(model, algo, _tcfg(lr=1e-2, minibatch_size=minibatch, micro_batch_size=4),
                           tok.pad_token_id)
    trainer.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    return model, trainer.update(rows, 0, capability)


def _mixed_rows(n=12, seed=5):
    """Rows whose groups hold self and cross rows (so the capability can move the baseline)."""
    rows = _rows(n=n, seed=seed)
    return [TrainRow(r.prompt_token_ids, r.response_ids, r.reward, i % 2, r.source, r.is_self, r.old_seq_log_prob,
                     r.old_token_log_probs) for i, r in enumerate(rows)]


def test_without_both_capability_mechanisms_the_capability_has_no_effect():
    rows = _mixed_rows()
    off = _algo(name="hacpo", advantage_calibration=False, capability_coefficient=False, cross_clip=False)
    a = _train_algo(off, rows, [0.5, 0.25, 1.0])[0]
    b = _train_algo(off, rows, [0.9, 0.9, 0.1])[0]
    for x, y in zip(a.parameters(), b.parameters()):
        assert torch.allclose(x, y, atol=1e-7)
    # each switch alone leaves the other mechanism reading the capability
    for one in (_algo(name="hacpo", advantage_calibration=False, cross_clip=False),
                _algo(name="hacpo", capability_coefficient=False, cross_clip=False)):
        c = _train_algo(one, rows, [0.5, 0.25, 1.0])[0]
        d = _train_algo(one, rows, [0.9, 0.9, 0.1])[0]
        assert any(not torch.allclose(x, y, atol=1e-7) for x, y in zip(c.parameters(), d.parameters()))


def test_cross_shares_are_over_cross_rows_not_averaged_with_self_only_steps():
    rows = _rows(n=12, seed=2)  # 4 self rows, 8 cross rows; mini-batches of 4 put the self rows in one step
    _, m = _train_algo(_algo(name="hacpo"), rows, [0.5, 0.25, 1.0], minibatch=4)
    assert m["hacpo/num_cross"] == 8 and m["hacpo/num_self"] == 4
    # every cross row is below, inside or above the band: the three shares sum to 1 over the update
    total = m["hacpo/cross_clip_low_frac"] + m["hacpo/cross_in_band_frac"] + m["hacpo/cross_clip_high_frac"]
    assert total == pytest.approx(1.0)
    assert m["hacpo/cross_in_band_frac"] == pytest.approx(m["hacpo/num_cross_in_band"] / 8)
    assert m["hacpo/self_clip_low_frac"] == pytest.approx(m["hacpo/num_self_clip_low"] / 4)


def test_shares_over_an_empty_kind_are_absent():
    rows = _rows(n=6, seed=1, cross=False)
    _, m = _train_algo(_algo(name="hacpo"), rows, [0.5, 0.25, 1.0])
    assert m["hacpo/num_self"] == 6 and "hacpo/num_cross" in m
    assert not any(k.startswith("hacpo/cross_") and k.endswith("_frac") for k in m)


def test_norm_length_divides_the_cross_row_log_prob():
    """A row's lbar is sum/len(tokens), or sum/norm_length when set: with old = the same quantity the ratio is 1."""
    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=1)
    from hacrl_fed.scoring import build_scoring_batch_from_ids, token_log_probs

    prompt, resp = [5, 6, 7], [8, 9, 10, 11]
    with torch.no_grad():
        lp, mask = token_log_probs(model, build_scoring_batch_from_ids([prompt], [resp], tok.pad_token_id))
    total = float(lp.sum())
    rows = [TrainRow(prompt, resp, 1.0, 0, 0, True, total / 4, [float(x) for x in lp[0][mask[0].bool()]]),
            TrainRow(prompt, resp, 0.0, 0, 0, True, total / 4, [float(x) for x in lp[0][mask[0].bool()]]),
            TrainRow(prompt, resp, 1.0, 0, 1, False, total / 10.0, norm_length=10.0),  # per byte (10 bytes)
            TrainRow(prompt, resp, 0.0, 0, 1, False, total / 4)]  # per token
    trainer = LocalTrainer(model, _algo(name="hacpo"), _tcfg(lr=1e-9, minibatch_size=8,
                                                                                 micro_batch_size=8), tok.pad_token_id)
    m = trainer.update(rows, 0, [1.0, 1.0])
    assert m["hacpo/cross_ratio_min"] == pytest.approx(1.0, abs=1e-5)
    assert m["hacpo/cross_ratio_max"] == pytest.approx(1.0, abs=1e-5)


def test_cross_clip_off_lets_out_of_band_cross_rows_carry_gradient():
    rows = [r for r in _rows(n=12, seed=4) if not r.is_self] + [r for r in _rows(n=12, seed=4) if r.is_self]
    on = _train_algo(_algo(name="hacpo"), rows, [1.0, 1.0, 1.0], minibatch=12)[1]
    off = _train_algo(_algo(name="hacpo", cross_clip=False), rows, [1.0, 1.0, 1.0], minibatch=12)[1]
    assert on["hacpo/cross_in_band_frac"] < 1.0  # these rows' published log-probs put some outside the band
    assert off["hacpo/cross_in_band_frac"] == 1.0
    assert off["hacpo/cross_grad_frac"] >= on["hacpo/cross_grad_frac"]


def test_cross_shares_per_source_pair_add_up_to_the_whole_update():
    rows = _rows(n=12, seed=2)  # cross rows from sources 1 and 2
    tok = tiny_char_tokenizer()
    trainer = LocalTrainer(tiny_model("qwen3", tok, seed=1), _algo(name="hacpo"),
                           _tcfg(lr=1e-2, minibatch_size=4, micro_batch_size=4), tok.pad_token_id)
    m = trainer.update(rows, 0, [0.5, 0.25, 1.0], names=["acme", "globex", "initech"])
    assert m["hacpo/num_cross/globex"] + m["hacpo/num_cross/initech"] == m["hacpo/num_cross"] == 8
    for kind in ("cross_in_band", "cross_clip_low", "cross_clip_high", "cross_grad"):
        per = [m[f"hacpo/num_{kind}/{o}"] for o in ("globex", "initech")]
        assert sum(per) == m[f"hacpo/num_{kind}"], kind
        for o in ("globex", "initech"):
            assert m[f"hacpo/{kind}_frac/{o}"] == pytest.approx(m[f"hacpo/num_{kind}/{o}"] / m[f"hacpo/num_cross/{o}"])
    assert not any("@" in k for k in m)


# --- forward/backward only over the rows with a gradient ------------------------------------------------------------


def _banded_rows(model, tok, seed=0):
    """Cross rows whose published lbar puts them above, inside and below HACPO's band under ``model``."""
    from hacrl_fed.scoring import build_scoring_batch_from_ids, sequence_log_probs

    rows = _rows(n=24, seed=seed)
    batch = build_scoring_batch_from_ids([r.prompt_token_ids for r in rows], [r.response_ids for r in rows],
                                         tok.pad_token_id)
    _, _, mean = sequence_log_probs(model, batch, 64)
    for i, r in enumerate(rows):
        if not r.is_self:  # s = exp(lbar - old): 1.05 (above), 0.9 (in band), 0.5 (below)
            r.old_seq_log_prob = float(mean[i]) - math.log((1.05, 0.9, 0.5)[i % 3])
        else:
            r.old_seq_log_prob = float(mean[i])
            r.old_token_log_probs = None
    return rows


@pytest.mark.parametrize("algorithm", ["hacpo", "naive"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_skipping_rows_without_gradient_gives_the_same_update(algorithm, optimizer):
    tok = tiny_char_tokenizer()
    results = []
    for skip in (False, True):
        model = tiny_model("qwen3", tok, seed=1)
        rows = _banded_rows(model, tok)
        # mini-batches of 8: step 0 holds the 8 self rows, steps 1-2 the cross rows; micro-batches of 3
        cfg = _tcfg(lr=1e-2, minibatch_size=8, micro_batch_size=3)
        trainer = _every_row_backward(LocalTrainer(model, _algo(name=algorithm), cfg, tok.pad_token_id), not skip)
        if optimizer == "sgd":
            trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        met = trainer.update(rows, 0, [0.5, 0.25, 1.0])
        met2 = trainer.update(rows, 0, [0.5, 0.25, 1.0])  # a second round: AdamW's moments carry over
        results.append((model, met, met2))
    (m_full, met_full, met2_full), (m_skip, met_skip, met2_skip) = results
    for a, b in zip(m_full.parameters(), m_skip.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    assert met_full["train/num_backward"] == 24 and met_skip["train/num_backward"] < 24
    for key, value in met_full.items():
        if key.startswith(("hacpo/", "naive/", "train/loss", "train/grad_norm")):
            assert met_skip[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert met2_skip["train/loss"] == pytest.approx(met2_full["train/loss"], rel=1e-4, abs=1e-5)


def test_a_mini_batch_without_gradient_rows_still_steps_adamw():
    """A step whose rows all lack a gradient gets a zero gradient, as the full pass would (AdamW still moves)."""
    tok = tiny_char_tokenizer()
    out = []
    for skip in (False, True):
        model = tiny_model("qwen3", tok, seed=1)
        rows = [r for r in _banded_rows(model, tok) if r.is_self or r.source == 1]
        for r in rows:
            if not r.is_self:
                r.old_seq_log_prob += 5.0  # far below the band: no gradient
        cfg = _tcfg(lr=1e-2, minibatch_size=8, micro_batch_size=4)
        trainer = _every_row_backward(LocalTrainer(model, _algo(name="hacpo"), cfg, tok.pad_token_id), not skip)
        met = trainer.update(rows, 0, [0.5, 0.25, 1.0])
        out.append((model, met))
    assert out[1][1]["train/num_backward"] == 8  # only the self rows of step 0
    assert out[1][1]["train/steps"] == out[0][1]["train/steps"] >= 2
    for a, b in zip(out[0][0].parameters(), out[1][0].parameters()):
        assert torch.allclose(a, b, atol=1e-6)
