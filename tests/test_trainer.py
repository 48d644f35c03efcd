"""LocalTrainer: micro-batching is exact, schedule/ordering, KL term, per-algorithm row selection."""

import random

import pytest
import torch

from hacrl_fed.config import AlgorithmConfig, TrainerConfig
from hacrl_fed.trainer import LocalTrainer, TrainRow
from tests.helpers_tiny import tiny_char_tokenizer, tiny_model


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
    trainer = LocalTrainer(model, AlgorithmConfig(name=algorithm, kl_beta=kl_beta),
                           TrainerConfig(lr=lr, minibatch_size=minibatch, micro_batch_size=micro), tok.pad_token_id)
    if sgd:  # updates linear in the gradient: float summation-order noise stays ~1e-9 (Adam would amplify it)
        trainer.optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    metrics = trainer.update(rows, 0, [0.5, 0.25, 1.0])
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
