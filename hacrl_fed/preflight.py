"""What a worker would refuse at start-up, checked in the coordinator before any worker starts, without loading any
weights: a bad config stops the command at once with one line naming the field and exit code 2, instead of a
worker (or one rank of a sharded org) failing at start, or every round.

:func:`check_settings` checks the combinations of settings a worker refuses (:mod:`hacrl_fed.refusals`: an org
sharded over ranks with the ``vllm`` engine, ``bf16-master``, or the outcome guard; ``trainer.precision``
against the weights' dtype; ``generation.vllm_kwargs`` repeating the engine's own arguments; LoRA without peft),
the org's ``model.device`` / ``model.dtype`` and a sharded org's ``sharding.backend``, by calling the very
functions the worker calls. It reads the config alone, so ``hacrl-fed run`` (in process and ``--transport grpc``)
calls it for every org whose worker it builds or starts.

:func:`preflight` does that and more, for entry points whose workers start elsewhere (the Flower Simulation
Engine's ClientApp, a local deployment's worker processes): it builds the task (``task.*``: unknown name, bad
params, an unreadable or malformed data file), and for each org resolves its model source (``model.path`` /
``model.zoo``: a missing folder, a stale zoo agent), loads its tokenizer and its model config (no weights), and
checks that the task's prompts fit the model's context with the org's token budgets
(:mod:`hacrl_fed.models.context`). Every problem is a :class:`~hacrl_fed.config.ConfigError` (a
:class:`~hacrl_fed.config.BuildError` for what the config names) naming the org and the field or file.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from hacrl_fed.config import BuildError, ConfigError, RunConfig, org_generation, org_trainer


def _org_error(org_id: str, err: ConfigError) -> ConfigError:
    text = str(err)
    named = text.startswith(f"org {org_id!r}:") or f"(org {org_id!r})" in text
    return err if named else type(err)(f"org {org_id!r}: {text}")


def _render(style: Any, tokenizer: Any, prompt: Any) -> str:
    return style.render(tokenizer, prompt.messages)


def model_config(model_cfg: Any, source: str) -> Any:
    """The transformers config of ``source`` (no weights); :class:`BuildError` naming the field when unreadable."""
    from transformers import AutoConfig

    from hacrl_fed.models.loading import hub_offline, model_field

    field = model_field(model_cfg)
    try:
        return AutoConfig.from_pretrained(
            source, trust_remote_code=model_cfg.trust_remote_code, local_files_only=hub_offline()
        )
    except (OSError, ValueError) as err:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise BuildError(f"{field}: could not load the model config from {source!r}: {first}") from err


def _org_ids(cfg: RunConfig, org_ids: Sequence[str] | None) -> list[str]:
    return list(org_ids) if org_ids is not None else [o.id for o in cfg.orgs]


def check_settings(cfg: RunConfig, org_ids: Sequence[str] | None = None) -> None:
    """Raise :class:`ConfigError` for the first combination of settings the worker of an org of ``org_ids``
    (default: every org) would refuse at start-up (module docstring); reads the config only."""
    for org_id in _org_ids(cfg, org_ids):
        try:
            _check_org_settings(cfg, org_id)
        except ConfigError as err:
            raise _org_error(org_id, err) from err


def _check_org_settings(cfg: RunConfig, org_id: str) -> None:
    from hacrl_fed.models.loading import resolve_device, resolve_dtype
    from hacrl_fed.refusals import check_precision, check_sharded_org, org_field, require_peft

    org, gen, trainer = cfg.org(org_id), org_generation(cfg, org_id), org_trainer(cfg, org_id)
    check_sharded_org(cfg, org_id)
    try:  # their messages start with the field (model.device=...): named here as the org's own
        if org.sharding.ranks > 1:
            from hacrl_fed.sharded.group import resolve_backend

            resolve_backend(org.sharding.backend)
        dtype = resolve_dtype(org.model.dtype, resolve_device(org.model.device))
    except ConfigError as err:
        raise type(err)(f"{org_field(cfg, org_id, str(err))}") from err
    if trainer.lora.enabled:  # the adapters' dtype is peft's choice: the worker checks it once they exist
        require_peft(org_field(cfg, org_id, "trainer.lora.enabled"))
    else:  # the shards of a sharded org with mixed precision are float32 (hacrl_fed.sharded.trainer)
        mixed = org.sharding.ranks > 1 and org.sharding.mixed_precision != "off"
        trained = "float32" if mixed else str(dtype).removeprefix("torch.")
        check_precision(trainer.precision, [trained], org_field(cfg, org_id, "trainer.precision"))
    if gen.engine == "vllm":
        _check_vllm_settings(cfg, org_id)


def _check_vllm_settings(cfg: RunConfig, org_id: str) -> None:
    """The vllm engine's own refusals: its core in another process, ``generation.vllm_kwargs`` repeating one of
    its arguments (the engine's :func:`~hacrl_fed.engines.vllm.llm_arguments`, with the org's settings)."""
    from hacrl_fed.engines.vllm import llm_arguments, require_in_process
    from hacrl_fed.refusals import org_field

    gen = org_generation(cfg, org_id)
    try:
        require_in_process()
    except RuntimeError as err:
        raise ConfigError(f"{org_field(cfg, org_id, 'generation.engine')}=vllm: {err}") from err
    llm_arguments(
        model="",
        tokenizer="",
        dtype=gen.dtype or "bfloat16",
        gpu_memory_utilization=gen.gpu_memory_utilization,
        seed=0,
        max_model_len=gen.max_model_len,
        batch_size=gen.batch_size,
        sleep_level=1 if gen.sleep_during_train else 0,
        extra=dict(gen.vllm_kwargs),
        extra_field=org_field(cfg, org_id, "generation.vllm_kwargs"),
    )


def preflight(cfg: RunConfig, org_ids: Sequence[str] | None = None) -> None:
    """Raise :class:`ConfigError` for the first problem a worker of ``org_ids`` (default: every org) would refuse
    at start-up (module docstring): :func:`check_settings`, then the task, tokenizers and model configs (never
    weights)."""
    check_settings(cfg, org_ids)
    from hacrl_fed.models.context import check_task_fits, context_length
    from hacrl_fed.models.loading import load_tokenizer, model_field, model_sources
    from hacrl_fed.models.prompting import style_of
    from hacrl_fed.plan.sampler import eval_ids
    from hacrl_fed.tasks import get_task

    task = get_task(cfg.task.name, cfg.task.params, seed=cfg.seed)
    held_out = eval_ids(task.size("test"), cfg.task.eval_size)
    for org_id in _org_ids(cfg, org_ids):
        org, gen = cfg.org(org_id), org_generation(cfg, org_id)
        try:
            model_src, tok_src = model_sources(org.model)
            try:
                tokenizer = load_tokenizer(tok_src, trust_remote_code=org.model.trust_remote_code)
            except BuildError as err:
                field = "model.tokenizer" if org.model.tokenizer is not None else model_field(org.model)
                raise BuildError(f"{field}: {err}") from err
            context, source = context_length(
                model_config(org.model, model_src), gen.max_model_len if gen.engine == "vllm" else None
            )
            check_task_fits(
                org_id,
                task,
                tokenizer,
                functools.partial(_render, style_of(org.model, tokenizer, task), tokenizer),
                context,
                source,
                max_new_tokens=gen.max_new_tokens,
                eval_max_new_tokens=gen.eval_max_new_tokens,
                eval_ids=held_out,
            )
        except BuildError as err:
            raise _org_error(org_id, err) from err
