"""Typed run configuration (pydantic), loaded from YAML by :func:`load_config`.

Every section forbids unknown keys, so a typo fails loudly with the dotted field name (``trainer.lr``).

One module per section group, each name importable from here:

- :mod:`~hacrl_fed.config.algorithm`: ``algorithm``.
- :mod:`~hacrl_fed.config.trainer`: ``trainer`` with ``selection``, ``likelihood_screen``, ``outcome_guard``,
  ``lora``.
- :mod:`~hacrl_fed.config.generation`: ``generation``; :mod:`~hacrl_fed.config.task`: ``task``.
- :mod:`~hacrl_fed.config.orgs`: ``orgs`` with ``model`` and ``sharding``.
- :mod:`~hacrl_fed.config.federation`: ``federation``; :mod:`~hacrl_fed.config.security`: ``security``.
- :mod:`~hacrl_fed.config.run`: the run config (with ``wandb``), its cross-field checks, per-org merges and hash.
- :mod:`~hacrl_fed.config.load`: YAML loading and dotted overrides; :mod:`~hacrl_fed.config.errors`: the errors
  and how commands report them; :mod:`~hacrl_fed.config.section`: what every section shares.
"""

from hacrl_fed.config.algorithm import AlgorithmConfig
from hacrl_fed.config.errors import BuildError, ConfigError, report_error
from hacrl_fed.config.federation import FederationConfig
from hacrl_fed.config.generation import GenerationConfig
from hacrl_fed.config.load import load_config, parse_overrides
from hacrl_fed.config.orgs import ModelConfig, OrgConfig, ShardingConfig
from hacrl_fed.config.run import (
    RunConfig,
    SamplesConfig,
    WandbConfig,
    config_hash,
    org_generation,
    org_trainer,
)
from hacrl_fed.config.security import SecurityConfig
from hacrl_fed.config.task import TaskConfig
from hacrl_fed.config.trainer import (
    DEFAULT_BUDGET_MULTIPLE,
    DEFAULT_BUDGET_SPLIT,
    LikelihoodScreenConfig,
    LoraConfig,
    OutcomeGuardConfig,
    SelectionConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig",
    "BuildError",
    "ConfigError",
    "DEFAULT_BUDGET_MULTIPLE",
    "DEFAULT_BUDGET_SPLIT",
    "FederationConfig",
    "GenerationConfig",
    "LikelihoodScreenConfig",
    "LoraConfig",
    "ModelConfig",
    "OrgConfig",
    "OutcomeGuardConfig",
    "RunConfig",
    "SecurityConfig",
    "SelectionConfig",
    "ShardingConfig",
    "TaskConfig",
    "TrainerConfig",
    "SamplesConfig",
    "WandbConfig",
    "config_hash",
    "load_config",
    "org_generation",
    "org_trainer",
    "parse_overrides",
    "report_error",
]
