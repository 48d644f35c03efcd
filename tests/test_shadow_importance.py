"""The outcome guard's cheap shadow (issue 44): importance weights (hacrl_fed/algorithm/shadow_importance.py), the
shadow's update on the learner's own rows reducing to plain GSPO when shadow == learner, and the file stash
(hacrl_fed/worker/stash.py) its weights and the reference live in."""

import math
import random

import pytest
import torch

from hacrl_fed.algorithm.shadow_importance import importance_weights, importance_weights_tensor
from hacrl_fed.config import AlgorithmConfig, TrainerConfig
from hacrl_fed.engines.base import GenerationEngine
from hacrl_fed.trainer import LocalTrainer, TrainRow
from hacrl_fed.worker.shadow import Shadow, rescored
from hacrl_fed.worker.stash import Stash
from hacrl_fed.worker.weights import restore, snapshot, trainable_params
from tests.helpers_tiny import PAPER_ALGORITHM, PAPER_TRAINER, tiny_char_tokenizer, tiny_model


def test_importance_weights_by_hand():
    # exp(-1.0 - -1.5) = exp(0.5) = 1.6487; exp(-2 - -1) = exp(-1) = 0.3679; exp(1.0) = 2.718 > clip 2 -> 2
    w = importance_weights([-1.0, -2.0, 0.0, -3.0], [-1.5, -1.0, -1.0, -3.0], clip=2.0)
    assert w == pytest.approx([math.exp(0.5), math.exp(-1.0), 2.0, 1.0])
    with pytest.raises(ValueError, match="clip"):
        importance_weights([0.0], [0.0], clip=0.0)
    with pytest.raises(ValueError, match="2 shadow scores for 1"):
        importance_weights([0.0, 0.0], [0.0], clip=2.0)
    t = importance_weights_tensor(torch.tensor([-1.0, -2.0, 0.0, -3.0]), torch.tensor([-1.5, -1.0, -1.0, -3.0]), 2.0)
    assert t.tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 2.0, 1.0])


def test_rescored_rows_start_on_policy_for_the_shadow():
    row = TrainRow([5, 6], [7, 8, 9, 10], 1.0, 0, 0, True, -2.0, [-2.0] * 4)
    rows, w = rescored([row], [[-1.0, -1.0, -2.0, -2.0]], index=0, clip=2.0)
    assert rows[0].old_seq_log_prob == -1.5 and rows[0].old_token_log_probs == [-1.0, -1.0, -2.0, -2.0]
    assert w == pytest.approx([math.exp(0.5)])  # lbar_shadow -1.5 against the learner's -2.0
    per_byte = TrainRow([5], [7, 8], 1.0, 0, 0, True, -1.0, [-1.0, -1.0], norm_length=4.0)
    assert rescored([per_byte], [[-2.0, -2.0]], index=0, clip=2.0)[0][0].old_seq_log_prob == -1.0  # 4 / 4 bytes


class _Learner:
    """The :class:`~hacrl_fed.worker.learner.Learner` verbs the shadow uses, over a micro model and its trainer."""

    def __init__(self, seed: int = 1, minibatch: int = 8):
        tok = tiny_char_tokenizer()
        self.model = tiny_model("qwen3", tok, seed=seed)
        algo = AlgorithmConfig(**{**PAPER_ALGORITHM, "name": "hacpo"})
        tcfg = TrainerConfig(**{**PAPER_TRAINER, "lr": 1e-2, "minibatch_size": minibatch, "micro_batch_size": 8})
        self.trainer = LocalTrainer(self.model, algo, tcfg, tok.pad_token_id)
        self.engine: GenerationEngine = _NoEngine()
        self.context = None

    def score(self, rows):
        return self.trainer.token_log_prob_lists(rows)

    def update(self, rows, learner, capability, importance=None, reweigh=None):
        return self.trainer.update(rows, learner, capability, importance=importance, reweigh=reweigh)

    def one_step(self, n_rows):
        return self.trainer.one_step(n_rows) and not self.scoring_pass

    scoring_pass = False  # True: the shadow takes its scoring pass even where one step would not need it

    def weights(self):
        return snapshot(self.model, self.trainer)

    def live(self):
        return {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}, self.trainer.state_dict()

    def params(self):
        return trainable_params(self.model)

    def load_weights(self, saved, *, sync=True):
        restore(self.model, self.trainer, self.engine, saved, sync=sync)

    def load_params(self, params, *, sync):
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                if n in params:
                    p.copy_(params[n])


class _NoEngine:
    def sync_weights(self, model) -> None:
        pass


def _own_rows(learner: _Learner, n: int = 8) -> list[TrainRow]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        resp = [rng.randrange(5, 20) for _ in range(rng.randint(2, 6))]
        rows.append(TrainRow([rng.randrange(5, 20) for _ in range(3)], resp, float(i % 2), i // 4, 0, True, 0.0))
    scores = learner.score(rows)  # the learner sampled them: its own pre-update scores are their old log-probs
    return [TrainRow(r.prompt_token_ids, r.response_ids, r.reward, r.group, 0, True, sum(t) / len(t), t)
            for r, t in zip(rows, scores)]


def test_importance_weights_of_one_are_the_plain_update():
    a, b = _Learner(), _Learner()
    rows = _own_rows(a)
    a.update(rows, 0, [1.0])
    b.update(rows, 0, [1.0], importance=[1.0] * len(rows))
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    c = _Learner()  # a weight of 0 on every row: no gradient, the weights do not move
    before = [p.detach().clone() for p in c.model.parameters()]
    c.update(rows, 0, [1.0], importance=[0.0] * len(rows))
    assert all(torch.equal(p, q) for p, q in zip(before, c.model.parameters()))


def test_a_shadow_equal_to_the_learner_takes_plain_gspo_on_its_own_rows(tmp_path):
    learner, alone = _Learner(), _Learner()
    rows = _own_rows(learner)
    foreign = TrainRow([5, 6], [7, 8], 1.0, 0, 1, False, -2.0)  # never in the shadow's update
    shadow = Shadow(tmp_path, learner.weights(), clip=2.0)  # shadow == learner
    before = learner.params()
    m = shadow.train(learner, [*rows, foreign], 0, [1.0, 1.0])
    assert m["outcome/shadow_rows"] == len(rows) and m["outcome/shadow_importance_mean"] == pytest.approx(1.0)
    assert all(torch.equal(before[n], p) for n, p in learner.params().items())  # the learner's weights back
    alone.update(rows, 0, [1.0, 1.0])  # plain GSPO (HACPO's self rows) on the same rows
    got = shadow.saved[0]
    assert all(torch.allclose(got[n], p, atol=1e-6) for n, p in alone.params().items())
    assert any(not torch.equal(got[n], before[n]) for n in before)  # it trained


def test_the_stash_round_trips_and_keeps_a_mapping_valid_across_writes(tmp_path):
    learner = _Learner()
    learner.update(_own_rows(learner), 0, [1.0])  # an optimizer state to keep
    stash = Stash(tmp_path / "guard" / "reference.pt")
    stash.put(learner.live())
    first = stash.get()
    other = _Learner(seed=2)
    other.load_weights(first, sync=False)
    assert all(torch.equal(p, q) for p, q in zip(learner.model.parameters(), other.model.parameters()))
    state = learner.trainer.state_dict()["optimizer"]["state"]
    assert other.trainer.state_dict()["optimizer"]["state"].keys() == state.keys() and state
    kept = {n: t.clone() for n, t in first[0].items()}
    stash.put(_Learner(seed=3).live())  # a new file renamed over it: the earlier mapping still reads the old one
    assert all(torch.equal(first[0][n], t) for n, t in kept.items())
    assert not all(torch.equal(stash.params()[n], t) for n, t in kept.items())
    stash.drop()
    assert not stash.path.exists()


@pytest.mark.parametrize("per_byte", [False, True])
def test_the_shadow_scored_in_its_own_forward_takes_the_scoring_passes_update(tmp_path, per_byte):
    # one optimizer step (8 rows, mini-batch 8): the shadow's scores and importance weights come from the update's
    # own forward (reweigh), no scoring pass; a shadow that differs from the learner gets the update the scoring
    # pass gave it (old log-probs = its pre-update scores, weights from them), to float32 rounding
    learner = _Learner(minibatch=16)  # one step, two micro-batches
    rows = _own_rows(learner, n=12)  # three groups of 4, the last all right: A = 0, no pass in the folded form
    rows = [r if r.group < 2 else TrainRow(r.prompt_token_ids, r.response_ids, 1.0, r.group, 0, True,
                                             r.old_seq_log_prob, r.old_token_log_probs) for r in rows]
    if per_byte:
        rows = [TrainRow(r.prompt_token_ids, r.response_ids, r.reward, r.group, 0, True,
                         r.old_seq_log_prob * len(r.response_ids) / (2 * len(r.response_ids)), r.old_token_log_probs,
                         norm_length=2.0 * len(r.response_ids)) for r in rows]
    first = _Learner(seed=2)  # the shadow: other weights, so the importance weights are not all 1, and an optimizer
    first.update(_own_rows(first), 0, [1.0])  # state (AdamW's first step is sign(g): a near-zero gradient's sign is
    other = first.weights()  # float noise, so two forms of one update agree only from the second step on)
    got = {}
    for fold in (True, False):
        learner.scoring_pass = not fold
        shadow = Shadow(tmp_path / str(fold), other, clip=2.0)
        m = shadow.train(learner, rows, 0, [1.0, 1.0])
        got[fold] = (shadow.saved[0], {**m, **shadow.cpu.take()})
    assert learner.trainer.one_step(len(rows)) and not learner.trainer.one_step(17)
    (fold, m_fold), (scored, m_scored) = got[True], got[False]
    assert m_fold["outcome/shadow_rows"] == 12 and m_scored["outcome/shadow_rows"] == 12
    assert m_fold["outcome/shadow_importance_mean"] != pytest.approx(1.0, abs=1e-3)
    assert "cpu/outcome_shadow_score" not in m_fold and "cpu/outcome_shadow_score" in m_scored  # no scoring pass
    assert all(torch.allclose(fold[n], p, atol=1e-6) for n, p in scored.items())
    assert any(not torch.equal(fold[n], p) for n, p in other[0].items())  # it trained


def test_reweigh_refuses_an_update_of_more_than_one_step():
    learner = _Learner()
    rows = _own_rows(learner, n=9)  # mini-batch 8: two steps, where the forward's scores are no longer the old ones
    with pytest.raises(ValueError, match="reweigh needs one optimizer step"):
        learner.update(rows, 0, [1.0], reweigh=lambda lbar, old: torch.ones_like(lbar))
