"""The learner's likelihood screen of foreign rows (hacrl_fed/algorithm/likelihood_screen.py, the trainer's hook,
the coordinator's exclusion): hand-computed cases, the reduction to today's update, and the doctored-text attack
(a member org with a valid key inserts a fixed string into every response, answers kept correct) with honest and
with lying log-probs, over a short in-process run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hacrl_fed.algorithm.likelihood_screen import GapHistory, ScreenParams, likelihood_screen
from hacrl_fed.config import AlgorithmConfig, LikelihoodScreenConfig, TrainerConfig, load_config
from hacrl_fed.coordinator import Coordinator
from hacrl_fed.coordinator.inprocess import InProcessTransport
from hacrl_fed.coordinator.trust import PoolGuard
from hacrl_fed.scoring import build_scoring_batch_from_ids, response_token_ids, sequence_log_probs
from hacrl_fed.security.envelope import signed
from hacrl_fed.trainer import LocalTrainer, TrainRow
from hacrl_fed.types import TrainReport
from hacrl_fed.worker import build_worker
from hacrl_fed.worker.intake import Scoring, admit_rows, update_metrics
from hacrl_fed.worker.ledger import Ledger
from tests.helpers_tiny import tiny_char_tokenizer, tiny_model
from tests.test_security_attacks import ORGS, Hostile, key_of

P = ScreenParams(margin_nats=1.0, quantile=0.0, claim_z=4.0, claim_margin_nats=0.1, min_scale=0.05,
                 history_decay=0.5, min_rows=4)


# ------------------------------------------------------------------------------------------------ pure math


def test_low_likelihood_against_the_own_rows_of_the_same_prompt():
    # own rows of prompt 0: -1.0 and -1.2 per token (min -1.2, threshold -2.2); prompt 1: -0.5 (threshold -1.5)
    lp = [-10.0, -12.0, -5.0, -20.0, -25.0, -20.0]
    n = [10, 10, 10, 10, 10, 10]
    res = likelihood_screen(lp, n, [True, True, True, False, False, False], [0, 0, 1, 0, 0, 1], [0, 0, 0, 1, 1, 1],
                            [None] * 6, P)
    # -2.0 >= -2.2 kept; -2.5 < -2.2 dropped; -2.0 < -1.5 (prompt 1's own rows are likelier) dropped
    assert res.keep == [True, True, True, True, False, False]
    assert res.dropped == {1: {"low_likelihood": 2, "claim_outlier": 0}} and res.checked == {1: 3}
    assert res.deficit_max[1] == pytest.approx(1.5)  # -0.5 - (-2.0): the last row


def test_a_prompt_without_own_rows_uses_all_own_rows_and_no_own_rows_skips_the_test():
    res = likelihood_screen([-10.0, -12.0, -21.0], [10, 10, 10], [True, True, False], [0, 0, 7], [0, 0, 1],
                            [None] * 3, P)
    assert res.keep == [True, True, True]  # -2.1 >= pooled min -1.2 - 1
    res = likelihood_screen([-10.0, -12.0, -23.0], [10, 10, 10], [True, True, False], [0, 0, 7], [0, 0, 1],
                            [None] * 3, P)
    assert res.keep == [True, True, False]
    res = likelihood_screen([-99.0, -99.0], [1, 1], [False, False], [0, 0], [1, 1], [None, None], P)
    assert res.keep == [True, True] and res.dropped == {}


def test_all_honest_rows_drop_none():
    lp = [-10.0, -11.0, -12.0, -13.0, -14.0, -15.0, -16.0, -17.0]
    own = [True, True, False, False, False, False, False, False]
    claims = [None, None] + [(s + 3.0) / 10 for s in lp[2:]]  # the same gap +0.3 on every row
    res = likelihood_screen(lp, [10] * 8, own, [0] * 8, [0, 0, 1, 1, 1, 1, 1, 1], claims,
                            dataclasses.replace(P, margin_nats=1.0))
    assert all(res.keep) and res.dropped == {}
    assert res.history[1].center == pytest.approx(0.3) and res.history[1].scale == pytest.approx(0.0)


def test_per_byte_and_per_token_units_decide_differently():
    # own: -20 over 10 tokens / 40 bytes; foreign: -40 over 10 tokens / 100 bytes
    own_tok, own_byte = -2.0, -0.5
    foreign_tok, foreign_byte = -4.0, -0.4
    assert foreign_tok < own_tok - 1.0 and foreign_byte > own_byte - 1.0
    args = ([True, False], [0, 0], [0, 1], [None, None], P)
    assert likelihood_screen([-20.0, -40.0], [10, 10], *args).keep == [True, False]  # per token: dropped
    assert likelihood_screen([-20.0, -40.0], [40, 100], *args).keep == [True, True]  # per byte: kept


def test_a_claim_out_of_line_with_the_sources_other_claims_is_dropped():
    # six rows of source 1, learner -1.0 per token each; claims -0.5 (gap +0.5) except the last, which claims
    # the learner's own -1.0 (gap 0): median 0.5, MAD 0 -> scale floor 0.05, bound 4 * 0.05 + 0.1 = 0.3 < 0.5
    lp = [-8.0] + [-10.0] * 6
    claims = [None] + [-0.5] * 5 + [-1.0]
    res = likelihood_screen(lp, [10] * 7, [True] + [False] * 6, [0] * 7, [0] + [1] * 6, claims, P)
    assert res.keep == [True] * 6 + [False]
    assert res.dropped[1] == {"low_likelihood": 0, "claim_outlier": 1}
    assert res.history[1] == GapHistory(0.5, 0.0, 1)


def test_a_source_that_starts_lying_is_caught_against_its_history_and_the_history_moves_slowly():
    history = {1: GapHistory(0.5, 0.05, 3)}
    lp = [-8.0] + [-10.0] * 4
    lying = [None] + [-1.0] * 4  # every row claims what the learner gives it: gap 0 (this round's median too)
    res = likelihood_screen(lp, [10] * 5, [True] + [False] * 4, [0] * 5, [0] + [1] * 4, lying, P, history)
    assert res.keep == [True, False, False, False, False] and res.history[1] == history[1]  # nothing kept: unchanged
    honest = [None] + [-0.45] * 4  # gap 0.55, within the bound: kept, history EMA'd (decay 0.5)
    res = likelihood_screen(lp, [10] * 5, [True] + [False] * 4, [0] * 5, [0] + [1] * 4, honest, P, history)
    assert all(res.keep)
    assert res.history[1].center == pytest.approx(0.525) and res.history[1].scale == pytest.approx(0.025)
    assert res.history[1].rounds == 4 and history[1].center == 0.5  # the input is not modified


def test_too_few_rows_and_no_history_skip_the_claim_test():
    res = likelihood_screen([-8.0, -10.0, -10.0], [10] * 3, [True, False, False], [0] * 3, [0, 1, 1],
                            [None, -0.5, -1.0], P)
    assert all(res.keep) and 1 not in res.history


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="sources has 1 rows"):
        likelihood_screen([-1.0, -2.0], [1, 1], [True, False], [0, 0], [0], [None, None], P)


# ------------------------------------------------------------------------------------ the trainer's hook


def _rows(seed=0, foreign=True):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(12):
        is_self = (not foreign) or i % 2 == 0
        resp = torch.randint(5, 20, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        prompt = torch.randint(5, 20, (3,), generator=g).tolist()
        rows.append(TrainRow(prompt, resp, float(i % 3 == 0), i % 3, 0 if is_self else 1, is_self, -2.5,
                             [-2.5] * len(resp) if is_self else None, n_bytes=len(resp),
                             claimed_log_prob_sum=None if is_self else -2.0 * len(resp),
                             claimed_token_count=len(resp)))
    return rows


def _update(rows, screen: LikelihoodScreenConfig):
    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=1)
    trainer = LocalTrainer(model, AlgorithmConfig(name="hacpo"),
                           TrainerConfig(lr=1e-2, minibatch_size=6, micro_batch_size=4, likelihood_screen=screen),
                           tok.pad_token_id)
    names, ledger = ["acme", "globex"], Ledger()  # the intake's last two stages, then the update
    rows = admit_rows(rows, names, Scoring.of(trainer), screen, ledger)
    metrics = update_metrics(trainer.update(rows, 0, [0.5, 0.5], names=names), rows, ledger)
    return [p.detach().clone() for p in model.parameters()], metrics, trainer


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_screen_off_no_foreign_rows_or_nothing_dropped_is_bit_identical_to_today():
    off = LikelihoodScreenConfig(enabled=False)
    wide = LikelihoodScreenConfig(enabled=True, margin_nats=1e6, claim_z=1e9)  # bound >= 1e9 x 0.05 nats
    w_off, m_off, _ = _update(_rows(), off)
    w_on, m_on, _ = _update(_rows(), wide)
    assert _same(w_off, w_on) and m_on["screen/dropped"] == 0.0 and m_on["screen/globex/checked"] == 6.0
    assert not any(k.startswith("screen/") for k in m_off)
    w_self_off, _, _ = _update(_rows(foreign=False), off)
    w_self_on, m_self_on, _ = _update(_rows(foreign=False), LikelihoodScreenConfig(enabled=True))
    assert _same(w_self_off, w_self_on) and not any(k.startswith("screen/") for k in m_self_on)


def test_dropped_rows_leave_their_joint_group_and_the_history_is_kept_in_the_trainer_state():
    # own rows -2.5 per token, the cross rows -6.2 ... -7.7 under the tiny model: 4.5 drops two of six (the rows'
    # n_bytes is their token count: per byte is per token here)
    tight = LikelihoodScreenConfig(enabled=True, margin_nats=4.5)
    w, m, trainer = _update(_rows(), tight)
    n_dropped = int(m["screen/dropped"])
    assert n_dropped == 2 and m["screen/globex/dropped_low_likelihood"] == n_dropped
    assert m["train/num_cross"] == 6 - n_dropped
    # the same update as a learner that never received the dropped rows (nor counted them in any baseline)
    kept_rows = _rows()
    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=1)
    ref = LocalTrainer(model, AlgorithmConfig(name="hacpo"),
                       TrainerConfig(lr=1e-2, minibatch_size=6, micro_batch_size=4), tok.pad_token_id)
    dropped = _dropped_indices(kept_rows, tight)
    assert len(dropped) == n_dropped
    ref.update([r for i, r in enumerate(kept_rows) if i not in dropped], 0, [0.5, 0.5], names=["acme", "globex"])
    assert _same(w, [p.detach() for p in model.parameters()])
    state = trainer.state_dict()
    fresh = _update(_rows(), LikelihoodScreenConfig(enabled=False))[2]
    fresh.load_state_dict(state)
    assert fresh.screen_history == trainer.screen_history


def _dropped_indices(rows, cfg):
    """The rows the screen drops, recomputed from the pure function with the model's own scores."""
    tok = tiny_char_tokenizer()
    model = tiny_model("qwen3", tok, seed=1)
    cross = [i for i, r in enumerate(rows) if not r.is_self]
    batch = build_scoring_batch_from_ids([rows[i].prompt_token_ids for i in cross],
                                         [rows[i].response_ids for i in cross], tok.pad_token_id)
    sums = dict(zip(cross, sequence_log_probs(model, batch, 4)[0].tolist()))
    lp = [sum(r.old_token_log_probs) if r.is_self else sums[i] for i, r in enumerate(rows)]
    res = likelihood_screen(lp, [len(r.response_ids) for r in rows], [r.is_self for r in rows],
                            [r.group for r in rows], [r.source for r in rows],
                            [None if r.is_self else r.claimed_log_prob_sum / r.claimed_token_count for r in rows],
                            ScreenParams(margin_nats=cfg.margin_nats, claim_z=cfg.claim_z))
    return {i for i, k in enumerate(res.keep) if not k}


# --------------------------------------------------------------------------------- the doctored-text attack

STRING = "Hail to the thief! "
MARGIN = 2.0  # nats per byte: the micro models are far flatter than the bench agents (calibrated at 4)


def _cfg(rounds=2, rule: str | None = "all", **security):
    """The screen on (the default) at the micro models' margin. Rule all here: the micro models rarely answer
    right, so under the project's default rule (successes) few of an attacker's own doctored responses would reach
    the screen; ``rule=None`` keeps the project's default (test_..._under_the_defaults doctors correct answers)."""
    selection = {} if rule is None else {"rule": rule}
    return load_config({
        "name": "doctored", "seed": 0, "orgs": ORGS, "algorithm": {"name": "hacpo"},
        "trainer": {"lr": 1e-3, "minibatch_size": 64, "micro_batch_size": 32, "selection": selection,
                    "likelihood_screen": {"margin_nats": MARGIN}},
        "generation": {"num_samples": 4, "max_new_tokens": 16, "eval_max_new_tokens": 16},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
        "federation": {"rounds": rounds, "prompts_per_round": 4, "eval_every": 0, "min_orgs": 1},
        "security": security,
    })


def _score(worker, prompts, texts):
    tok = worker.tokenizer
    p_ids = tok([worker.prompts.render(p) for p in prompts], add_special_tokens=False)["input_ids"]
    r_ids = response_token_ids(tok, texts, ["length"] * len(texts), eos_token_id=None)
    sums, counts, _ = sequence_log_probs(worker.model, build_scoring_batch_from_ids(p_ids, r_ids, worker.pad_id), 32)
    return sums.tolist(), counts.tolist()


def doctor(attacker, victim, run_dir, lying: bool, correct: bool = False):
    """globex inserts STRING into every response (answers stay correct, rewards stay true) and signs with its valid
    key; its claimed log-probs are its own model's of the doctored text, or (``lying``) the victim's own per-token
    mean times its token count, the claim that puts HACPO's cross ratio at 1 for the victim. ``correct``: every
    response is STRING and the right answer (reward 1, true under every receiver's verifier)."""

    def attack(batch):
        prompts = {p.prompt_id: p for p in attacker._own.prompts}
        ps = [prompts[r.prompt_id] for r in batch.rollouts]
        if correct:
            texts = [f"{STRING}#### {p.reference}" for p in ps]
            batch = dataclasses.replace(batch, rollouts=tuple(dataclasses.replace(r, reward=1.0)
                                                              for r in batch.rollouts))
        else:
            texts = [STRING + r.response for r in batch.rollouts]
        sums, counts = _score(attacker, ps, texts)
        if lying:
            v_sums, v_counts = _score(victim, ps, texts)
            sums = [s / max(c, 1) * n for s, c, n in zip(v_sums, v_counts, counts)]
        counts_c = [min(n, 16) for n in counts]
        rollouts = tuple(dataclasses.replace(r, response=t, logprob_sum=min(s / max(n, 1) * c, 0.0), token_count=c)
                         for r, t, s, n, c in zip(batch.rollouts, texts, sums, counts, counts_c))
        return signed(dataclasses.replace(batch, rollouts=rollouts, signature=b""), key_of(run_dir, batch.org_id))

    return attack


@pytest.mark.parametrize("lying", [False, True], ids=["honest_logprobs", "lying_logprobs"])
def test_doctored_rows_are_dropped_and_counted_against_the_attacker(tmp_path, lying):
    run_dir = tmp_path / "run"
    cfg = _cfg(rounds=2)
    acme = build_worker(cfg, "acme", run_dir=run_dir)
    globex_worker = build_worker(cfg, "globex", run_dir=run_dir)
    globex = Hostile(globex_worker, doctor(globex_worker, acme, run_dir, lying))
    coord = Coordinator(cfg, InProcessTransport({"acme": acme, "globex": globex}), run_dir)
    for t in (1, 2):
        m = coord.run_round(t).metrics
        checked = m["acme/screen/globex/checked"]
        assert checked == 16 and m.get("round/globex/rejected/reward_mismatch", 0.0) == 0  # answers all correct
        dropped = m["acme/screen/globex/dropped_low_likelihood"] + m["acme/screen/globex/dropped_claim_outlier"]
        # the micro models are flat, so a few doctored rows pass (the bench agents drop every one: BENCHMARKS.md)
        assert dropped >= 0.75 * checked and m["acme/train/num_cross"] == checked - dropped
        assert m["globex/screen/acme/checked"] == 16  # the honest source's rows are not
        assert m["globex/screen/acme/dropped_low_likelihood"] + m["globex/screen/acme/dropped_claim_outlier"] == 0
        assert m["globex/train/num_cross"] == 16
    assert "globex" not in coord.guard.excluded  # security.max_screen_drop_rate: 1 (the default) never excludes


@pytest.mark.parametrize("lying", [False, True], ids=["honest_logprobs", "lying_logprobs"])
def test_doctored_correct_answers_are_dropped_under_the_defaults(tmp_path, lying):
    """The project's defaults (successes, a budget of 0.5x own rows per source, the screen on, per byte; the
    margin set for the flat micro models) against an attacker whose every response is right: the doctored rows the
    rule selects fill the attacker's share of the budget (its only source: the whole budget), and the screen leaves
    them out."""
    run_dir = tmp_path / "run"
    cfg = _cfg(rule=None)
    sel = cfg.trainer.selection
    assert (sel.rule, sel.budget, sel.budget_multiple, sel.budget_split) == ("successes", None, 0.5, "per_source")
    # the joint baseline: under in_band (the default) the micro agents' out-of-band foreign rows leave acme's own
    # uniform groups without gradient, and the last line checks acme still trains on its own rows
    cfg.algorithm.baseline_rows = "joint"
    assert cfg.trainer.likelihood_screen.enabled and cfg.algorithm.logprob_norm == "per_byte"
    acme = build_worker(cfg, "acme", run_dir=run_dir)
    globex_worker = build_worker(cfg, "globex", run_dir=run_dir)
    globex = Hostile(globex_worker, doctor(globex_worker, acme, run_dir, lying, correct=True))
    coord = Coordinator(cfg, InProcessTransport({"acme": acme, "globex": globex}), run_dir)
    before = [p.detach().clone() for p in acme.model.parameters()]
    for t in (1, 2):
        m = coord.run_round(t).metrics
        assert m["acme/trust/globex/accepted"] == 16 and m.get("round/globex/rejected/reward_mismatch", 0.0) == 0
        # all 16 doctored rows are verified successes; acme's own rows are 4 prompts x 4 samples = 16, so the
        # budget is floor(0.5 x 16) = 8, all of it globex's share (one source): 8 selected, 8 left by the budget
        assert m["acme/select/budget"] == 8 and m["acme/select/globex/share"] == 8
        assert m["acme/select/globex/selected"] == 8 and m["acme/select/globex/dropped_budget"] == 8
        checked = m["acme/screen/globex/checked"]
        dropped = m["acme/screen/globex/dropped_low_likelihood"] + m["acme/screen/globex/dropped_claim_outlier"]
        assert checked == 8 and dropped >= 0.75 * checked and m["acme/train/num_cross"] == checked - dropped
    assert not _same(before, [p.detach() for p in acme.model.parameters()])  # acme still trained on its own rows


def test_a_source_screened_out_persistently_is_excluded_past_the_rate(tmp_path):
    run_dir = tmp_path / "run"
    cfg = _cfg(rounds=2, max_screen_drop_rate=0.5, screen_min_rows=16)
    acme = build_worker(cfg, "acme", run_dir=run_dir)
    globex_worker = build_worker(cfg, "globex", run_dir=run_dir)
    globex = Hostile(globex_worker, doctor(globex_worker, acme, run_dir, lying=True))
    coord = Coordinator(cfg, InProcessTransport({"acme": acme, "globex": globex}), run_dir)
    first = coord.run_round(1)
    assert first.metrics["round/globex/screen_drop_rate"] >= 0.75 and first.metrics["round/acme/screen_drop_rate"] == 0
    assert "likelihood screens left out" in coord.guard.excluded["globex"]
    second = coord.run_round(2)
    assert second.failed == {"globex": "excluded"} and second.trained == ["acme"]
    assert "acme" not in coord.guard.excluded


def test_the_exclusion_is_the_median_over_receivers_after_enough_rows():
    cfg = _cfg(max_screen_drop_rate=0.5, screen_min_rows=10)
    guard = PoolGuard(cfg, None, lambda r, ref: 0.0)

    def report(org, **per_src):
        return TrainReport("run", 1, org, {k: v for src, (chk, drp) in per_src.items()
                                           for k, v in ((f"screen/{src}/checked", chk),
                                                        (f"screen/{src}/dropped_low_likelihood", drp))})

    m: dict[str, float] = {}
    guard.receiver_screened(1, {"a": report("a", c=(6, 6)), "b": report("b", c=(6, 0))}, ["c"], m)
    assert "round/c/screen_drop_rate" not in m  # neither receiver has screened 10 rows yet
    guard.receiver_screened(2, {"a": report("a", c=(6, 6)), "b": report("b", c=(6, 0))}, ["c"], m)
    assert m["round/c/screen_drop_rate"] == 0.5 and "c" not in guard.excluded  # median of 1.0 and 0.0
    guard.receiver_screened(3, {"a": report("a", c=(6, 6)), "b": report("b", c=(6, 6))}, ["c"], m)
    assert m["round/c/screen_drop_rate"] == pytest.approx(2 / 3) and "c" in guard.excluded  # 18/18, 6/18
    state = guard.state_dict()
    again = PoolGuard(cfg, None, lambda r, ref: 0.0)
    again.load_state_dict(state)
    assert again.screened == guard.screened and again.excluded == guard.excluded
