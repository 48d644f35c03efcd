"""Take a trained model home: one org's checkpoint of a run → a standard ``transformers`` folder.

:func:`export_model` rebuilds the org's model exactly as its worker did (the run's ``config.yaml``: ``model.*``,
``trainer.lora``), loads the chosen checkpoint (``<run dir>/orgs/<org>/checkpoints/<run id>/round-NNNNNN``, the
latest when no round is given) and writes a folder that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` (and vLLM) load offline (a sharded worker's checkpoint, ``dcp/`` shards written
at any number of ranks, is read back whole: :mod:`hacrl_fed.sharded.checkpoint`):

- ``config.json`` + ``model.safetensors``: the weights in the dtype the checkpoint holds (``dtype`` overrides);
  a LoRA run's adapters are **merged** into the base weights (``adapter_only=True`` writes peft's
  ``adapter_config.json`` + ``adapter_model.safetensors`` instead, to load over the base model);
- the tokenizer files with the org's own chat template (``chat_template.jinja``) and the pad token its worker
  used;
- ``generation_config.json``: the org's EOS and pad ids and its sampling settings from the run
  (``generation.temperature`` / ``top_p`` / ``top_k`` / ``max_new_tokens``, per-org overrides applied);
- ``hacrl_export.json``: where it came from (run dir, run id, org, round, checkpoint path, merged or adapter).

Every problem with the arguments (no such run dir, org or round, a run without checkpoints) is a
:class:`~hacrl_fed.config.BuildError` naming the argument.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from hacrl_fed.config import BuildError, RunConfig, load_config, org_generation, org_trainer
from hacrl_fed.models.loading import load_model_and_tokenizer, resolve_dtype
from hacrl_fed.models.lora import wrap_lora
from hacrl_fed.run_files import CONFIG_FILE, INFO_FILE
from hacrl_fed.worker.checkpoint import (
    SHARDED_DIR,
    checkpoint_round,
    checkpoint_weights,
    checkpointed_runs,
    good_checkpoint,
    latest_run,
)
from hacrl_fed.worker.checkpoint_manifest import weight_file

EXPORT_INFO = "hacrl_export.json"
_ROUND_DIR = re.compile(r"^round-(\d{6})$")


def run_config(run_dir: Path) -> RunConfig:
    """The resolved config a run dir records (``config.yaml``); :class:`BuildError` naming ``run_dir``."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise BuildError(f"run_dir: {run_dir} has no {CONFIG_FILE} (not a hacrl-fed run directory)")
    return load_config(path)


def find_checkpoint(run_dir: Path, org_id: str, round: int | None = None) -> tuple[str, Path]:
    """``(run id, checkpoint dir)`` of ``org_id`` in ``run_dir``: the run recorded in ``run_info.json`` (else the
    one checkpointed last), at ``round`` (else its latest checkpoint); :class:`BuildError` naming the argument."""
    base = Path(run_dir) / "orgs" / org_id / "checkpoints"
    runs = checkpointed_runs(base)
    if not runs:
        raise BuildError(f"org: no checkpoints of org {org_id!r} under {base} (the run saves them at its end)")
    info = Path(run_dir) / INFO_FILE
    run_id = json.loads(info.read_text()).get("run_id") if info.is_file() else None
    if run_id not in runs:
        found = latest_run(base)
        assert found is not None
        run_id = found[0]
    root = base / run_id
    if round is None:
        latest = good_checkpoint(root, weight_file)  # the newest whose weights are whole (all it reads)
        assert latest is not None
        return run_id, latest
    path = root / f"round-{int(round):06d}"
    if not path.is_dir():
        have = sorted(int(m.group(1)) for p in root.iterdir() if (m := _ROUND_DIR.match(p.name)))
        raise BuildError(f"round: org {org_id!r} has no checkpoint of round {round} in run {run_id!r}; have {have}")
    return run_id, path


def _checkpoint_dtype(path: Path) -> torch.dtype:
    from safetensors import safe_open

    if not (path / "model.safetensors").is_file() and (path / SHARDED_DIR).is_dir():
        from hacrl_fed.sharded.dcp_files import weights_dtype

        return weights_dtype(path)

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            t = f.get_slice(key)
            dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(t.get_dtype())
            if dtype is not None:
                return dtype
    return torch.float32


def load_trained(cfg: RunConfig, org_id: str, checkpoint: Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of ``org_id`` built as its worker builds them (on CPU) with ``checkpoint``'s weights;
    a LoRA run's model is the peft wrapper (adapters unmerged)."""
    org = cfg.org(org_id)
    model_cfg = org.model.model_copy(update={"device": "cpu", "dtype": "float32"})
    model, tokenizer = load_model_and_tokenizer(model_cfg)
    trainer_cfg = org_trainer(cfg, org_id)
    if trainer_cfg.lora.enabled:
        model = wrap_lora(model, trainer_cfg)
    weights = checkpoint_weights(checkpoint)  # safetensors, or a sharded worker's shards read back whole
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any("lm_head" not in k for k in missing):  # tied heads may be absent
        raise BuildError(
            f"checkpoint {checkpoint} does not match org {org_id!r}'s model: missing={missing[:5]} "
            f"unexpected={unexpected[:5]}"
        )
    if any("lm_head" in k for k in missing) and hasattr(model, "tie_weights"):
        model.tie_weights()
    model.eval()
    return model, tokenizer


def _generation_config(model: Any, tokenizer: Any, cfg: RunConfig, org_id: str) -> Any:
    from transformers import GenerationConfig

    gen = org_generation(cfg, org_id)
    out = GenerationConfig(
        do_sample=True,
        temperature=gen.temperature,
        top_p=gen.top_p,
        top_k=gen.top_k or None,
        max_new_tokens=gen.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=getattr(model.config, "bos_token_id", None),
    )
    return out


def export_model(
    run_dir: str | Path,
    org_id: str,
    out_dir: str | Path,
    *,
    round: int | None = None,
    adapter_only: bool = False,
    dtype: str | None = None,
    overwrite: bool = False,
    config: str | Path | None = None,
    overrides: list[str] | None = None,
) -> Path:
    """Write ``org_id``'s trained model of ``run_dir`` to ``out_dir`` (module docstring); returns ``out_dir``.

    ``dtype``: ``float32`` | ``bfloat16`` | ``float16`` (default: the checkpoint's). ``out_dir`` must not exist
    or be empty unless ``overwrite``. ``config``: the run config, for a run dir without ``config.yaml`` (a worker's
    own run dir on another host).
    """
    run_dir, out = Path(run_dir).absolute(), Path(out_dir).absolute()
    if not run_dir.is_dir():
        raise BuildError(f"run_dir: no such directory: {run_dir}")
    cfg = load_config(config, overrides=overrides) if config is not None else run_config(run_dir)
    if org_id not in [o.id for o in cfg.orgs]:
        raise BuildError(f"org: {org_id!r} is not an org of {run_dir} (orgs: {[o.id for o in cfg.orgs]})")
    lora = org_trainer(cfg, org_id).lora.enabled
    if adapter_only and not lora:
        raise BuildError(f"--adapter-only: org {org_id!r} did not train LoRA adapters (trainer.lora.enabled: false)")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise BuildError(f"out: {out} exists and is not empty (choose another folder or pass --overwrite)")
    run_id, checkpoint = find_checkpoint(run_dir, org_id, round)
    target = resolve_dtype(dtype) if dtype else _checkpoint_dtype(checkpoint)
    model, tokenizer = load_trained(cfg, org_id, checkpoint)
    if lora and not adapter_only:
        model = model.merge_and_unload()
    model = model.to(target)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _generation_config(model, tokenizer, cfg, org_id).save_pretrained(str(out))  # the org's, not the base's
    info = {
        "run_dir": str(run_dir),
        "run_id": run_id,
        "org": org_id,
        "round": checkpoint_round(checkpoint),
        "checkpoint": str(checkpoint),
        "weights": "adapter" if adapter_only else ("merged-lora" if lora else "full"),
        "dtype": str(target).removeprefix("torch."),
        "task": cfg.task.name,
        "config": str(Path(config).absolute()) if config is not None else str(run_dir / CONFIG_FILE),
    }
    (out / EXPORT_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out
