"""What a worker would refuse at start-up, checked without loading any weights: for entry points whose workers start
elsewhere (the Flower Simulation Engine's ClientApp, a local deployment's worker processes), so a bad config stops
the command at once with one line and exit code 2 instead of failing every round.

:func:`preflight` builds the task (``task.*``: unknown name, bad params, an unreadable or malformed data file), and
for each org resolves its model source (``model.path`` / ``model.zoo``: a missing folder, a stale zoo agent), loads
its tokenizer and its model config (no weights), and checks that the task's prompts fit the model's context with
the org's token budgets (:mod:`hacrl_fed.models.context`). Every problem is a :class:`~hacrl_fed.config.BuildError`
naming the org and the field or file.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from hacrl_fed.config import BuildError, RunConfig, org_generation


def _org_error(org_id: str, err: BuildError) -> BuildError:
    text = str(err)
    return err if text.startswith(f"org {org_id!r}:") else BuildError(f"org {org_id!r}: {text}")


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


def preflight(cfg: RunConfig, org_ids: Sequence[str] | None = None) -> None:
    """Raise :class:`BuildError` for the first problem a worker of ``org_ids`` (default: every org) would refuse
    at start-up (module docstring). Loads tokenizers and model configs, never weights."""
    from hacrl_fed.models.context import check_task_fits, context_length
    from hacrl_fed.models.loading import load_tokenizer, model_field, model_sources
    from hacrl_fed.models.prompting import style_of
    from hacrl_fed.plan.sampler import eval_ids
    from hacrl_fed.tasks import get_task

    task = get_task(cfg.task.name, cfg.task.params, seed=cfg.seed)
    held_out = eval_ids(task.size("test"), cfg.task.eval_size)
    for org_id in org_ids if org_ids is not None else [o.id for o in cfg.orgs]:
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
