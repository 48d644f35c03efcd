"""The run config (:class:`RunConfig`: every section under one run) and what is computed from a whole config:
the cross-field checks, an org's merged ``trainer`` / ``generation`` sections and the config hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from hacrl_fed.config.algorithm import AlgorithmConfig
from hacrl_fed.config.errors import ConfigError, _format_errors
from hacrl_fed.config.federation import FederationConfig
from hacrl_fed.config.generation import GenerationConfig
from hacrl_fed.config.orgs import OrgConfig
from hacrl_fed.config.section import _d, _Section
from hacrl_fed.config.security import SecurityConfig
from hacrl_fed.config.task import TaskConfig
from hacrl_fed.config.trainer import TrainerConfig


class WandbConfig(_Section):
    """Weights & Biases as a second metrics sink (pip install 'hacrl-fed[wandb]'): the coordinator logs every
    round's metrics with the keys of metrics.jsonl, step = round (hacrl_fed/loggers/wandb.py)."""

    enabled: bool = Field(False, description="log the round metrics to W&B as well")
    project: str = Field("hacrl-fed", min_length=1, description="the W&B project")
    entity: str | None = Field(None, description="the W&B entity (team or user); null = the account's default")
    name: str | None = Field(None, description="the W&B run name; null = the run's name")
    tags: list[str] = Field(default_factory=list, description="tags of the W&B run")
    mode: Literal["online", "offline"] = Field(
        "online", description=_d("offline writes the W&B run under <run dir>/wandb only (upload later: wandb sync)")
    )


class SamplesConfig(_Section):
    """The rollouts each org keeps for the run report (hacrl_fed/worker/samples.py): a seeded sample per round
    of its own rollouts and, as a learner, of the foreign rows it received with what became of each, in
    <run dir>/orgs/<org>/samples.jsonl, written by the org itself (coordinator-blind mode: the coordinator never
    sees the text). How many, the text cut and the file's cap are that module's constants; round t may fill the
    file up to t/rounds of its cap."""

    removed_fields = {
        name: f"a fixed number now, {name.upper()} in hacrl_fed/worker/samples.py"
        for name in ("own_per_round", "foreign_per_round", "max_text_chars", "max_bytes")
    }

    enabled: bool = Field(True, description="keep samples.jsonl per org (shown by hacrl-fed report)")


class RunConfig(_Section):
    """One federated run: its name and seed, the algorithm, the orgs and how rounds run."""

    name: str = Field(
        "run",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$",
        description=_d("the run's name (letters, digits, _ . + -; no path parts): outputs go to <run_dir>/<name>"),
    )
    seed: int = Field(
        0,
        description=_d(
            "the run seed: prompt sampling, the task's held-out problems, and (unless set per org) each org's seed"
        ),
    )
    run_dir: str = Field("runs", description="folder that holds the run folder <run_dir>/<name>")
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="the update rule: HACPO or a baseline"
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="each org's local update")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="each org's sampling")
    task: TaskConfig = Field(default_factory=TaskConfig, description="the prompts and their verifier")
    orgs: list[OrgConfig] = Field(min_length=1, description="the organizations, each with its own model")
    federation: FederationConfig = Field(default_factory=FederationConfig, description="the round loop")
    security: SecurityConfig = Field(default_factory=SecurityConfig, description="trust between the organizations")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases logging (optional)")
    samples: SamplesConfig = Field(default_factory=SamplesConfig, description="rollout samples for the run report")

    @model_validator(mode="after")
    def _unique_orgs(self) -> RunConfig:
        ids = [o.id for o in self.orgs]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate org ids: {dupes}")
        if self.federation.min_orgs > len(self.orgs):
            raise ValueError(f"federation.min_orgs={self.federation.min_orgs} exceeds the {len(self.orgs)} orgs")
        _check_asynchronous(self)
        for org in self.orgs:  # per-org overrides must name real fields with valid values
            org_trainer(self, org.id)
            org_generation(self, org.id)
        return self

    def org(self, org_id: str) -> OrgConfig:
        for o in self.orgs:
            if o.id == org_id:
                return o
        raise KeyError(f"no org {org_id!r} in config (orgs: {[o.id for o in self.orgs]})")


def _deep_update(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in recursively (nested dicts merge; other values replace)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_update(out[key], value)
        else:
            out[key] = value
    return out


def _merged(base: _Section, overrides: dict[str, Any], where: str) -> Any:
    data = _deep_update(base.model_dump(), overrides)
    try:
        return type(base).model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, prefix=where, header="")) from None


def _check_asynchronous(cfg: RunConfig) -> None:
    """What asynchronous rounds (``federation.staleness >= 1``) need in this slice of the driver; each
    refusal names its field (docs/ALGORITHM.md "Asynchronous rounds")."""
    fed = cfg.federation
    unknown = sorted(set(fed.org_rounds) - {o.id for o in cfg.orgs})
    if unknown:
        raise ValueError(f"federation.org_rounds names orgs not in the run: {unknown}")
    if fed.staleness == 0:
        if fed.window is not None and fed.window != 1:
            raise ValueError(f"federation.window={fed.window} needs federation.staleness >= 1 (K = 0: W = 1)")
        if fed.org_rounds:
            raise ValueError("federation.org_rounds needs federation.staleness >= 1 (lock-step orgs run every round)")
        return
    needs = {
        "federation.protocol: fused": fed.protocol == "fused",
        "federation.min_orgs: 1 (each org steps alone)": fed.min_orgs == 1,
    }
    for need, ok in needs.items():
        if not ok:
            raise ValueError(f"federation.staleness={fed.staleness} (asynchronous rounds) needs {need}")


def config_hash(
    cfg: RunConfig,
    *,
    exclude: Collection[str] = ("run_dir",),
    relative_to: Path | None = None,
    digits: int = 8,
    exclude_defaults: bool = False,
) -> str:
    """The project's one config hash: the first ``digits`` hex digits of SHA-256 over the config as sorted JSON.

    ``exclude`` names top-level fields left out (``run_dir`` by default: where a run lives is not what it is);
    with ``relative_to``, absolute ``orgs[].model.path`` / ``.tokenizer`` under that folder are written relative to
    it, so the same config hashes alike in every checkout (the benchmark's cells). ``exclude_defaults``: only the
    fields whose value differs from the schema's default (the benchmark's cells: a field added later with a
    default leaves their hash alone; what the code does with a default is tracked by the commit a cell ran on).
    """
    data = cfg.model_dump(mode="json", exclude=set(exclude), exclude_defaults=exclude_defaults)
    if relative_to is not None:
        for org in data.get("orgs", []):
            for key in ("path", "tokenizer"):
                value = org.get("model", {}).get(key)
                if value and Path(value).is_absolute():
                    try:
                        org["model"][key] = str(Path(value).relative_to(relative_to))
                    except ValueError:
                        pass
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:digits]


def org_trainer(cfg: RunConfig, org_id: str) -> TrainerConfig:
    """The run's trainer section with the org's ``trainer`` overrides applied."""
    return _merged(cfg.trainer, cfg.org(org_id).trainer, f"orgs[{org_id}].trainer")


def org_generation(cfg: RunConfig, org_id: str) -> GenerationConfig:
    """The run's generation section with the org's ``generation`` overrides applied."""
    return _merged(cfg.generation, cfg.org(org_id).generation, f"orgs[{org_id}].generation")
