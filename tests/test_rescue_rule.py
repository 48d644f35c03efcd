"""Selection rule ``rescue`` (hacrl_fed/algorithm/rescue.py): a peer's success only on a prompt the learner failed.
Hand-made pools; the generic rule tests (tests/test_selection.py) cover it through the registry as well."""

from hacrl_fed.algorithm.rescue import failed_prompts
from hacrl_fed.algorithm.selection import RULES, select_rows
from hacrl_fed.config import load_config, org_trainer

# idx: (reward, prompt, source, sample)
POOL = [
    (1.0, 1, "b", 0),  # 0  prompt 1: the learner has a success there
    (0.0, 1, "c", 0),  # 1
    (1.0, 2, "b", 0),  # 2  prompt 2: the learner solved it
    (1.0, 3, "b", 0),  # 3  prompt 3: the learner failed every row
    (0.5, 3, "c", 0),  # 4  a partial reward counts as a success (> 0)
    (0.0, 3, "c", 1),  # 5
    (1.0, 5, "c", 0),  # 6  prompt 5: no own rows (counts as failed)
]
OWN = {1: [1.0, 0.0, 0.0], 2: [1.0, 1.0], 3: [0.0, 0.0, 0.0]}


def pick(rule, budget=None, seed=0, pool=POOL, own=OWN):
    r, p, s, j = (list(c) for c in zip(*pool))
    return select_rows(r, p, s, j, own, rule, budget, seed)


def test_rescue_is_registered_and_accepted_by_the_config():
    assert "rescue" in RULES
    orgs = [{"id": "a", "model": {"zoo": "micro-qwen-char"}}, {"id": "b", "model": {"zoo": "micro-qwen-char"}}]
    orgs[0]["trainer"] = {"selection": {"rule": "rescue"}}  # every org keeps its own rule
    cfg = load_config({"name": "x", "orgs": orgs})
    assert [org_trainer(cfg, o).selection.rule for o in ("a", "b")] == ["rescue", "successes"]


def test_rescue_keeps_successes_on_failed_prompts_only():
    assert failed_prompts(OWN, [1, 2, 3, 5]) == {3, 5}
    sel = pick("rescue")
    assert sel.eligible == sel.selected == (3, 4, 6)
    assert pick("successes").selected == (0, 2, 3, 4, 6)  # the default takes prompts 1 and 2 too


def test_rescue_equals_successes_when_the_learner_failed_every_prompt():
    own = {p: [0.0, 0.0] for p in (1, 2, 3, 5)}
    for budget in (None, 2):
        assert pick("rescue", budget=budget, own=own) == pick("successes", budget=budget, own=own)


def test_rescue_budget_is_a_seeded_sample_of_the_eligible():
    picks = {pick("rescue", budget=1, seed=s).selected for s in range(20)}
    assert picks == {(3,), (4,), (6,)}
    assert pick("rescue", budget=2, seed=3) == pick("rescue", budget=2, seed=3)
