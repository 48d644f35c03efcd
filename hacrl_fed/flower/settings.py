"""The Flower app's own settings: read from the run config, shared by the ServerApp and the ClientApp.

Keys (``[tool.flwr.app.config]`` in ``pyproject.toml``, or ``flwr run . -c 'key=value'``):

* ``config-path`` (str): the hacrl-fed YAML run config; relative paths resolve against the current directory,
  then against the app directory (the one holding ``server/`` and ``client/``).
* ``overrides`` (str): space-separated ``section.field=value`` overrides of that YAML.
* ``run-dir`` (str): where the coordinator writes metrics and checkpoints; "" = ``<run_dir>/<name>`` of the YAML.
* ``resume`` (bool): continue the run found in ``run-dir``.
* ``worker-factory`` (str, simulation only): ``module:callable`` building an in-process worker with
  :func:`hacrl_fed.worker.build_worker`'s signature (tests pass fakes here); "" = ``build_worker``.
* ``discovery-timeout`` (float seconds): how long the ServerApp waits for the orgs' nodes; 0 = the YAML's
  ``federation.round_timeout_s``.
* ``reply-poll`` (float seconds, default 0.1, at most 10): the ServerApp's longest wait between two pulls of
  replies from the SuperLink (:func:`hacrl_fed.flower.transport.exchange`); a reply waits at most this long to
  be noticed, at one cheap pull per ``reply-poll`` while the orgs work.

``flwr.simulation.run_simulation`` (behind ``hacrl-fed simulate``) has no way to pass a run config in flwr 1.42:
both apps see an empty ``context.run_config``. :func:`hacrl_fed.flower.simulation.simulate` therefore puts
the same keys, JSON-encoded, in the environment variable :data:`ENV_VAR` before Ray starts (Ray's worker
processes inherit the driver's environment); values found there override the run config's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config module costs ~20 ms to import, paid by every deployment ClientApp process otherwise
    from hacrl_fed.config import RunConfig

ENV_VAR = "HACRL_FED_FLOWER_RUN_CONFIG"
DEFAULT_WORKER_FACTORY = "hacrl_fed.worker:build_worker"
REPLY_POLL_S, MAX_REPLY_POLL_S = 0.1, 10.0  # ``reply-poll``: default and bound (seconds)


class SettingsError(ValueError):
    """A bad Flower run-config value (names the key)."""


@dataclass(frozen=True)
class AppSettings:
    config_path: str
    overrides: str = ""
    run_dir: str = ""
    resume: bool = False
    worker_factory: str = ""
    discovery_timeout_s: float = 0.0
    reply_poll_s: float = REPLY_POLL_S


_KEYS: dict[str, tuple[str, type]] = {  # run-config key -> (field, type)
    "config-path": ("config_path", str),
    "overrides": ("overrides", str),
    "run-dir": ("run_dir", str),
    "resume": ("resume", bool),
    "worker-factory": ("worker_factory", str),
    "discovery-timeout": ("discovery_timeout_s", float),
    "reply-poll": ("reply_poll_s", float),
}


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind):
        raise SettingsError(f"run config {key!r}: expected {kind.__name__}, got {type(value).__name__} {value!r}")
    return value


def env_run_config(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The JSON object in :data:`ENV_VAR` (``{}`` when unset)."""
    raw = environ.get(ENV_VAR, "")
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise SettingsError(f"{ENV_VAR}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{ENV_VAR}: expected a JSON object, got {type(data).__name__}")
    return data


def read_settings(run_config: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> AppSettings:
    """:class:`AppSettings` from ``context.run_config`` overlaid with :data:`ENV_VAR`; unknown keys are ignored."""
    merged = {**dict(run_config), **env_run_config(environ)}
    fields = {field: _coerce(key, merged[key], kind) for key, (field, kind) in _KEYS.items() if key in merged}
    if not fields.get("config_path"):
        raise SettingsError("run config 'config-path' is missing or empty (set it in [tool.flwr.app.config])")
    if fields.get("discovery_timeout_s", 0.0) < 0:
        raise SettingsError(f"run config 'discovery-timeout': {fields['discovery_timeout_s']} is negative")
    if not 0 < fields.get("reply_poll_s", REPLY_POLL_S) <= MAX_REPLY_POLL_S:
        raise SettingsError(f"run config 'reply-poll': {fields['reply_poll_s']} is not in (0, {MAX_REPLY_POLL_S:g}] s")
    return AppSettings(**fields)


def to_run_config(settings: AppSettings) -> dict[str, Any]:
    """Inverse of :func:`read_settings`: the run-config dict (JSON-serializable) of ``settings``."""
    return {key: getattr(settings, field) for key, (field, _) in _KEYS.items()}


def resolve_config_path(path: str, app_dir: Path) -> Path:
    """``path`` as given if absolute or present under the cwd, else under ``app_dir``; error if neither exists."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute() or candidate.is_file():
        return candidate
    under_app = app_dir / candidate
    if under_app.is_file():
        return under_app
    raise SettingsError(f"run config 'config-path': {path!r} not found in {Path.cwd()} nor in {app_dir}")


def load_run_config(settings: AppSettings, app_dir: Path) -> RunConfig:
    """The validated hacrl-fed :class:`RunConfig` named by ``settings`` (overrides applied)."""
    from hacrl_fed.config import load_config, parse_overrides

    return load_config(resolve_config_path(settings.config_path, app_dir), parse_overrides(settings.overrides))


def run_dir_of(settings: AppSettings, cfg: RunConfig) -> Path:
    """The run directory: ``run-dir`` if set, else ``<cfg.run_dir>/<cfg.name>``."""
    return Path(settings.run_dir).expanduser() if settings.run_dir else Path(cfg.run_dir) / cfg.name


def discovery_timeout_of(settings: AppSettings, cfg: RunConfig) -> float:
    """Seconds the ServerApp waits for every org's node: ``discovery-timeout`` or the round timeout."""
    return settings.discovery_timeout_s or cfg.federation.round_timeout_s


def check_run_dir(run_dir: Path, resume: bool, keys: Any = None) -> None:
    """As ``hacrl-fed run``: ``resume`` needs a run in ``run_dir``, a fresh run needs none
    (:func:`hacrl_fed.lifecycle.check_run_dir`; the error names ``keys``, by default the CLI's flags)."""
    from hacrl_fed.lifecycle import CLI_KEYS
    from hacrl_fed.lifecycle import check_run_dir as check

    check(run_dir, resume, keys or CLI_KEYS)
