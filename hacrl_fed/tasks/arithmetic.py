"""``arithmetic``: procedural multi-step integer arithmetic, sized for tiny (~1M-parameter) models.

A problem is ``difficulty`` steps evaluated left to right: ``53-93-1`` (difficulty 2) has the worked answer
``53-93=-40,-40-1=-41 #### -41``. With ``*`` in ``ops`` the left part is parenthesized where precedence would
otherwise change the value (``(5+3)*2``), so the expression always means what the steps compute.

Difficulty: 1 = one step, 2 = two steps, 3 = three steps with operands up to ``10*max_operand+9``; operands
are otherwise drawn uniformly from ``0..max_operand``.

Disjoint splits: a problem is a *test problem* iff ``stable_hash(PARTITION_SALT, expression) % 10 == 0``
(seed-independent, so no seed ever trains on another seed's test problems). Prompt ``id`` of ``split`` is the
first problem drawn from ``Random(stable_hash("arithmetic", seed, split, id))`` whose partition matches
``split`` (rejection sampling). Test ids may repeat a problem (draws are with replacement); train and test never
share one.

Slices (``slices``, off by default): named single-operator families, e.g. ``{add: {ops: "+"}, mul: {ops: "*",
max_operand: 9}}``. Each problem first draws its slice: uniformly (``rng.choice`` over the names in the order given)
when every slice has the same ``weight`` (default 1), else in proportion to the weights (``rng.choices``; a warm
start trained mostly on one slice); then its operators from the slice's ``ops`` and its operands up to the slice's
``max_operand`` (default: the task's); ``ops`` is then unused. :meth:`ArithmeticTask.slice_label` names a problem's
slice, so an evaluation can report accuracy per slice (:mod:`hacrl_fed.tasks.slices`). A slice problem is the same
expression as the problem the plain task with that slice's ``ops`` / ``max_operand`` draws, so the partition keeps
them disjoint across both. Without ``slices`` the draws are exactly the ones above.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hacrl_fed.tasks.base import (
    NUMBER_RE,
    Task,
    TaskParams,
    after_answer_is,
    after_last_marker,
    check_split,
    last_boxed,
    normalize_minus,
    register_task,
    stable_hash,
)
from hacrl_fed.types import ChatMessage, Prompt

PARTITION_SALT = "arithmetic-partition-v1"
TEST_BUCKETS = 10  # 1 in TEST_BUCKETS problems is a test problem
MAX_ATTEMPTS = 2000
MIN_PROBLEM_SPACE = 200
ALLOWED_OPS = "+-*"
SLICE_NAME_RE = r"^[a-z][a-z0-9_]{0,31}$"
MAX_SLICES = 16


def _check_ops_string(v: str) -> str:
    bad = sorted(set(v) - set(ALLOWED_OPS))
    if not v or bad:
        raise ValueError(f"must be a non-empty string of characters from {ALLOWED_OPS!r}, got {v!r}")
    return "".join(dict.fromkeys(v))  # dedupe, keep order


class ArithmeticSlice(BaseModel):
    """One named slice: its operators and (optionally) its own operand bound."""

    model_config = ConfigDict(extra="forbid")
    ops: str
    max_operand: int | None = Field(None, ge=1, le=10**6)
    weight: float = Field(1.0, gt=0, le=1000)  # relative draw probability (the module docstring)

    @field_validator("ops")
    @classmethod
    def _check_ops(cls, v: str) -> str:
        return _check_ops_string(v)


class ArithmeticParams(TaskParams):
    difficulty: int = Field(2, ge=1, le=3)
    max_operand: int = Field(99, ge=1, le=10**6)
    ops: str = "+-"
    train_size: int = Field(1_000_000, ge=1)
    test_size: int = Field(1000, ge=1)
    system_prompt: str | None = None
    slices: dict[str, ArithmeticSlice] | None = None  # None: one family drawn from ``ops`` (the module docstring)

    @field_validator("ops")
    @classmethod
    def _check_ops(cls, v: str) -> str:
        return _check_ops_string(v)

    @field_validator("slices")
    @classmethod
    def _check_slices(cls, v: dict[str, ArithmeticSlice] | None) -> dict[str, ArithmeticSlice] | None:
        if v is None:
            return v
        if not 1 <= len(v) <= MAX_SLICES:
            raise ValueError(f"need 1..{MAX_SLICES} slices, got {len(v)}")
        bad = [name for name in v if not re.match(SLICE_NAME_RE, name)]
        if bad:
            raise ValueError(f"slice names must match {SLICE_NAME_RE}, got {bad}")
        return v


@dataclass(frozen=True)
class Problem:
    expression: str  # what the user sees, e.g. "53-93-1"
    steps: tuple[str, ...]  # e.g. ("53-93=-40", "-40-1=-41")
    answer: int
    slice: str | None = None  # the slice it was drawn from (``slices`` set), else None

    @property
    def worked(self) -> str:
        """The supervised target: ``"53-93=-40,-40-1=-41 #### -41"``."""
        return ",".join(self.steps) + f" #### {self.answer}"


@dataclass(frozen=True)
class _Family:
    """What one draw picks from: a slice's name (None without ``slices``), operators and largest operand."""

    name: str | None
    ops: str
    max: int


def build_problem(operands: Sequence[int], ops: Sequence[str]) -> Problem:
    """Evaluate ``operands[0] ops[0] operands[1] ...`` left to right, with its expression and worked steps.

    ``len(operands) == len(ops) + 1``; ``*`` after a ``+``/``-`` wraps the left part in parentheses.
    """
    if len(operands) != len(ops) + 1 or not ops:
        raise ValueError(f"need len(operands) == len(ops) + 1 >= 2, got {len(operands)} and {len(ops)}")
    text, value, additive_top = str(operands[0]), int(operands[0]), False
    steps = []
    for op, b in zip(ops, operands[1:]):
        if op == "*" and additive_top:
            text, additive_top = f"({text})", False
        new = value + b if op == "+" else value - b if op == "-" else value * b
        steps.append(f"{value}{op}{b}={new}")
        text += f"{op}{b}"
        additive_top = additive_top or op in "+-"
        value = new
    return Problem(text, tuple(steps), value)


def is_test_problem(expression: str) -> bool:
    """The seed-independent train/test partition of the problem space."""
    return stable_hash(PARTITION_SALT, expression) % TEST_BUCKETS == 0


def extract_integer(text: str) -> int | None:
    """The integer answer in a free-form response, or None.

    Rules, first that yields a number wins: the number after the last ``####``; else the first number in the
    last ``\\boxed{}``; else the first number after the last "answer is"/"answer:"; else the last number in the
    text. Tolerates spaces, ``+``, a trailing period, thousands commas and unicode minus. A non-integer number
    (``41.5``) gives None; ``41.0`` gives 41.
    """
    text = normalize_minus(text)
    candidates = (
        lambda: after_last_marker(text, "####"),
        lambda: last_boxed(text),
        lambda: after_answer_is(text),
    )
    for get in candidates:
        chunk = get()
        if chunk:
            m = NUMBER_RE.search(chunk)
            if m:
                return _as_int(m)
    matches = list(NUMBER_RE.finditer(text))
    return _as_int(matches[-1]) if matches else None


def _as_int(m) -> int | None:
    frac = m.group("frac")
    if frac and frac.strip(".0"):
        return None
    value = int(m.group("int").replace(",", ""))
    return -value if m.group("sign") == "-" else value


@register_task("arithmetic")
class ArithmeticTask(Task):
    """See the module docstring. ``reference`` is the answer as a decimal integer string."""

    Params = ArithmeticParams
    params: ArithmeticParams

    def __init__(self, params: ArithmeticParams, seed: int = 0) -> None:
        super().__init__(params, seed)
        p = params
        self._steps = p.difficulty
        self._weights: list[float] | None = None
        if p.slices is None:
            self._families = [_Family(None, p.ops, self._bound(p.max_operand))]
        else:
            self._families = [
                _Family(name, s.ops, self._bound(s.max_operand or p.max_operand)) for name, s in p.slices.items()
            ]
            weights = [s.weight for s in p.slices.values()]
            self._weights = None if len(set(weights)) == 1 else weights  # equal weights: the uniform draw
        for fam in self._families:
            space = (fam.max + 1) ** (self._steps + 1) * len(fam.ops) ** self._steps
            if space < MIN_PROBLEM_SPACE:
                where = "max_operand" if fam.name is None else f"slices.{fam.name}"
                raise ValueError(
                    f"task.params.{where}: only {space} distinct problems with max operand {fam.max}, "
                    f"difficulty={p.difficulty}, ops={fam.ops!r}; need >= {MIN_PROBLEM_SPACE} to split train/test"
                )

    def _draw_family(self, rng: random.Random) -> _Family:
        """A problem's slice: uniform over the slices, or in proportion to their weights (the module docstring)."""
        if self._weights is None:
            return rng.choice(self._families)
        return rng.choices(self._families, weights=self._weights)[0]

    def _bound(self, max_operand: int) -> int:
        """The largest operand drawn: ``max_operand``, or ``10 * max_operand + 9`` at difficulty 3."""
        return max_operand if self._steps < 3 else 10 * max_operand + 9

    def size(self, split: str) -> int:
        return self.params.train_size if check_split(split) == "train" else self.params.test_size

    def problem(self, split: str, prompt_id: int) -> Problem:
        """The problem behind ``prompt_id`` of ``split`` (see the module docstring for the rule)."""
        want_test = split == "test"
        rng = random.Random(stable_hash("arithmetic", self.seed, split, prompt_id))
        sliced = self.params.slices is not None
        for _ in range(MAX_ATTEMPTS):
            fam = self._draw_family(rng) if sliced else self._families[0]  # no extra draw without slices
            operands = [rng.randint(0, fam.max) for _ in range(self._steps + 1)]
            ops = [rng.choice(fam.ops) for _ in range(self._steps)]
            prob = build_problem(operands, ops)
            if is_test_problem(prob.expression) == want_test:
                return replace(prob, slice=fam.name)
        raise RuntimeError(f"no {split} problem found for id {prompt_id} in {MAX_ATTEMPTS} draws")

    def prompts(self, split: str, ids: Sequence[int]) -> list[Prompt]:
        out = []
        for i in self.check_ids(split, ids):
            prob = self.problem(split, i)
            msgs: tuple[ChatMessage, ...] = (ChatMessage("user", prob.expression),)
            if self.params.system_prompt:
                msgs = (ChatMessage("system", self.params.system_prompt),) + msgs
            out.append(Prompt(prompt_id=i, messages=msgs, reference=str(prob.answer)))
        return out

    def slice_label(self, split: str, prompt_id: int) -> str | None:
        """The slice of ``prompt_id``'s problem (``slices`` set), else None."""
        (i,) = self.check_ids(split, [prompt_id])
        return self.problem(split, i).slice

    def verify(self, response: str, reference: str) -> float:
        try:
            return 1.0 if extract_integer(response) == int(reference) else 0.0
        except Exception:  # garbage reference or non-str response: no reward, never an exception
            return 0.0

    def sft_target(self, split: str, prompt_id: int) -> str:
        (i,) = self.check_ids(split, [prompt_id])
        return self.problem(split, i).worked
