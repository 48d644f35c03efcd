"""The one door for foreign rows (hacrl_fed/worker/intake.py): one ledger accounts for every foreign row a
learner receives (``received == kept + sum of drops`` per source, on a request built to hit every drop reason of
every stage), and an algorithm without cross rows screens (trust counters) but never re-tokenizes foreign text."""

from __future__ import annotations

import dataclasses

import pytest

from hacrl_fed.config import load_config
from hacrl_fed.trainer import TrainRow
from hacrl_fed.types import ChatMessage, Prompt, Rollout, RolloutBatch, TrainRequest
from hacrl_fed.worker import intake
from hacrl_fed.worker.identity_border import IdentityBorder
from hacrl_fed.worker.intake import Intake, OwnRound, Scoring
from tests.helpers_tiny import tiny_char_tokenizer

G, MAX_NEW, ROUND, CONTEXT = 2, 16, 3, 60
FRESH = b"f" * 32  # the digest of the learner's own plan this round: source batches must sign it
PROMPTS = tuple(Prompt(pid, (ChatMessage("user", f"{pid}+0"),), str(pid)) for pid in (10, 20))
SOURCES = ["good", "zero", "odd", "long", "empty", "forger", "stale", "liar", "messy", "dup"]
# every drop reason each source is built to hit (stage, reason); "coordinator" sends loose unsigned rollouts
EXPECTED = {
    "coordinator": {("trust", "unsigned")},
    "zero": {("select", "dropped_rule")},
    "odd": {("screen", "low_likelihood")},
    "long": {("train", "context")},
    "empty": {("train", "no_tokens"), ("train", "too_long_text")},
    "forger": {("trust", "bad_signature")},
    "stale": {("trust", "stale_plan")},
    "liar": {("trust", "reward_mismatch"), ("trust", "source_excluded")},
    "messy": {
        ("trust", "duplicate"),
        ("trust", "unknown_prompt"),
        ("trust", "response_too_long"),
        ("trust", "incomplete_group"),
    },
    "dup": {("trust", "duplicate_source")},
}


def make_cfg(algorithm="hacpo", **selection):
    """Rule successes without a budget unless ``selection`` says otherwise: the request is built for every row to
    reach the stage whose drop it hits (the default budget, 0.5x the learner's 4 own rows, would leave all but 2 at
    the selection). "silent" sends nothing this round, so dup's second batch is not one batch more than there are
    orgs."""
    orgs = [{"id": o, "model": {"zoo": "micro-qwen-char"}} for o in ["me", *SOURCES, "silent"]]
    return load_config({
        "name": "intake", "seed": 0, "orgs": orgs, "algorithm": {"name": algorithm},
        "generation": {"num_samples": G, "max_new_tokens": MAX_NEW, "eval_max_new_tokens": MAX_NEW},
        "task": {"name": "arithmetic", "params": {"difficulty": 1}, "eval_size": 4},
        "federation": {"prompts_per_round": len(PROMPTS)},
        "security": {"signing": True, "max_bytes_per_token": 8},
        "trainer": {"selection": selection or {"rule": "successes", "budget_multiple": None}},
    })


class Task:
    """The learner's verifier: a text holding "wrong" is wrong, anything else right."""

    name = "arithmetic"

    @staticmethod
    def verify(text: str, reference: str) -> float:
        return 0.0 if "wrong" in text else 1.0


def rollout(src, pid, j, text="ok", reward=1.0, finish="stop"):
    return Rollout(src, ROUND, pid, j, text, finish, reward, -0.5 * 4, 4)


def rollouts_of(src):
    """``src``'s rollouts, built to hit its reasons in EXPECTED."""
    honest = [rollout(src, p.prompt_id, j) for p in PROMPTS for j in range(G)]
    if src == "zero":
        return [rollout(src, p.prompt_id, j, "wrong", 0.0) for p in PROMPTS for j in range(G)]
    if src == "long":  # 80 tokens + EOS: more than the context allows after the prompt, within every other bound
        return [rollout(src, 10, j) for j in range(G)] + [rollout(src, 20, j, "1" * 80) for j in range(G)]
    if src == "empty":  # 129 learner tokens with EOS (more than 8 x 16), and no tokens (no text, no EOS)
        return [rollout(src, 10, j, "1" * 128) for j in range(G)] + [
            rollout(src, 20, j, "", finish="length") for j in range(G)
        ]
    if src == "liar":  # claims 1.0 on wrong text for prompt 10: half its claims are contradicted (> 10 %)
        return [rollout(src, 10, j, "wrong") for j in range(G)] + [rollout(src, 20, j) for j in range(G)]
    if src == "messy":  # a duplicate spoils prompt 10's group, 200 bytes > 16 tokens x 8 bytes, prompt 99 unknown
        return [rollout(src, 10, 0), rollout(src, 10, 0), rollout(src, 20, 0, "1" * 200), rollout(src, 99, 0)]
    if src == "dup":  # sent twice (see signed_batches): 40 foreign rows in all, the most an honest round holds
        return [rollout(src, 10, j) for j in range(G)]
    return honest


def signed_batches(cfg, run_dir):
    out = []
    for src in SOURCES:
        digest = b"s" * 32 if src == "stale" else FRESH
        batch = RolloutBatch("run", ROUND, src, tuple(rollouts_of(src)), 1.0, plan_digest=digest)
        batch = IdentityBorder(cfg, src, run_dir).publish(batch, MAX_NEW * 8)
        if src == "forger":  # changed after signing
            batch = dataclasses.replace(batch, accuracy=0.5)
        out.append(batch)
        if src == "dup":
            out.append(batch)
    return out


def own_round(tok):
    ids = {p.prompt_id: tok(p.messages[0].content, add_special_tokens=False)["input_ids"] for p in PROMPTS}
    rows = [
        TrainRow(list(ids[p.prompt_id]), [7, 8, 9, 10], float(j % 2), p.prompt_id, 0, True, -0.5, [-0.5] * 4,
                 n_bytes=4)
        for p in PROMPTS for j in range(G)
    ]
    return OwnRound("run", ROUND, "arithmetic", PROMPTS, MAX_NEW, ids, rows, FRESH)


def admit(cfg, run_dir, tok, door_cfg=None):
    """Admit the request of every source through ``me``'s intake (its config ``door_cfg``, else ``cfg``); the
    scorer gives ``odd``'s rows an unlikely log-prob and every other row -0.5 per token (as the sources claim)."""
    batches = signed_batches(cfg, run_dir)
    cfg = door_cfg or cfg
    border = IdentityBorder(cfg, "me", run_dir)
    algo = cfg.algorithm.name
    door = Intake(cfg, "me", selection=cfg.trainer.selection, screen=cfg.trainer.likelihood_screen,
                  uses_cross=algo in ("hacpo", "naive"), task=Task(), tokenizer=tok, eos_id=tok.eos_token_id)
    loose = tuple(rollout("good", 10, j) for j in range(G))
    request = TrainRequest("run", ROUND, "me", PROMPTS, loose, {}, source_batches=tuple(batches))
    own = own_round(tok)
    names = sorted({"me", *SOURCES} - {"forger", "stale", "liar", "messy"})  # the agents: screened sources

    def score(rows):
        return [-1000.0 if names[r.source] == "odd" else -0.5 * len(r.response_ids) for r in rows]

    admitted = door.admit(request, own, seed=1, opener=border.opener("run", ROUND, FRESH),
                          scoring=Scoring(score, CONTEXT, {}))
    return request, admitted


def test_every_foreign_row_is_kept_or_dropped_once_with_its_reason(tmp_path):
    cfg, tok = make_cfg(), tiny_char_tokenizer()
    request, admitted = admit(cfg, tmp_path, tok)
    ledger = admitted.ledger
    balance = ledger.balance()
    for src, (received, kept, dropped) in balance.items():
        assert received == kept + dropped, (src, ledger.sources[src].dropped)
    for src, reasons in EXPECTED.items():
        assert reasons <= set(ledger.sources[src].dropped), (src, ledger.sources[src].dropped)
    assert balance["good"] == (4, 4, 0)  # its loose copies count under "coordinator"
    assert sum(r for r, _, _ in balance.values()) == admitted.metrics(request)["train/foreign_received"]
    kept = [r for r in admitted.rows if not r.is_self and r.response_ids]
    assert sum(k for _, k, _ in balance.values()) == len(kept)
    # the metrics of the four prefixes say the same
    m = {**admitted.metrics(request), **admitted.update_metrics({})}
    assert m["trust/forger/rejected/bad_signature"] == 4 and m["trust/stale/rejected/stale_plan"] == 4
    assert m["trust/coordinator/rejected/unsigned"] == 2 and m["trust/coordinator/received"] == 0
    assert m["trust/dup/rejected/duplicate_source"] == 2 and m["trust/liar/excluded"] == 1
    assert m["select/zero/dropped_rule"] == 4 and m["screen/odd/dropped_low_likelihood"] == 4
    assert m["train/num_too_long"] == 2 and m["train/foreign_unscored"] == 4


def test_under_the_default_budget_the_ledger_balances_and_a_silent_org_has_no_share(tmp_path):
    cfg, tok = make_cfg(rule="successes"), tiny_char_tokenizer()  # the default budget: 0.5x own rows, per source
    assert (cfg.trainer.selection.budget_multiple, cfg.trainer.selection.budget_split) == (0.5, "per_source")
    request, admitted = admit(cfg, tmp_path, tok)
    for src, (received, kept, dropped) in admitted.ledger.balance().items():
        assert received == kept + dropped, src
    m = admitted.metrics(request)
    shares = {k.split("/")[1]: v for k, v in m.items() if k.startswith("select/") and k.endswith("/share")}
    # 4 own rows (2 prompts x G=2): a budget of 2, one row each for two of the sources with successes (good, odd,
    # long, empty, dup, messy: more sources than rows, so every level-0 share but the seeded remainder)
    assert m["select/budget"] == 2 and sum(shares.values()) == 2 and max(shares.values()) == 1
    assert "silent" not in shares and "zero" in shares and shares["zero"] == 0  # no rows; no successes
    assert m["select/selected"] == 2 and all(m.get(f"select/{s}/over_share", 0) == 0 for s in shares)


def test_the_ledger_balances_when_the_request_is_too_large_or_screened_lazily(tmp_path):
    tok = tiny_char_tokenizer()
    cfg = make_cfg(rule="peer_sample", budget=4)  # one source's worth: the rest are never opened
    _, admitted = admit(cfg, tmp_path, tok)
    unscreened = {s for s, e in admitted.ledger.sources.items() if ("trust", "unscreened") in e.dropped}
    assert len(unscreened) >= 5
    for src, (received, kept, dropped) in admitted.ledger.balance().items():
        assert received == kept + dropped, src
    small = cfg.model_copy(update={"orgs": cfg.orgs[:3]})  # me, good, zero: eleven batches are too many
    _, admitted = admit(cfg, tmp_path, tok, door_cfg=small)
    assert admitted.ledger.balance() == {"*": (40, 0, 40)}


@pytest.mark.parametrize("algorithm", ["gspo", "hacpo"])
def test_without_cross_rows_the_intake_screens_but_never_retokenizes(tmp_path, monkeypatch, algorithm):
    calls: list[list[str]] = []
    real = intake.response_token_ids

    def spy(tokenizer, texts, *args, **kwargs):
        calls.append(list(texts))
        return real(tokenizer, texts, *args, **kwargs)

    monkeypatch.setattr(intake, "response_token_ids", spy)
    cfg, tok = make_cfg(algorithm), tiny_char_tokenizer()
    request, admitted = admit(cfg, tmp_path, tok)
    m = admitted.metrics(request)
    assert m["trust/good/accepted"] == 4 and m["trust/liar/excluded"] == 1  # the trust counters stay
    assert m["trust/forger/rejected/bad_signature"] == 4
    if algorithm == "gspo":
        assert calls == [] and all(r.is_self for r in admitted.rows)
        assert not any(k.startswith("select/") for k in m)
        assert admitted.ledger.sources["good"].dropped[("unused", "no_cross_rows")] == 4
    else:
        assert calls and any(not r.is_self for r in admitted.rows)
    for src, (received, kept, dropped) in admitted.ledger.balance().items():
        assert received == kept + dropped, src


@pytest.mark.parametrize("algorithm", ["gspo", "hacpo"])
def test_a_worker_without_cross_rows_writes_trust_counters_and_retokenizes_no_foreign_text(
    tmp_path, monkeypatch, algorithm
):
    from hacrl_fed.worker import build_worker
    from tests.test_worker import make_cfg as worker_cfg
    from tests.test_worker import plan_for

    calls: list[list[str]] = []
    real = intake.response_token_ids
    monkeypatch.setattr(intake, "response_token_ids", lambda tok, texts, *a, **k: calls.append(list(texts))
                        or real(tok, texts, *a, **k))
    cfg = worker_cfg(algorithm)
    a, b = build_worker(cfg, "char", run_dir=tmp_path), build_worker(cfg, "bpe", run_dir=tmp_path)
    plan = plan_for(a, 1)
    a.generate(plan)
    report = a.train(TrainRequest("run", 1, "char", plan.prompts, b.generate(plan).rollouts, {}))
    m = report.metrics
    assert m["trust/bpe/received"] == m["trust/bpe/accepted"] == 16 and m["trust/foreign_rejected"] == 0
    assert (calls == []) == (algorithm == "gspo") and m["train/num_self"] == 16
    assert m.get("train/num_cross", 0.0) == (0.0 if algorithm == "gspo" else m["select/selected"])


def test_every_foreign_row_the_screen_keeps_carries_its_score_for_the_update(tmp_path):
    """The likelihood screen's score of a kept cross row (the learner's pre-update log-prob sum) travels on the row
    as ``pre_log_prob_sum``, so the in-band baseline uses it instead of scoring it again; own
    rows carry none."""
    cfg, tok = make_cfg(), tiny_char_tokenizer()
    assert cfg.trainer.likelihood_screen.enabled
    _, admitted = admit(cfg, tmp_path, tok)
    cross = [r for r in admitted.rows if not r.is_self and r.response_ids]
    assert cross and all(r.pre_log_prob_sum == -0.5 * len(r.response_ids) for r in cross)  # the test's scorer
    assert all(r.pre_log_prob_sum is None for r in admitted.rows if r.is_self)
