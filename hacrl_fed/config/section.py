"""What every config section shares: the base model (unknown keys and inf/nan refused), the one-paragraph field
description, and the check that a name is in a registry (the registries are the one place their names are written).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)  # no inf/nan anywhere
    # fields this section no longer has -> what replaced each (the fixed behaviour, or where the knob lives now): a
    # config that still sets one fails with one line naming it (:func:`_refuse_removed`)
    removed_fields: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        return _refuse_removed(data, cls.removed_fields)


def _d(text: str) -> str:
    """A field description: one paragraph, whitespace folded (rendered by ``hacrl-fed config --describe``)."""
    return " ".join(text.split())


def _refuse_bench_only(data: Any, fields: Mapping[str, str]) -> Any:
    """``data`` (a section's input) unchanged, or ValueError naming the first of ``fields`` (name -> where the
    benchmark tools set it now) that it names: a benchmark-only setting, out of the run config since issue 42."""
    for name, where in fields.items():
        if isinstance(data, Mapping) and name in data:
            raise ValueError(f"{name} is a benchmark-only setting, not a run config field (issue 42): {where}")
    return data


def _refuse_removed(data: Any, fields: Mapping[str, str]) -> Any:
    """``data`` (a section's input) unchanged, or ValueError naming the first of ``fields`` (name -> what replaced
    it) that it sets: a field removed from the run config (issue 42: no default path, no paper form and no measured
    win used it)."""
    for name, now in fields.items():
        if isinstance(data, Mapping) and name in data:
            raise ValueError(f"{name} was removed from the run config (issue 42): {now}")
    return data


def _registered(name: str, registry: Collection[str]) -> str:
    """``name`` when ``registry`` (a registry's names: the one place they are written) holds it; else the error a
    ``Literal`` of those names gives (``Input should be 'a', 'b' or 'c'``)."""
    if name in registry:
        return name
    quoted = [repr(n) for n in registry]
    expected = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
