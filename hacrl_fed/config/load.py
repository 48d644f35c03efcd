"""Loading a run config: YAML (duplicate keys refused) or a dict, dotted ``--set`` overrides, validation with
errors that name the field.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from hacrl_fed.config.errors import ConfigError, _format_errors
from hacrl_fed.config.run import RunConfig
from hacrl_fed.unique_yaml import DuplicateKey, load_unique


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


_OVERRIDE_SPLIT = re.compile(r"[\s,]+(?=[A-Za-z_][\w.-]*=)")


def parse_overrides(items: list[str] | str | None) -> dict[str, Any]:
    """``["federation.rounds=3", "trainer.lr=1e-5"]`` (or one space/comma-separated string) → dotted dict.

    Values are parsed as YAML scalars, so ``3`` is an int and ``true`` a bool.
    """
    if not items:
        return {}
    if isinstance(items, str):  # split only before the next "key=", so values like [1, 2] stay whole
        items = [p for p in _OVERRIDE_SPLIT.split(items.strip()) if p]
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        try:
            out[key] = load_unique(raw)
        except DuplicateKey as err:
            raise ConfigError(f"override {key!r}: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"override {key!r}: value {raw!r} is not a YAML scalar or list: {err}") from None
    return out


def load_config(source: str | Path | dict[str, Any], overrides: dict[str, Any] | list[str] | None = None) -> RunConfig:
    """Load and validate a run config from a YAML path (or an already-parsed dict).

    ``overrides`` are dotted keys applied before validation (``{"federation.rounds": 3}``).
    Raises :class:`ConfigError` whose message names every bad field (``trainer.lr: ...``).
    """
    if isinstance(source, dict):
        data = copy.deepcopy(source)  # overrides write into nested sections: never the caller's
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = load_unique(path.read_text()) or {}  # e.g. security.roster listing one org twice is refused
        except DuplicateKey as err:
            raise ConfigError(f"{path}: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
