"""Arithmetic slices (issue 30, the expertise settings): drawing one slice's problems, the slice labels, and the
per-slice accuracy of an evaluation; without ``slices`` nothing changes."""

from __future__ import annotations

import pytest
import torch

from hacrl_fed.config import BuildError
from hacrl_fed.tasks import get_task
from hacrl_fed.tasks.arithmetic import is_test_problem
from hacrl_fed.tasks.slices import slice_labels, slice_metrics

SLICES = {"add": {"ops": "+"}, "sub": {"ops": "-"}, "mul": {"ops": "*", "max_operand": 9}}

# Worked answers of train ids 0..2 then test ids 0..2 at seed 3, recorded from the code before slices existed.
BEFORE = {
    (("difficulty", 2),): [
        "96+59=155,155+18=173 #### 173",
        "58+20=78,78-14=64 #### 64",
        "19+74=93,93+16=109 #### 109",
        "31+23=54,54+67=121 #### 121",
        "12-27=-15,-15+8=-7 #### -7",
        "96-10=86,86-84=2 #### 2",
    ],
    (("difficulty", 1), ("max_operand", 20), ("ops", "*")): [
        "8*10=80 #### 80",
        "14*5=70 #### 70",
        "4*18=72 #### 72",
        "2*0=0 #### 0",
        "14*17=238 #### 238",
        "0*2=0 #### 0",
    ],
}


@pytest.mark.parametrize("params", list(BEFORE))
def test_without_slices_the_problems_are_the_ones_drawn_before(params):
    task = get_task("arithmetic", dict(params), seed=3)
    got = [task.problem(split, i).worked for split in ("train", "test") for i in range(3)]
    assert got == BEFORE[params]
    assert [task.slice_label("test", i) for i in range(20)] == [None] * 20


def test_each_sliced_problem_is_drawn_from_its_own_slice_only():
    task = get_task("arithmetic", {"difficulty": 2, "slices": SLICES}, seed=1)
    seen = {}
    for split in ("train", "test"):
        for i in range(300):
            prob = task.problem(split, i)
            label = task.slice_label(split, i)
            assert label == prob.slice and label in SLICES
            ops = {s.split("=")[0].lstrip("-").strip("0123456789")[0] for s in prob.steps}
            assert ops == set(SLICES[label]["ops"]), (prob, label)
            if label == "mul":
                assert all(int(tok) <= 9 for tok in prob.expression.split("*"))
            assert is_test_problem(prob.expression) == (split == "test")
            seen[label] = seen.get(label, 0) + 1
    assert set(seen) == set(SLICES) and min(seen.values()) > 150  # uniform over the slices: ~200 each of 600


def test_a_slice_problem_is_the_plain_tasks_problem_so_the_partition_holds_across_both():
    plain = get_task("arithmetic", {"difficulty": 2, "ops": "+"}, seed=0)
    sliced = get_task("arithmetic", {"difficulty": 2, "slices": SLICES}, seed=0)
    add_test = {sliced.problem("test", i).expression for i in range(300) if sliced.slice_label("test", i) == "add"}
    plain_train = {plain.problem("train", i).expression for i in range(3000)}
    assert add_test and not add_test & plain_train  # an add-only SFT never trains on the mixed eval's add problems


@pytest.mark.parametrize(
    ("slices", "needle"),
    [
        ({"Add": {"ops": "+"}}, "slice names"),
        ({"add": {"ops": "/"}}, "characters from"),
        ({"add": {"ops": "+", "extra": 1}}, "extra"),
        ({}, "1..16 slices"),
        ({"mul": {"ops": "*", "max_operand": 1}}, "slices.mul"),
    ],
)
def test_bad_slices_are_rejected_naming_the_field(slices, needle):
    with pytest.raises(BuildError, match=needle):
        get_task("arithmetic", {"difficulty": 2, "slices": slices})


def test_slice_metrics_are_the_mean_reward_and_count_per_label():
    got = slice_metrics(["a", "b", None, "a", "b", "b"], [1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    assert got == {
        "slice/a/accuracy": 0.5,
        "slice/a/prompts": 2.0,
        "slice/b/accuracy": pytest.approx(2 / 3),
        "slice/b/prompts": 3.0,
    }
    assert slice_metrics([None, None], [1.0, 0.0]) == {}
    with pytest.raises(ValueError, match="one label per reward"):
        slice_metrics(["a"], [1.0, 0.0])


class _RewardsAddOnly:
    """The sliced task, except that an answer scores 1 exactly when its reference is an ``add`` test answer."""

    def __init__(self, task, add_refs):
        self.task, self.add_refs = task, add_refs

    def __getattr__(self, name):
        return getattr(self.task, name)

    def verify(self, response, reference):
        return 1.0 if reference in self.add_refs else 0.0


def _tiny_model():
    from transformers import AutoModelForCausalLM

    from hacrl_fed.models.catalog import MICRO_QWEN_ARCH, MICRO_SFT, ZooEntry
    from hacrl_fed.models.sft import SFTRecipe
    from hacrl_fed.models.tokenizers import build_tokenizer
    from hacrl_fed.models.zoo import build_config

    entry = ZooEntry("t", "qwen3", dict(MICRO_QWEN_ARCH), "char", SFTRecipe(**MICRO_SFT))
    tok = build_tokenizer("char", [], 400)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config(entry, tok)), tok


def test_evaluate_reports_accuracy_per_slice_and_unchanged_keys_without_slices():
    from hacrl_fed.evaluate import EvalSettings, evaluate

    model, tok = _tiny_model()
    settings = EvalSettings(n=24, k=2, max_new_tokens=4)
    plain = evaluate(model, tok, get_task("arithmetic", {"difficulty": 2}), settings)
    assert set(plain) == {"eval/prompts", "eval/samples", "eval/accuracy", "eval/pass@1", "eval/pass@2",
                          "eval/mean_reward@2"}  # fmt: skip
    sliced = get_task("arithmetic", {"difficulty": 2, "slices": SLICES})
    prompts = sliced.prompts("test", range(24))
    labels = slice_labels(sliced, "test", range(24))
    add_refs = {p.reference for p, lab in zip(prompts, labels) if lab == "add"}
    got = evaluate(model, tok, _RewardsAddOnly(sliced, add_refs), settings)
    for name in SLICES:
        mine = [p.reference in add_refs for p, lab in zip(prompts, labels) if lab == name]
        assert got[f"eval/slice/{name}/prompts"] == len(mine) > 0
        assert got[f"eval/slice/{name}/accuracy"] == pytest.approx(sum(mine) / len(mine))
    assert got["eval/slice/add/accuracy"] == 1.0
    assert got["eval/accuracy"] == pytest.approx(sum(p.reference in add_refs for p in prompts) / 24)


def test_a_federated_evaluation_reports_each_orgs_accuracy_per_slice(tmp_path):
    from hacrl_fed.config import load_config
    from hacrl_fed.coordinator import Coordinator
    from hacrl_fed.coordinator.inprocess import InProcessTransport
    from hacrl_fed.metrics import RunLogger, read_metrics
    from hacrl_fed.worker import build_worker

    cfg = load_config({
        "name": "slices", "seed": 0, "orgs": [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}],
        "algorithm": {"name": "gspo"}, "trainer": {"lr": 1e-3, "minibatch_size": 8, "micro_batch_size": 8},
        "generation": {"num_samples": 2, "max_new_tokens": 8, "eval_max_new_tokens": 16},
        "task": {"name": "arithmetic", "params": {"difficulty": 2, "slices": SLICES}, "eval_size": 12},
        "federation": {"rounds": 1, "prompts_per_round": 4, "eval_every": 1, "min_orgs": 1},
    })  # fmt: skip
    workers = {o.id: build_worker(cfg, o.id, run_dir=tmp_path) for o in cfg.orgs}
    with RunLogger(tmp_path, tensorboard=False) as logger:
        Coordinator(cfg, InProcessTransport(workers), tmp_path, logger=logger).run()
    records = read_metrics(tmp_path)
    assert [r["round"] for r in records] == [0, 1]  # the evaluation before round 1 and after it
    for rec in records:
        counts = {s: rec[f"eval/acme/slice/{s}/prompts"] for s in SLICES}
        assert sum(counts.values()) == 12 and min(counts.values()) > 0
        total = sum(rec[f"eval/acme/slice/{s}/accuracy"] * n for s, n in counts.items())
        assert total / 12 == pytest.approx(rec["eval/acme/accuracy"])


def test_slice_weights_draw_in_proportion_and_equal_weights_keep_the_uniform_draw():
    uniform = get_task("arithmetic", {"difficulty": 2, "slices": SLICES}, seed=1)
    equal = get_task("arithmetic", {"difficulty": 2, "slices": {n: {**s, "weight": 3.0} for n, s in SLICES.items()}}, seed=1)
    assert [equal.problem("train", i) for i in range(200)] == [uniform.problem("train", i) for i in range(200)]
    weighted = {n: {**s, "weight": 6.0 if n == "sub" else 1.0} for n, s in SLICES.items()}
    task = get_task("arithmetic", {"difficulty": 2, "slices": weighted}, seed=1)
    labels = [task.slice_label("train", i) for i in range(2000)]
    share = {n: labels.count(n) / len(labels) for n in SLICES}
    assert abs(share["sub"] - 0.75) < 0.04 and min(share["add"], share["mul"]) > 0.09  # 6:1:1 -> 0.75, 0.125 each
    with pytest.raises(BuildError, match="weight"):
        get_task("arithmetic", {"difficulty": 2, "slices": {"add": {"ops": "+", "weight": 0}}})
