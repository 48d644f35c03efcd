"""Tasks and verifiers: registry, determinism, disjoint splits, answer extraction, sample JSONL files."""

from __future__ import annotations

import ast
import json
import operator
import signal
import sys
import threading
from pathlib import Path

import pytest

from hacrl_fed.config import BuildError
from hacrl_fed.tasks import TASKS, Task, get_task, register_task
from hacrl_fed.tasks.arithmetic import build_problem, extract_integer, is_test_problem
from hacrl_fed.tasks.base import last_boxed, number_strings, stable_hash
from hacrl_fed.tasks.jsonl_math import answers_match, extract_answer, too_costly
from hacrl_fed.tasks.reasoning_gym import extract_tagged_answer
from hacrl_fed.types import Prompt

DATA = Path(__file__).parent / "data"
GSM8K = str(DATA / "gsm8k_sample.jsonl")
MATH = str(DATA / "math_sample.jsonl")
MATH_PARAMS = {"path": MATH, "question_field": "problem", "answer_field": "solution"}


# ------------------------------------------------------------------------------------------------ registry


def test_registry_lists_builtin_tasks_and_rejects_unknown_names():
    assert {"arithmetic", "jsonl", "reasoning-gym"} <= set(TASKS)
    with pytest.raises(ValueError, match=r"task.name: unknown task 'nope'.*arithmetic.*jsonl.*reasoning-gym"):
        get_task("nope")


@pytest.mark.parametrize(
    "params, field",
    [
        ({"difficulty": 4}, "task.params.difficulty"),
        ({"difficulty": "hard"}, "task.params.difficulty"),
        ({"ops": "+/"}, "task.params.ops"),
        ({"ops": ""}, "task.params.ops"),
        ({"typo": 1}, "task.params.typo"),
        ({"test_size": 0}, "task.params.test_size"),
    ],
)
def test_bad_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        get_task("arithmetic", params)


def test_params_must_be_a_mapping():
    with pytest.raises(ValueError, match="task.params: must be a mapping"):
        get_task("arithmetic", ["difficulty", 1])  # type: ignore[arg-type]


def test_register_task_as_decorator_and_guards():
    @register_task("tmp-echo")
    class Echo(Task):
        def size(self, split):
            return 1

        def prompts(self, split, ids):
            return [Prompt(i, (), "x") for i in self.check_ids(split, ids)]

        def verify(self, response, reference):
            return float(response == reference)

    try:
        task = get_task("tmp-echo", seed=3)
        assert task.name == "tmp-echo" and task.seed == 3
        assert task.prompts("test", [0])[0].reference == "x"
        with pytest.raises(NotImplementedError):
            task.sft_target("train", 0)
        with pytest.raises(ValueError, match="already registered"):
            register_task("tmp-echo", type("Other", (Echo,), {}))
    finally:
        TASKS.pop("tmp-echo", None)
    with pytest.raises(TypeError, match="not a Task subclass"):
        register_task("tmp-bad", dict)  # type: ignore[arg-type]
    assert "tmp-bad" not in TASKS


def test_stable_hash_is_pinned():
    # Pinned: changing it would silently reshuffle every task's train/test partition.
    assert stable_hash("a", 1) == 14809425904682091265
    assert stable_hash("a", 1) != stable_hash("a1")


# ---------------------------------------------------------------------------------------------- arithmetic


def _eval(expr: str) -> int:
    """Evaluate +,-,* integer expressions with Python's precedence, via the AST (no eval)."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def go(node):
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](go(node.left), go(node.right))
        if isinstance(node, ast.Constant):
            return node.value
        raise AssertionError(f"unexpected node {node!r}")

    return go(ast.parse(expr, mode="eval").body)


def test_arithmetic_default_prompts_are_pinned_and_short():
    task = get_task("arithmetic")
    assert (task.size("train"), task.size("test")) == (1_000_000, 1000)
    prompts = task.prompts("test", range(3))
    assert [p.messages[0].content for p in prompts] == ["68-19+85", "91-38-9", "72-36-70"]
    assert [p.reference for p in prompts] == ["134", "44", "-34"]
    assert all(len(p.messages) == 1 and p.messages[0].role == "user" for p in prompts)
    assert [p.prompt_id for p in task.prompts("train", [7, 3])] == [7, 3]


def test_worked_target_format():
    prob = build_problem([53, 93, 1], ["-", "-"])
    assert (prob.expression, prob.answer) == ("53-93-1", -41)
    assert prob.worked == "53-93=-40,-40-1=-41 #### -41"
    assert build_problem([5, 3, 2], ["+", "*"]).expression == "(5+3)*2"
    assert build_problem([5, 3, 2, 1], ["*", "-", "*"]).expression == "(5*3-2)*1"


def test_arithmetic_is_deterministic_per_seed():
    a, b, c = get_task("arithmetic", seed=1), get_task("arithmetic", seed=1), get_task("arithmetic", seed=2)
    for split, ids in (("train", [0, 5, 999, 123456]), ("test", [0, 5, 999])):
        assert a.prompts(split, ids) == b.prompts(split, ids)
        assert [a.sft_target(split, i) for i in ids] == [b.sft_target(split, i) for i in ids]
        assert a.prompts(split, ids) != c.prompts(split, ids)


def test_arithmetic_train_and_test_problems_are_disjoint_across_seeds():
    tasks = [get_task("arithmetic", {"difficulty": 1}, seed=s) for s in (0, 1)]
    test = {p.messages[0].content for t in tasks for p in t.prompts("test", range(1000))}
    train = {p.messages[0].content for t in tasks for p in t.prompts("train", range(10000))}
    assert len(test) > 500 and len(train) > 5000
    assert not test & train
    assert all(is_test_problem(e) for e in test) and not any(is_test_problem(e) for e in train)


@pytest.mark.parametrize("difficulty", [1, 2, 3])
def test_arithmetic_problems_are_correct_and_sft_targets_verify(difficulty):
    task = get_task("arithmetic", {"difficulty": difficulty, "ops": "+-*", "max_operand": 20})
    limit = 20 if difficulty < 3 else 209
    for split in ("train", "test"):
        for p in task.prompts(split, range(300)):
            expr = p.messages[0].content
            assert _eval(expr) == int(p.reference), expr
            target = task.sft_target(split, p.prompt_id)
            assert target.count("=") == difficulty and target.endswith(f"#### {p.reference}")
            assert task.verify(target, p.reference) == 1.0
            assert all(0 <= n <= limit for n in map(int, number_strings(expr.replace("-", " "))))


def test_arithmetic_system_prompt_and_ids_and_splits():
    task = get_task("arithmetic", {"system_prompt": "Compute.", "train_size": 10, "test_size": 2})
    (p,) = task.prompts("train", [9])
    assert [m.role for m in p.messages] == ["system", "user"] and p.messages[0].content == "Compute."
    with pytest.raises(ValueError, match="out of range"):
        task.prompts("train", [10])
    with pytest.raises(ValueError, match="out of range"):
        task.sft_target("test", -1)
    with pytest.raises(ValueError, match="not an integer"):
        task.prompts("train", ["1"])
    with pytest.raises(ValueError, match="split must be one of"):
        task.prompts("valid", [0])
    with pytest.raises(ValueError, match="split must be one of"):
        task.size("dev")


def test_arithmetic_rejects_a_problem_space_too_small_to_split():
    with pytest.raises(ValueError, match=r"task\.params\.max_operand: only 4 distinct problems"):
        get_task("arithmetic", {"difficulty": 1, "max_operand": 1, "ops": "+"})


@pytest.mark.parametrize(
    "response, expected",
    [
        ("53-93=-40,-40-1=-41 #### -41", -41),
        ("#### +41", 41),
        ("####  41.", 41),
        ("#### − 41", -41),  # unicode minus and a space
        ("#### 1,234", 1234),
        ("#### 41.0", 41),
        ("#### 41.5", None),
        ("so \\boxed{-7} is it", -7),
        ("\\boxed{\\text{12}}", 12),
        ("The answer is 1,234.", 1234),
        ("answer: −3", -3),
        ("I think 5 and then 12", 12),
        ("result 53-93", 93),  # a binary minus is not a sign
        ("x=-8", -8),
        ("#### \n 17", 17),  # nothing after the marker on its line: fall back to the last number
        ("12 #### 13 \\boxed{14}", 13),  # #### beats \boxed for this task
        ("", None),
        ("no digits here", None),
        ("}}{{\\boxed{ #### answer is", None),
    ],
)
def test_extract_integer(response, expected):
    assert extract_integer(response) == expected


def test_arithmetic_verify_rewards_and_garbage():
    task = get_task("arithmetic")
    assert task.verify("#### -41", "-41") == 1.0
    assert task.verify("#### -40", "-41") == 0.0
    assert task.verify("#### 41", "-41") == 0.0
    assert task.verify("", "-41") == 0.0
    assert task.verify("-41", "not a number") == 0.0
    assert task.verify(None, "1") == 0.0  # type: ignore[arg-type]
    assert task.verify("9" * 10000, "1") == 0.0  # too many digits for int(): still no exception
    assert task.verify("blah " * 20000 + "#### 5", "5") == 1.0


def test_arithmetic_verify_scans_the_text_once_and_stops_at_the_first_rule(monkeypatch):
    """The verifier is cheap by construction (it runs on every rollout, and on hostile text): one search of the
    short chunk after ``####`` when there is one, one scan of the whole text when no rule applies."""
    from hacrl_fed.tasks import arithmetic

    real, scans = arithmetic.NUMBER_RE, []

    class CountingPattern:
        def search(self, text):
            scans.append(("search", text))
            return real.search(text)

        def finditer(self, text):
            scans.append(("finditer", text))
            return real.finditer(text)

    monkeypatch.setattr(arithmetic, "NUMBER_RE", CountingPattern())
    task = get_task("arithmetic")
    assert task.verify("53-93=-40,-40-1=-41 #### -41", "-41") == 1.0
    assert [(kind, text.strip()) for kind, text in scans] == [("search", "-41")]
    scans.clear()
    long_text = "no answer here " * 10_000 + "7"
    assert task.verify(long_text, "7") == 1.0
    assert scans == [("finditer", long_text)]


# ---------------------------------------------------------------------------------------------- jsonl math


def test_jsonl_gsm8k_sample_splits_references_and_targets():
    task = get_task("jsonl", {"path": GSM8K})
    assert (task.size("train"), task.size("test")) == (6, 2)
    refs = {s: [p.reference for p in task.prompts(s, range(task.size(s)))] for s in ("train", "test")}
    assert refs == {"train": ["144", "1,080", "-5", "126", "2.25", "56"], "test": ["15", "8"]}
    train_q = {p.messages[-1].content for p in task.prompts("train", range(6))}
    test_q = {p.messages[-1].content for p in task.prompts("test", range(2))}
    assert len(train_q) == 6 and not train_q & test_q
    for split in ("train", "test"):
        for i in range(task.size(split)):
            target = task.sft_target(split, i)
            assert "<<" not in target and "####" in target
            assert task.verify(target, task.prompts(split, [i])[0].reference) == 1.0
    assert task.prompts("train", [0]) == get_task("jsonl", {"path": GSM8K}, seed=9).prompts("train", [0])


def test_jsonl_prompt_messages():
    (p,) = get_task("jsonl", {"path": GSM8K}).prompts("test", [1])
    assert [m.role for m in p.messages] == ["system", "user"] and "####" in p.messages[0].content
    params = {"path": GSM8K, "system_prompt": None, "prompt_template": "Q: {question}\nA: {not_a_field}"}
    (p,) = get_task("jsonl", params).prompts("test", [1])
    assert len(p.messages) == 1 and p.messages[0].content.startswith("Q: Tom reads 15 pages")
    assert p.messages[0].content.endswith("\nA: {not_a_field}")


def test_jsonl_math_sample_boxed_references_and_targets():
    task = get_task("jsonl", MATH_PARAMS)
    refs = [task.prompts(s, [i])[0].reference for s in ("train", "test") for i in range(task.size(s))]
    assert sorted(refs) == sorted(["\\frac{1}{2}", "\\frac{\\sqrt{3}}{2}", "4", "(-3, 1)", "x^2 + 2x + 1"])
    for split in ("train", "test"):
        for i in range(task.size(split)):
            assert task.verify(task.sft_target(split, i), task.prompts(split, [i])[0].reference) == 1.0


def test_jsonl_raw_answers_and_test_path_exclusion(tmp_path):
    train = tmp_path / "train.jsonl"
    test = tmp_path / "test.jsonl"
    rows = [{"q": f"What is {i} plus {i}?", "a": 2 * i} for i in range(6)]
    train.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    test.write_text(json.dumps({"q": "What is  2 plus 2?", "a": "4"}) + "\n")  # duplicate of train row 2
    params = {"path": str(train), "test_path": str(test), "question_field": "q", "answer_field": "a"}
    task = get_task("jsonl", params)
    assert (task.size("train"), task.size("test")) == (5, 1)
    assert [p.reference for p in task.prompts("train", range(5))] == ["0", "2", "6", "8", "10"]
    assert task.sft_target("train", 1) == "The answer is \\boxed{2}."
    assert task.verify(task.sft_target("train", 1), "2") == 1.0


@pytest.mark.parametrize(
    "lines, params, match",
    [
        (None, {}, r"task\.params\.path: file not found"),
        (['{"question": "a", "answer": "#### 1"}', "{oops"], {}, r"rows\.jsonl:2: not valid JSON"),
        (['["a", "b"]'], {}, r"rows\.jsonl:1: expected a JSON object"),
        (['{"question": "a"}'], {}, r"rows\.jsonl:1: missing field 'answer' \(task\.params\.answer_field\)"),
        (['{"q": "a", "answer": "1"}'], {}, r"missing field 'question'.*fields present: \['answer', 'q'\]"),
        (['{"question": "a", "answer": "\\\\boxed{1}"}'], {"answer_format": "gsm8k"}, r"rows\.jsonl:1: no final"),
        (['{"question": "", "answer": "1"}'], {}, r"field 'question' must be a non-empty string"),
        (['{"question": "a", "answer": null}'], {}, r"field 'answer' must be a string or number"),
        ([""], {}, r"task\.params\.path: .* has no rows"),
        (['{"question": "a", "answer": "1"}'], {}, r"task\.params\.test_fraction: split 'test' is empty"),
        (['{"question": "a", "answer": "1"}'], {"prompt_template": "Q"}, r"task\.params\.prompt_template"),
        (['{"question": "a", "answer": "1"}'], {"answer_format": "latex"}, r"task\.params\.answer_format"),
        (['{"question": "a", "answer": "1"}'], {"test_path": "/nonexistent/t.jsonl"}, r"task\.params\.test_path"),
    ],
)
def test_jsonl_errors_name_file_line_and_field(tmp_path, lines, params, match):
    path = tmp_path / "rows.jsonl"
    if lines is not None:
        path.write_text("\n".join(lines) + "\n")
    with pytest.raises(BuildError, match=match):
        get_task("jsonl", {"path": str(path), **params})


def test_jsonl_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"question": "a", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 2"}\n')
    with pytest.raises(BuildError, match=r"rows\.jsonl:2: not valid UTF-8 \(byte 18 of the line: b'\\xe9'\)"):
        get_task("jsonl", {"path": str(path)})


def test_every_task_build_problem_is_a_build_error(tmp_path):
    with pytest.raises(BuildError, match=r"task\.name: unknown task 'nope'"):
        get_task("nope")
    with pytest.raises(BuildError, match=r"task\.params\.difficulty"):
        get_task("arithmetic", {"difficulty": "x"})


def test_jsonl_path_is_required():
    with pytest.raises(ValueError, match=r"task\.params\.path: Field required"):
        get_task("jsonl", {})


@pytest.mark.parametrize(
    "response, reference, reward",
    [
        ("So the answer is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{1/2}", "0.5", 1.0),
        ("\\boxed{0.51}", "\\frac{1}{2}", 0.0),
        ("$\\boxed{\\dfrac{\\sqrt 3}{2}}$", "\\frac{\\sqrt{3}}{2}", 1.0),
        ("\\boxed{(-3,1)}", "(-3, 1)", 1.0),
        ("\\boxed{(1,-3)}", "(-3, 1)", 0.0),
        ("\\boxed{1+2x+x^2}", "x^2 + 2x + 1", 1.0),
        ("\\boxed{x^2+2x+2}", "x^2 + 2x + 1", 0.0),
        ("work...\n#### 1080", "1,080", 1.0),
        ("#### $1,080.00.", "1,080", 1.0),
        ("#### 18 dollars", "18", 1.0),
        ("#### 19 dollars", "18", 0.0),
        ("#### −5", "-5", 1.0),
        ("#### 2.250", "2.25", 1.0),
        ("The answer is 7.", "7", 1.0),
        ("3 + 4 = 7", "7", 1.0),
        ("3 + 4 = 8", "7", 0.0),
        ("\\boxed{9^{9^{9}}}", "5", 0.0),  # refused by the cost screen, not computed
        ("\\boxed{10^{100000000}}", "10", 0.0),
        ("\\boxed{2^2^2^2^2}", "65536", 0.0),
        ("\\boxed{" * 5000, "5", 0.0),
        ("x" * 200_000, "5", 0.0),
        ("", "5", 0.0),
        ("#### ", "5", 0.0),
        ("}{\\frac{$$\\boxed{}####", "\\frac{1}{2}", 0.0),
    ],
)
def test_jsonl_verify(response, reference, reward, monkeypatch):
    from hacrl_fed.tasks import jsonl_math

    task = get_task("jsonl", {"path": GSM8K})
    real, parsed = jsonl_math._parse, []
    monkeypatch.setattr(jsonl_math, "_parse", lambda s, timeout: parsed.append(s) or real(s, timeout))
    assert task.verify(response, reference) == reward
    assert [s for s in parsed if too_costly(s)] == []  # sympy only ever sees what the cost screen let through
    if too_costly(extract_answer(response) or ""):
        assert parsed == []  # power towers, huge exponents: refused by the screen, never parsed


def test_jsonl_verify_never_raises_on_odd_types():
    task = get_task("jsonl", {"path": GSM8K})
    assert task.verify(None, "5") == 0.0  # type: ignore[arg-type]
    assert task.verify("5", None) == 0.0  # type: ignore[arg-type]
    assert task.verify("\\boxed{" + "9" * 5000 + "}", "5") == 0.0


def test_jsonl_verify_works_off_the_main_thread():
    """math-verify's own timeouts use signals (main thread only); worker threads must still get rewards."""
    task = get_task("jsonl", MATH_PARAMS)
    results = []
    thread = threading.Thread(target=lambda: results.append(task.verify("\\boxed{0.5}", "\\frac{1}{2}")))
    thread.start()
    thread.join(30)
    assert results == [1.0]


def test_jsonl_verify_leaves_an_armed_alarm_alone():
    """math-verify's signal timeout must not cancel a timer someone else armed (e.g. pytest-timeout)."""
    task = get_task("jsonl", MATH_PARAMS)
    old_handler = signal.signal(signal.SIGALRM, lambda *_: None)
    old_timer = signal.getitimer(signal.ITIMER_REAL)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        assert task.verify("\\boxed{0.25}", "\\frac{1}{4}") == 1.0
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 90
    finally:
        signal.setitimer(signal.ITIMER_REAL, *old_timer)
        signal.signal(signal.SIGALRM, old_handler)


def test_answer_helpers():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{\\sqrt{2}}} c") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\fbox{3}") == "3" and last_boxed("\\boxed{open") is None and last_boxed("none") is None
    assert extract_answer("x \\boxed{2} #### 3") == "2"  # \boxed beats #### for this task
    assert extract_answer("#### 3.\nthanks") == "3"
    assert extract_answer("the answer is x+1") == "x+1"
    assert extract_answer("a 1 b -2.5 c") == "-2.5"
    assert extract_answer("nothing") is None
    assert number_strings("x=-1,234.5, 53-93, 1,23") == ["-1234.5", "53", "93", "1", "23"]
    assert answers_match("1,234", "1234") and not answers_match(None, "1")
    assert too_costly("2^{2^{10}}") and too_costly("(10)!") and too_costly("3^{20000}") and too_costly("1" * 400)
    assert not too_costly("x^2+2x+1") and not too_costly("\\frac{1}{2}") and not too_costly("5!")


# ---------------------------------------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_missing_package_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes `import reasoning_gym` fail
    with pytest.raises(BuildError, match=r"^task 'reasoning-gym' needs the optional package 'reasoning_gym'.*pip "
                                         r"install 'hacrl-fed\[reasoning-gym\]'") as err:
        get_task("reasoning-gym", {"dataset": "basic_arithmetic"})
    assert isinstance(err.value.__cause__, ImportError)


def test_reasoning_gym_params_are_validated_before_import():
    with pytest.raises(ValueError, match=r"task\.params\.dataset: Field required"):
        get_task("reasoning-gym", {})


def test_extract_tagged_answer():
    assert extract_tagged_answer("think <answer>1</answer> more <answer> 42 </answer>") == "42"
    assert extract_tagged_answer("  plain  ") == "plain"


def test_reasoning_gym_end_to_end():
    pytest.importorskip("reasoning_gym", reason="optional package reasoning_gym is not installed")
    params = {"dataset": "basic_arithmetic", "size": 60, "test_size": 20}
    task = get_task("reasoning-gym", params, seed=1)
    assert task.prompts("test", range(5)) == get_task("reasoning-gym", params, seed=1).prompts("test", range(5))
    train_q = {p.messages[-1].content for p in task.prompts("train", range(task.size("train")))}
    test_q = {p.messages[-1].content for p in task.prompts("test", range(task.size("test")))}
    assert task.size("test") == 20 and not train_q & test_q
    (p,) = task.prompts("test", [0])
    assert task.verify(task.sft_target("test", 0), p.reference) == 1.0
    assert task.verify("<answer>not it</answer>", p.reference) == 0.0
    assert task.verify("", "not json") == 0.0
    with pytest.raises(ValueError, match=r"task\.params\.dataset"):
        get_task("reasoning-gym", {"dataset": "no_such_dataset"})
