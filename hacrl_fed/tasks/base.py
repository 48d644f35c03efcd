"""Task interface, registry and the answer-extraction helpers shared by the verifiers.

A *task* turns prompt ids into :class:`~hacrl_fed.types.Prompt` objects and scores responses:

- ``task.size(split)``: prompt ids of ``split`` (``"train"`` | ``"test"``) are ``range(size)``.
- ``task.prompts(split, ids)``: deterministic per ``(seed, split, id)``; train and test never share a problem.
- ``task.verify(response, reference)``: reward in ``[0, 1]``; never raises, whatever the text.
- ``task.sft_target(split, prompt_id)``: a correct worked response (for a supervised warm start).

Tasks register under a name (``register_task``) and are built with validated params (``get_task``).
"""

from __future__ import annotations

import hashlib
import operator
import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from hacrl_fed.config import BuildError
from hacrl_fed.tasks.loader import resolve_task_class
from hacrl_fed.types import Prompt

SPLITS = ("train", "test")


class TaskParams(BaseModel):
    """Base of every task's params model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Task(ABC):
    """A prompt source plus its verifier. Subclasses set ``Params`` and implement the abstract methods."""

    Params: ClassVar[type[TaskParams]] = TaskParams
    name: str = ""
    in_memory: ClassVar[bool] = False  # every prompt is held in memory: cheap to scan all (e.g. prompt lengths)

    def __init__(self, params: TaskParams, seed: int = 0) -> None:
        self.params = params
        self.seed = int(seed)

    @abstractmethod
    def size(self, split: str) -> int:
        """Number of prompt ids in ``split``; valid ids are ``range(size)``."""

    @abstractmethod
    def prompts(self, split: str, ids: Sequence[int]) -> list[Prompt]:
        """The prompts for ``ids`` of ``split``, in order (same ids → same prompts)."""

    @abstractmethod
    def verify(self, response: str, reference: str) -> float:
        """Reward of ``response`` against ``reference``, in ``[0, 1]``; 0.0 for anything unparseable."""

    def sft_target(self, split: str, prompt_id: int) -> str:
        """A correct worked response for ``prompt_id``; tasks without one raise NotImplementedError."""
        raise NotImplementedError(f"task {self.name!r} has no supervised targets")

    def slice_label(self, split: str, prompt_id: int) -> str | None:
        """The named slice ``prompt_id`` belongs to, for per-slice evaluation; None (the default): no slices."""
        return None

    def check_ids(self, split: str, ids: Sequence[int]) -> list[int]:
        """Validate ``split`` and every id (an int in ``range(size(split))``); returns the ids as ints."""
        n = self.size(check_split(split))
        out = []
        for i in ids:
            try:
                if isinstance(i, bool):
                    raise TypeError
                i = operator.index(i)
            except TypeError:
                raise ValueError(f"task {self.name!r}: prompt id {i!r} is not an integer") from None
            if not 0 <= i < n:
                raise ValueError(f"task {self.name!r}: prompt id {i} out of range for split {split!r} (size {n})")
            out.append(i)
        return out


TASKS: dict[str, type[Task]] = {}


def register_task(name: str, cls: type[Task] | None = None) -> Any:
    """Register ``cls`` under ``name``; usable directly or as a class decorator (``@register_task("x")``)."""

    def add(c: type[Task]) -> type[Task]:
        if not (isinstance(c, type) and issubclass(c, Task)):
            raise TypeError(f"register_task({name!r}): {c!r} is not a Task subclass")
        if name in TASKS and TASKS[name] is not c:
            raise ValueError(f"task name {name!r} is already registered to {TASKS[name].__name__}")
        c.name = name
        TASKS[name] = c
        return c

    return add if cls is None else add(cls)


def get_task(name: str, params: dict[str, Any] | None = None, *, seed: int = 0) -> Task:
    """Build the task ``name`` (a registered name, an import path ``package.module:ClassName`` or a
    ``hacrl_fed.tasks`` entry point: :mod:`hacrl_fed.tasks.loader`) with ``params`` validated by its ``Params``.

    Every problem is a :class:`~hacrl_fed.config.BuildError` (a ``ValueError``): one naming ``task.name`` for an
    unknown task (listing the known ones), a bad import path or an object that is not a Task,
    ``task.params.<field>`` for each bad param, or whatever the task's constructor found (a data file by name and
    line, a missing optional package). The built task's ``name`` is ``name`` as given (what plans carry).
    """
    cls: type[Task] = resolve_task_class(name, TASKS, Task)
    if params is not None and not isinstance(params, dict):
        raise BuildError(f"task.params: must be a mapping, got {type(params).__name__}")
    try:
        validated = cls.Params.model_validate(params or {})
    except ValidationError as err:
        raise BuildError(_format_param_errors(name, err)) from None
    try:
        task = cls(validated, seed=seed)
    except BuildError:
        raise
    except (ValueError, OSError, ImportError) as err:  # the task's own checks, its files, its optional package
        message = str(err)
        raise BuildError(message if message.startswith("task") else f"task {name!r}: {message}") from err
    task.name = name
    return task


def _format_param_errors(name: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        parts.append(f"task.params.{loc}: {e['msg']}" if loc else f"task.params: {e['msg']}")
    return f"invalid params for task {name!r}: " + "; ".join(parts)


def check_split(split: str) -> str:
    """Return ``split`` if it is ``"train"`` or ``"test"``, else raise ValueError."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of ``parts`` (their ``str`` joined by NUL) that is stable across processes and runs."""
    data = "\x00".join(str(p) for p in parts).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


# ---------------------------------------------------------------------------------------------- extraction

_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\uff0d": "-", "\u2012": "-", "\u2013": "-", "\ufe63": "-"})
# A number: optional sign (only when not preceded by a word char / closing bracket, so "53-93" gives 93),
# digits with optional thousands commas, optional decimal part.
NUMBER_RE = re.compile(
    r"(?:(?<![\w)\]}])(?P<sign>[-+])\s?)?(?<![\d.])(?P<int>\d{1,3}(?:,\d{3})+(?!\d|,\d)|\d+)(?P<frac>\.\d+)?"
)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)", re.IGNORECASE)


def normalize_minus(text: str) -> str:
    """Map unicode minus/dash variants to ASCII ``-``."""
    return text.translate(_MINUS_SIGNS)


def number_strings(text: str) -> list[str]:
    """Every number in ``text`` as a canonical string (sign kept, commas removed).

    ``"x=-1,234.5"`` → ``["-1234.5"]``.
    """
    out = []
    for m in NUMBER_RE.finditer(text):
        sign = "-" if m.group("sign") == "-" else ""
        out.append(sign + m.group("int").replace(",", "") + (m.group("frac") or ""))
    return out


def last_boxed(text: str, max_tries: int = 4) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces kept; None if none.

    Only the last ``max_tries`` openings are tried, so pathological text stays linear in its length.
    """
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts[-max_tries:]):
        depth = 1
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def after_last_marker(text: str, marker: str = "####") -> str | None:
    """The text after the last ``marker`` up to the end of that line, stripped; None without a marker."""
    pos = text.rfind(marker)
    if pos < 0:
        return None
    return text[pos + len(marker) :].split("\n", 1)[0].strip()


def after_answer_is(text: str, width: int = 64) -> str | None:
    """Up to ``width`` characters after the last "answer is" / "answer:" / "answer =" (any case); None if absent."""
    matches = list(_ANSWER_IS_RE.finditer(text))
    if not matches:
        return None
    end = matches[-1].end()
    return text[end : end + width].strip()


def strip_trailing_period(text: str) -> str:
    """``"42."`` → ``"42"`` (also drops trailing spaces)."""
    return text.rstrip().rstrip(".").rstrip()
