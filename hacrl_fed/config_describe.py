"""What every config field means, and what a config file resolves to (the ``hacrl-fed config`` command,
:mod:`hacrl_fed.cli.config`):

- ``hacrl-fed config --describe``: every section and field of the run config (:mod:`hacrl_fed.config`) with its
  type, constraints, default and description.
- ``hacrl-fed config --describe --config RUN.yaml [--set key=value ...]``: the same, with each field's resolved
  value in that config (``*`` marks a value other than the default; per-org values are listed by org).
- ``hacrl-fed config --config RUN.yaml [--set key=value ...]``: the resolved, validated config as YAML.
"""

from __future__ import annotations

import enum
import textwrap
import types
import typing
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from hacrl_fed.config import RunConfig, org_generation, org_trainer

WIDTH = 100
_UNSET = object()
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _type_name(tp: Any) -> str:
    """A short readable name of a field's annotation: ``float``, ``hf | vllm``, ``int | null``, ``list[str] | str``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "section"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(str(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _constraints(info: FieldInfo) -> list[str]:
    out = []
    for meta in info.metadata:
        for attr, sign in _BOUNDS:
            if getattr(meta, attr, None) is not None:
                out.append(f"{sign} {getattr(meta, attr)}")
        if getattr(meta, "min_length", None) is not None:
            out.append(f"length >= {meta.min_length}")
        if getattr(meta, "max_length", None) is not None:
            out.append(f"length <= {meta.max_length}")
        if getattr(meta, "pattern", None) is not None:
            out.append(f"matches {meta.pattern}")
    return out


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        value = list(value)
    return str(value) if not isinstance(value, str) else (value or '""')


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    return _show(info.get_default(call_default_factory=True))


def _section_model(info: FieldInfo) -> type[BaseModel] | None:
    """The section model of a field that holds one (``trainer``, ``trainer.lora``) or a list of them (``orgs``)."""
    tp = info.annotation
    if typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def iter_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> Iterator[tuple[str, FieldInfo, bool]]:
    """``(dotted name, field, is_section)`` for every field of ``model``, depth first; ``orgs`` items as ``orgs[]``."""
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        sub = _section_model(info)
        yield dotted, info, sub is not None
        if sub is not None:
            yield from iter_fields(sub, f"{dotted}[]." if typing.get_origin(info.annotation) is list else f"{dotted}.")


def _value(cfg: RunConfig, dotted: str) -> Any:
    """The resolved value of ``dotted`` in ``cfg``; for ``orgs[].x`` a ``{org: value}`` dict, with the run's
    ``trainer`` / ``generation`` sections merged with each org's overrides where those apply."""
    if dotted.startswith("orgs[]."):
        rest = dotted.removeprefix("orgs[].")
        return {o.id: _walk(o, rest) for o in cfg.orgs}
    return _walk(cfg, dotted)


def _walk(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        node = getattr(node, part, _UNSET)
        if node is _UNSET:
            return _UNSET
    return node


def _per_org(cfg: RunConfig, dotted: str) -> dict[str, Any] | None:
    """For a ``trainer.*`` / ``generation.*`` field: each org's effective value when some org overrides it."""
    section, _, rest = dotted.partition(".")
    if section not in ("trainer", "generation") or not rest:
        return None
    merge = org_trainer if section == "trainer" else org_generation
    values = {o.id: _walk(merge(cfg, o.id), rest) for o in cfg.orgs}
    base = _walk(getattr(cfg, section), rest)
    return values if any(v != base for v in values.values()) else None


def describe(cfg: RunConfig | None = None, width: int = WIDTH) -> str:
    """The field reference (module docstring); with ``cfg``, each field's resolved value too."""
    lines: list[str] = []
    root_doc = " ".join((RunConfig.__doc__ or "").split())
    lines.append(f"run config ({root_doc})" if root_doc else "run config")
    for dotted, info, is_section in iter_fields():
        desc = info.description or ""
        depth = dotted.count(".")
        indent = "  " * (depth + 1)
        if is_section:
            lines.append("")
            lines.append(f"{indent[2:]}{dotted}: {desc}")
            continue
        head = (
            f"{indent}{dotted}  ({', '.join([_type_name(info.annotation), *_constraints(info)])})  "
            f"default {_default(info)}"
        )
        lines.append(head)
        if cfg is not None:
            value = _value(cfg, dotted)
            per_org = _per_org(cfg, dotted)
            if isinstance(value, dict) and dotted.startswith("orgs[]."):
                shown = ", ".join(f"{org}: {_show(v)}" for org, v in value.items())
                lines.append(f"{indent}  = {shown}")
            elif value is not _UNSET:
                mark = "*" if not info.is_required() and value != info.get_default(call_default_factory=True) else ""
                lines.append(f"{indent}  = {_show(value)}{mark}")
            if per_org is not None:
                lines.append(f"{indent}  per org: " + ", ".join(f"{o}: {_show(v)}" for o, v in per_org.items()))
        lines.extend(
            textwrap.wrap(desc, width=width, initial_indent=indent + "    ", subsequent_indent=indent + "    ")
        )
    return "\n".join(lines)
