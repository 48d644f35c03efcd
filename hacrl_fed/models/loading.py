"""Load any causal LM + tokenizer (local dir, hub id, or a ``zoo:`` agent) for one organization's worker.

Conventions every caller relies on:
- the tokenizer pads on the **left** and always has a pad token (its own, else EOS, else a new ``<pad>``);
- the model is returned in **eval mode** (dropout off). HACPO's log-prob ratios compare the same sequence under
  two forward passes, so dropout would bias them: the trainer keeps eval mode for its updates too, except for
  LoRA adapters' own dropout (``trainer.lora.dropout``) during the update's forward passes;
- ``for_training=False`` additionally freezes every parameter (``requires_grad=False``), e.g. for a frozen
  KL reference copy.
``HF_HUB_OFFLINE=1`` (set in tests) makes every load local-only; nothing here downloads unless the hub is allowed.
Every problem with what the config names (device, dtype, a missing folder, a model or tokenizer transformers cannot
load, a tokenizer of another model) raises :class:`~hacrl_fed.config.BuildError` naming the field; loading never
trains (a zoo agent whose shipped weights are stale fails with the command that rebuilds it).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hacrl_fed.config import BuildError, ModelConfig
from hacrl_fed.models.catalog import resolve_zoo
from hacrl_fed.models.real import gguf_source, real_source

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(spec: str = "auto") -> torch.device:
    """``"auto"`` → ``cuda`` if available else ``cpu``; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` are checked to exist."""
    s = str(spec).strip().lower()
    if s == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if s == "cpu":
        return torch.device("cpu")
    if s == "cuda" or s.startswith("cuda:"):
        index = s.partition(":")[2]
        if index and not index.isdigit():
            raise BuildError(f"model.device={spec!r}: cuda index must be an integer (cuda:0)")
        if not torch.cuda.is_available():
            raise BuildError(f"model.device={spec!r} but CUDA is not available on this machine (use auto or cpu)")
        if index and int(index) >= torch.cuda.device_count():
            raise BuildError(f"model.device={spec!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
        return torch.device(s)
    raise BuildError(f"model.device={spec!r} not understood; expected auto, cpu, cuda or cuda:N")


def resolve_dtype(spec: str = "auto", device: torch.device | str = "cpu") -> torch.dtype:
    """``"auto"`` → bfloat16 on a CUDA device that supports it, else float32; explicit names are honoured.

    Accepted names: float32/fp32, bfloat16/bf16, float16/fp16/half.
    """
    s = str(spec).strip().lower()
    if s == "auto":
        dev = torch.device(device)
        if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if s in _DTYPES:
        return _DTYPES[s]
    raise BuildError(f"model.dtype={spec!r} not understood; expected auto, float32, bfloat16 or float16")


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a truthy value."""
    values = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(v.strip().lower() in ("1", "true", "yes", "on") for v in values)


def _looks_local(source: str) -> bool:
    return source.startswith(("/", ".", "~")) or source.count("/") > 1 or "\\" in source


def _check_source(source: str, field: str) -> str:
    """Expand ``~``; a path-looking source must exist. Hub ids (``org/name``) pass through."""
    path = Path(source).expanduser()
    if path.exists():
        return str(path)
    if _looks_local(source):
        raise BuildError(f"{field}={source!r}: no such file or directory")
    return source


def model_field(model_cfg: ModelConfig) -> str:
    """The field that names the model: ``model.zoo``, ``model.real`` or ``model.path``."""
    return "model.zoo" if model_cfg.zoo is not None else "model.real" if model_cfg.real is not None else "model.path"


def model_sources(model_cfg: ModelConfig) -> tuple[str, str]:
    """``(model_source, tokenizer_source)``; a zoo agent (``zoo: NAME`` or ``path: "zoo:NAME"``) resolves to a
    local dir: the shipped copy, or a cached build of the current recipe (never built here: a stale or missing
    agent is a :class:`BuildError` naming the command that builds it). A packaged checkpoint (``real: NAME``) or a
    ``.gguf`` path resolves to its converted HF folder, converted on first use (:mod:`hacrl_fed.models.real`)."""
    zoo_name = model_cfg.zoo
    if zoo_name is None and str(model_cfg.path).startswith("zoo:"):
        zoo_name = str(model_cfg.path)
    if zoo_name is not None:
        model_src = str(resolve_zoo(zoo_name))
    elif model_cfg.real is not None:
        model_src = str(real_source(model_cfg.real))
    elif str(model_cfg.path).lower().endswith(".gguf"):
        model_src = str(gguf_source(str(model_cfg.path)))
    else:
        model_src = _check_source(str(model_cfg.path), "model.path")
    if model_cfg.tokenizer is not None:
        return model_src, _check_source(model_cfg.tokenizer, "model.tokenizer")
    return model_src, model_src


def _first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's text (transformers' messages run over several lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def ensure_pad_token(tokenizer) -> bool:
    """Give the tokenizer a pad token (EOS if it has one, else a new ``<pad>``); returns True iff one was added."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is not None:
        return False
    if tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
        return False
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    return True


def load_tokenizer(source: str, *, trust_remote_code: bool = False):
    """AutoTokenizer from ``source`` with left padding and a pad token (see :func:`ensure_pad_token`)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, local_files_only=hub_offline())
    except (OSError, ValueError) as err:
        raise BuildError(
            f"could not load tokenizer from {source!r} (offline={hub_offline()}): {_first_line(err)}"
        ) from err
    ensure_pad_token(tok)
    return tok


def _fit_embeddings(model, tokenizer, source: str) -> None:
    """Grow the embeddings by one row when :func:`ensure_pad_token` appended ``<pad>``; other mismatches error."""
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) <= rows:
        return
    if len(tokenizer) == rows + 1 and tokenizer.pad_token_id == rows:
        model.resize_token_embeddings(len(tokenizer))
        return
    raise BuildError(
        f"tokenizer has {len(tokenizer)} tokens but the model at {source!r} embeds only {rows}: "
        "model.tokenizer does not belong to this model"
    )


def load_model_and_tokenizer(model_cfg: ModelConfig, *, for_training: bool = True):
    """Load ``(model, tokenizer)`` for ``model_cfg`` on its device and dtype, in eval mode.

    Devices/dtypes follow :func:`resolve_device` / :func:`resolve_dtype` (so fp16-shipped zoo weights load as
    float32 on CPU). Raises :class:`BuildError` (a ``ValueError``) for a missing local path, a bad device/dtype
    string, a source transformers cannot load, or a tokenizer that does not belong to the model.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per weight file load is noise in a long-lived worker

    device = resolve_device(model_cfg.device)
    dtype = resolve_dtype(model_cfg.dtype, device)
    model_src, tok_src = model_sources(model_cfg)
    field = model_field(model_cfg)
    try:
        tokenizer = load_tokenizer(tok_src, trust_remote_code=model_cfg.trust_remote_code)
    except BuildError as err:
        raise BuildError(f"{'model.tokenizer' if model_cfg.tokenizer is not None else field}: {err}") from err
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_src,
            dtype=dtype,
            trust_remote_code=model_cfg.trust_remote_code,
            local_files_only=hub_offline(),
        )
    except (OSError, ValueError, SafetensorError) as err:  # SafetensorError: a weights file that is not one
        raise BuildError(
            f"{field}: could not load model from {model_src!r} (offline={hub_offline()}): {_first_line(err)}"
        ) from err
    _fit_embeddings(model, tokenizer, model_src)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config.eos_token_id is None and tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id  # never replaces the model's own stop ids
    model.to(device)  # type: ignore[arg-type]  # transformers types .to() through a decorator mypy misreads
    model.eval()
    if not for_training:
        model.requires_grad_(False)
    return model, tokenizer
