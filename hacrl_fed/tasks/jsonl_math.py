"""``jsonl``: GSM8K/MATH-style problems from local JSONL files, verified with math-verify.

Each line is a JSON object with a question field and an answer field. The *reference* is the final answer
pulled out of the answer field (``answer_format``): ``gsm8k`` = the text after the last ``####``; ``boxed`` =
the last ``\\boxed{...}``; ``raw`` = the whole field; ``auto`` = ``gsm8k`` if ``####`` is present, else
``boxed`` if a ``\\boxed{`` is present, else ``raw``.

Splits: with ``test_path`` the test split is that file and train is ``path`` minus any row whose question
(whitespace-normalized) is also a test question. Without it a row is test iff
``stable_hash(SPLIT_SALT, question) / 2**64 < test_fraction``, so identical questions share a split. Ids
follow file order within a split; the task seed does not change them.

Verification (unless ``reward_fn`` names the lab's own function, :func:`~hacrl_fed.tasks.loader.load_reward_fn`):
the response's answer is its last ``\\boxed{}``, else the text after its last ``####``, else
what follows "answer is", else its last number. Plain numbers (``1,234``, ``-0.50``, ``$18``, ``18%``) are
compared exactly as fractions without math-verify; everything else goes through ``math_verify`` behind a
cost screen (length cap, no power towers / huge exponents / big factorials) and its own signal timeouts
where those are usable (main thread, no other timer armed); any failure scores 0.0. Note a timeout makes a
reward depend on machine speed; the screen keeps known blow-ups from ever reaching one.
"""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from hacrl_fed.config import BuildError
from hacrl_fed.tasks.base import (
    NUMBER_RE,
    Task,
    TaskParams,
    after_answer_is,
    after_last_marker,
    check_split,
    last_boxed,
    normalize_minus,
    number_strings,
    register_task,
    stable_hash,
    strip_trailing_period,
)
from hacrl_fed.tasks.loader import load_reward_fn
from hacrl_fed.types import ChatMessage, Prompt

SPLIT_SALT = "jsonl-split-v1"
DEFAULT_SYSTEM_PROMPT = (
    "Solve the problem step by step. Write the final answer at the end, after '####' or inside \\boxed{}."
)
MAX_MATH_CHARS = 300  # longer answers skip math-verify (string/number comparison only)
MAX_EXPONENT = 10_000
MATH_VERIFY_TIMEOUT_S = 3
_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_CALC_ANNOTATION_RE = re.compile(r"<<[^<>]*>>")
_POWER_RE = re.compile(r"\^|\*\*")
_FACTORIAL_RE = re.compile(r"(?<!\\)(\d*)\s*!")


class JsonlMathParams(TaskParams):
    path: str = Field(min_length=1)
    test_path: str | None = None
    test_fraction: float = Field(0.1, gt=0, lt=1)
    question_field: str = "question"
    answer_field: str = "answer"
    answer_format: Literal["auto", "gsm8k", "boxed", "raw"] = "auto"
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    prompt_template: str = "{question}"
    reward_fn: str | None = Field(
        None, description="import path package.module:function of fn(response, reference) -> float in [0, 1]"
    )

    @field_validator("prompt_template")
    @classmethod
    def _has_question(cls, v: str) -> str:
        if "{question}" not in v:
            raise ValueError("must contain the placeholder {question}")
        return v


@dataclass(frozen=True)
class Row:
    question: str
    reference: str  # the extracted final answer
    solution: str  # the answer field as written
    where: str  # "file:line"


# --------------------------------------------------------------------------------------------- loading


def extract_reference(answer: str, answer_format: str) -> str | None:
    """The final answer inside a dataset answer field (see the module docstring); None if not found."""
    if answer_format == "auto":
        answer_format = "gsm8k" if "####" in answer else "boxed" if last_boxed(answer) is not None else "raw"
    if answer_format == "gsm8k":
        found = after_last_marker(answer, "####")
    elif answer_format == "boxed":
        found = last_boxed(answer)
    else:
        found = answer
    found = strip_trailing_period(found.strip()) if found is not None else None
    return found or None


def load_rows(path: str, p: JsonlMathParams, param: str) -> list[Row]:
    """Parse a JSONL file into rows; :class:`BuildError` naming ``task.params.<param>`` or ``file:line`` on any
    problem (a missing or unreadable file, invalid UTF-8, invalid JSON, a line that is not an object, a missing
    or empty field, no final answer)."""
    file = Path(path)
    if not file.is_file():
        raise BuildError(f"task.params.{param}: file not found: {path}")
    rows = []
    try:
        fh = file.open("rb")
    except OSError as err:
        raise BuildError(f"task.params.{param}: cannot read {path}: {err.strerror or err}") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise BuildError(
                    f"{where}: not valid UTF-8 (byte {err.start + 1} of the line: {raw[err.start : err.start + 1]!r})"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise BuildError(f"{where}: not valid JSON: {err.msg} (column {err.colno})") from None
            if not isinstance(obj, dict):
                raise BuildError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            rows.append(_row(obj, where, p))
    if not rows:
        raise BuildError(f"task.params.{param}: {path} has no rows")
    return rows


def _row(obj: dict, where: str, p: JsonlMathParams) -> Row:
    for field, param in ((p.question_field, "question_field"), (p.answer_field, "answer_field")):
        if field not in obj:
            raise BuildError(f"{where}: missing field {field!r} (task.params.{param}); fields present: {sorted(obj)}")
    question, answer = obj[p.question_field], obj[p.answer_field]
    if not isinstance(question, str) or not question.strip():
        raise BuildError(f"{where}: field {p.question_field!r} must be a non-empty string")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise BuildError(f"{where}: field {p.answer_field!r} must be a string or number")
    answer = str(answer)
    ref = extract_reference(answer, p.answer_format)
    if ref is None:
        raise BuildError(
            f"{where}: no final answer in field {p.answer_field!r} with "
            f"task.params.answer_format={p.answer_format!r}: {answer[:80]!r}"
        )
    return Row(question, ref, answer, where)


def _norm_question(q: str) -> str:
    return " ".join(q.split())


# ------------------------------------------------------------------------------------------ verification


def extract_answer(response: str) -> str | None:
    """The final answer of a response: last ``\\boxed{}``, else after ``####``, else "answer is", else last number."""
    text = normalize_minus(response)
    for found in (last_boxed(text), after_last_marker(text, "####"), after_answer_is(text)):
        if found and found.strip():
            return strip_trailing_period(found.strip())
    nums = number_strings(text)
    return nums[-1] if nums else None


def _clean(s: str) -> str:
    s = normalize_minus(s).strip()
    for junk in ("\\!", "\\,", "\\;", "\\left", "\\right", "$", "\\%", "%"):
        s = s.replace(junk, "")
    return strip_trailing_period(s.strip())


def as_number(s: str) -> Fraction | None:
    """``"1,234.50"`` → Fraction(2469, 2); None unless ``s`` is one plain number."""
    s = s.replace(" ", "")
    if not _PLAIN_NUMBER_RE.fullmatch(s):
        return None
    return Fraction(s.replace(",", ""))


def answers_match(pred: str | None, gold: str) -> bool:
    """Whether a response's extracted answer equals the reference (see the module docstring)."""
    if pred is None:
        return False
    p, g = _clean(pred), _clean(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    ng = as_number(g)
    if ng is not None:
        np_ = as_number(p)
        if np_ is None:  # "18 dollars": a number followed by words counts as that number
            m = NUMBER_RE.match(p)
            rest = p[m.end() :].strip() if m else ""
            np_ = as_number(m.group(0)) if m and rest[:1].isalpha() else None
        if np_ is not None:
            return np_ == ng
    return _math_verify_equal(p, g)


def too_costly(s: str) -> bool:
    """Conservative screen for answers sympy could spend unbounded time or memory on (big powers/factorials)."""
    if len(s) > MAX_MATH_CHARS:
        return True
    for m in _POWER_RE.finditer(s):
        exp, rest = _exponent(s[m.end() :])
        if _POWER_RE.search(exp) or _POWER_RE.match(rest.lstrip()):
            return True  # a tower: a^b^c or a^{b^c}
        if any(abs(Fraction(n)) > MAX_EXPONENT for n in number_strings(exp)):
            return True
    for m in _FACTORIAL_RE.finditer(s):
        if not m.group(1) or int(m.group(1)) > 1000:
            return True
    return False


def _exponent(after: str) -> tuple[str, str]:
    """Split the text after ``^`` into (exponent, rest): a ``{...}``/``(...)`` group or one token."""
    t = after.lstrip()
    if t[:1] in ("{", "("):
        close = "}" if t[0] == "{" else ")"
        depth = 0
        for i, c in enumerate(t):
            depth += c == t[0]
            depth -= c == close
            if depth == 0:
                return t[1:i], t[i + 1 :]
        return t, ""
    m = re.match(r"[-+]?\s*(?:\d+(?:\.\d+)?|\\?[A-Za-z]+|.)", t)
    return (m.group(0), t[m.end() :]) if m else ("", t)


def _math_verify_equal(pred: str, gold: str) -> bool:
    if too_costly(pred) or too_costly(gold):
        return False
    try:
        from math_verify import verify

        timeout = _signal_timeout()
        g, p = _parse(gold, timeout), _parse(pred, timeout)
        if not g or not p:
            return False
        return bool(verify(list(g), list(p), timeout_seconds=timeout, raise_on_error=False))
    except Exception:  # math-verify/sympy can raise on odd input: no reward, never a crash
        return False


def _signal_timeout() -> int | None:
    """math-verify's timeout for this call: its SIGALRM timer works only on the main thread, and must not
    clobber a timer someone else armed (e.g. pytest-timeout); otherwise None (no timeout, the cost screen
    bounds the work)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None
    return MATH_VERIFY_TIMEOUT_S


@lru_cache(maxsize=8192)
def _parse(s: str, timeout: int | None) -> tuple:
    from math_verify import parse

    return tuple(parse(f"${s}$", parsing_timeout=timeout, raise_on_error=False))


# ---------------------------------------------------------------------------------------------- the task


@register_task("jsonl")
class JsonlMathTask(Task):
    """See the module docstring. ``reference`` is the extracted final answer string."""

    Params = JsonlMathParams
    in_memory = True
    params: JsonlMathParams

    def __init__(self, params: JsonlMathParams, seed: int = 0) -> None:
        super().__init__(params, seed)
        p = params
        rows = self.load(p.path, "path")
        if p.test_path is not None:
            test = self.load(p.test_path, "test_path")
            test_qs = {_norm_question(r.question) for r in test}
            train = [r for r in rows if _norm_question(r.question) not in test_qs]
        else:
            is_test = [stable_hash(SPLIT_SALT, _norm_question(r.question)) / 2**64 < p.test_fraction for r in rows]
            train = [r for r, t in zip(rows, is_test) if not t]
            test = [r for r, t in zip(rows, is_test) if t]
        for split, part in (("train", train), ("test", test)):
            if not part:
                raise BuildError(
                    f"task.params.test_fraction: split {split!r} is empty ({len(rows)} rows in {p.path}, "
                    f"test_fraction={p.test_fraction}); add rows, change test_fraction or set test_path"
                )
        self._rows = {"train": train, "test": test}
        self._reward = load_reward_fn(p.reward_fn, "task.params.reward_fn") if p.reward_fn else None

    def load(self, path: str, param: str) -> list[Row]:
        """The rows of one data file (``task.params.<param>``); subclasses read other formats."""
        return load_rows(path, self.params, param)

    def size(self, split: str) -> int:
        return len(self._rows[check_split(split)])

    def row(self, split: str, prompt_id: int) -> Row:
        (i,) = self.check_ids(split, [prompt_id])
        return self._rows[split][i]

    def prompts(self, split: str, ids: Sequence[int]) -> list[Prompt]:
        out = []
        for i in self.check_ids(split, ids):
            r = self._rows[split][i]
            msgs: tuple[ChatMessage, ...] = (
                ChatMessage("user", self.params.prompt_template.replace("{question}", r.question)),
            )
            if self.params.system_prompt:
                msgs = (ChatMessage("system", self.params.system_prompt),) + msgs
            out.append(Prompt(prompt_id=i, messages=msgs, reference=r.reference))
        return out

    def verify(self, response: str, reference: str) -> float:
        if self._reward is not None:  # the lab's own verifier (task.params.reward_fn), guarded
            return self._reward(response, reference)
        try:
            return 1.0 if answers_match(extract_answer(response), reference) else 0.0
        except Exception:  # never raise on garbage
            return 0.0

    def sft_target(self, split: str, prompt_id: int) -> str:
        """The dataset's worked solution (GSM8K ``<<calc>>`` annotations removed); for a raw answer field,
        just ``The answer is \\boxed{<answer>}.``"""
        r = self.row(split, prompt_id)
        solution = _CALC_ANNOTATION_RE.sub("", r.solution).strip()
        if extract_reference(solution, "auto") == r.reference and solution != r.reference:
            return solution
        return f"The answer is \\boxed{{{r.reference}}}."
