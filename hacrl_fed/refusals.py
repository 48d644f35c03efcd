"""Combinations of settings a worker refuses, each rule stated once: the worker (or a sharded org's rank) calls its
rule where it would fail, and the coordinator's preflight (:mod:`hacrl_fed.preflight`) calls the same function before
any worker starts, so that ``hacrl-fed run`` (in process or ``--transport grpc``), ``hacrl-fed simulate`` and
``hacrl-fed deploy-local`` stop at once with one line naming the field (``orgs[0].trainer.outcome_guard.enabled``)
and exit code 2.

* :func:`check_sharded_org`: what an org with ``sharding.ranks > 1`` cannot run (the ``vllm`` engine,
  ``trainer.precision: bf16-master``, the outcome guard);
* :func:`check_precision`: ``trainer.precision`` against the dtype of the weights it trains;
* :func:`check_vllm_kwargs`: ``generation.vllm_kwargs`` may not repeat an argument the vllm engine sets;
* :func:`require_peft`: ``trainer.lora.enabled`` needs peft installed.

The transports' own refusals (:func:`hacrl_fed.sharded.group.check_in_process`,
:func:`hacrl_fed.config.refuse_emulated_slowdown`) and the model's device and dtype
(:func:`hacrl_fed.models.loading.resolve_device`, :func:`~hacrl_fed.models.loading.resolve_dtype`) are rules of
their own modules that the preflight calls too. Every refusal is a :class:`~hacrl_fed.config.ConfigError`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from hacrl_fed.config import ConfigError, RunConfig, org_generation, org_trainer


def org_field(cfg: Any, org_id: str, path: str) -> str:
    """``orgs[<index>].<path>``: where ``org_id``'s own setting of ``path`` goes (``trainer.outcome_guard.enabled``)."""
    index = [o.id for o in cfg.orgs].index(org_id)
    return f"orgs[{index}].{path}"


def check_sharded_org(cfg: RunConfig, org_id: str) -> None:
    """ConfigError naming the field when org ``org_id`` has ``sharding.ranks > 1`` and a setting that cannot run
    over ranks: the ``vllm`` engine, ``trainer.precision: bf16-master``, ``trainer.outcome_guard`` (on by default)."""
    ranks = cfg.org(org_id).sharding.ranks
    if ranks <= 1:
        return
    gen, trainer = org_generation(cfg, org_id), org_trainer(cfg, org_id)
    ranks_at = f"{org_field(cfg, org_id, 'sharding.ranks')}={ranks} (org {org_id!r})"
    if gen.engine == "vllm":
        raise ConfigError(
            f"{org_field(cfg, org_id, 'generation.engine')}=vllm with {ranks_at} is not supported (vLLM tensor "
            "parallelism over the org's ranks is not implemented): use generation.engine hf or fast, or ranks: 1"
        )
    if trainer.precision == "bf16-master":
        raise ConfigError(
            f"{org_field(cfg, org_id, 'trainer.precision')}=bf16-master with {ranks_at} is not supported: the shards "
            "are the float32 masters; use trainer.precision: model with sharding.mixed_precision: bf16"
        )
    if trainer.outcome_guard.enabled:
        field = org_field(cfg, org_id, "trainer.outcome_guard.enabled")
        raise ConfigError(
            f"{field}=true (on by default) with {ranks_at} is not supported: the guard's validation, rollback and "
            f"shadow work on one process's weights; use ranks: 1 or set {field}: false (SECURITY.md: what that org "
            "then lacks)"
        )


def check_precision(precision: str, dtypes: Sequence[str], field: str = "trainer.precision") -> None:
    """ConfigError when ``precision`` (``field``) cannot train weights of ``dtypes`` (``["float32"]``):
    ``bf16-autocast`` keeps float32 weights, ``bf16-master`` trains bfloat16 weights against float32 masters;
    ``model`` takes any."""
    dtypes = sorted(set(dtypes))
    if precision == "bf16-autocast" and dtypes not in ([], ["float32"]):
        raise ConfigError(
            f"{field}=bf16-autocast keeps float32 weights but the model's trainable weights are {dtypes}: set "
            "model.dtype: float32"
        )
    if precision == "bf16-master" and dtypes not in ([], ["bfloat16"]):
        raise ConfigError(
            f"{field}=bf16-master trains bfloat16 weights against float32 masters but the model's trainable "
            f"weights are {dtypes}: set model.dtype: bfloat16"
        )


def check_vllm_kwargs(
    extra: Collection[str], engine_sets: Collection[str], field: str = "generation.vllm_kwargs"
) -> None:
    """ConfigError when ``extra`` (the keys of ``generation.vllm_kwargs``) repeats an argument of ``vllm.LLM`` that
    the engine sets itself (``engine_sets``: :func:`hacrl_fed.engines.vllm.engine_argument_names`)."""
    clash = sorted(set(extra) & set(engine_sets))
    if clash:
        raise ConfigError(
            f"{field} may not set {clash}: the engine sets them (use the matching generation.* field where there is "
            "one)"
        )


def require_peft(field: str = "trainer.lora.enabled") -> None:
    """ConfigError when ``trainer.lora.enabled`` cannot be served: peft is not installed."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"{field}=true needs peft: pip install 'hacrl-fed[lora]'")
