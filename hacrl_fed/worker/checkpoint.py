"""Worker checkpoints: weights (safetensors), optimizer, RNG states (torch, python), round. One directory per round,
one folder of rounds per run.

Layout: ``<ckpt_root>/round-000012/{model.safetensors, trainer.pt, state.json, files/}`` and ``<ckpt_root>/LATEST``
(a sharded worker writes ``dcp/``, its ``torch.distributed.checkpoint`` of weights and optimizer state, in place of
``model.safetensors``; :mod:`hacrl_fed.sharded.checkpoint`)
(the directory name, replaced atomically; it never moves back to an older round). The last ``keep`` checkpoints
(at least two) are kept, and pruning removes only checkpoints older than the one just written, never a newer one.
A checkpoint is staged in ``.tmp-round-NNNNNN``, every file fsynced and listed with its size and SHA-256 in
``manifest.json`` (:mod:`.checkpoint_manifest`), then renamed into place: a kill mid-write leaves only the staging
directory. ``files/`` holds the outcome guard's reference and shadow as links to the guard's own files, not a
second copy (:mod:`.checkpoint_files`), and a tied tensor (Gemma's embedding and head) is written once
(:func:`_untie`). A resume takes :func:`good_checkpoint`, the newest checkpoint whose manifest verifies: a truncated or
corrupt newest one falls back to the one before, with one warning line. A policy worker
keeps each run's checkpoints apart: ``ckpt_root`` is ``<run dir>/orgs/<org>/checkpoints/<run id>``
(:func:`run_checkpoint_root`), so one run never prunes, overwrites or resumes from another run's checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hacrl_fed.fsio import fsync_dir, write_atomic
from hacrl_fed.sharded.dcp_files import SHARDED_DIR
from hacrl_fed.worker.checkpoint_files import place_files, resolve_files
from hacrl_fed.worker.checkpoint_manifest import MANIFEST, checkpoint_problem, write_manifest

log = logging.getLogger(__name__)

# a run id that is a safe directory name; "+" as in run names (RunConfig.name, e.g. qwen3-1.7b+qwen3-4b)
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,199}$")


def run_checkpoint_root(base: Path, run_id: str) -> Path:
    """``<base>/<run id>``: where one run's checkpoints go; ValueError for a run id that is not a plain directory
    name (letters, digits, ``_.+-``, at most 200 characters, not starting with ``.``, ``+`` or ``-``)."""
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise ValueError(f"run id {str(run_id)[:80]!r} is not a plain name (letters, digits, '_', '.', '+', '-')")
    return base / run_id


def checkpointed_runs(base: Path) -> dict[str, Path]:
    """``{run id: its latest checkpoint}`` for every run with a checkpoint under ``base``."""
    out = {}
    for sub in sorted(base.iterdir()) if base.is_dir() else ():
        latest = latest_checkpoint(sub) if sub.is_dir() and RUN_ID.match(sub.name) else None
        if latest is not None:
            out[sub.name] = latest
    return out


def latest_run(base: Path) -> tuple[str, Path] | None:
    """``(run id, newest whole checkpoint)`` (:func:`good_checkpoint`) of the run whose ``LATEST`` was written
    last, or None."""
    runs = checkpointed_runs(base)
    if not runs:
        return None
    run_id = max(runs, key=lambda r: ((base / r / "LATEST").stat().st_mtime_ns, r))
    good = good_checkpoint(base / run_id)
    assert good is not None  # the run has a marker naming a checkpoint directory: good_checkpoint raises otherwise
    return run_id, good


def checkpoint_round(path: Path) -> int:
    """The ``last_round`` recorded in a checkpoint's ``state.json``."""
    return int(json.loads((path / "state.json").read_text())["last_round"])


def checkpoint_version(path: Path) -> int | None:
    """The ``version`` (the worker's updates in its run, signed into its batches in asynchronous rounds) recorded in a
    checkpoint's ``state.json``; None for one written before the field."""
    value = json.loads((path / "state.json").read_text()).get("version")
    return value if type(value) is int and value >= 0 else None


def save_checkpoint(
    root: Path, round: int, model: torch.nn.Module, trainer_state: dict, extra: dict[str, Any], keep: int = 2
) -> Path:
    """Write a checkpoint for ``round`` and point ``LATEST`` at it; returns its directory."""
    tmp = stage_checkpoint(root, round)
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    written, tied = _untie(weights)
    save_file(written, str(tmp / "model.safetensors"), metadata={TIED: json.dumps(tied)} if tied else None)
    return commit_checkpoint(root, round, trainer_state, extra, keep)


def stage_checkpoint(root: Path, round: int) -> Path:
    """The empty staging directory of ``round``'s checkpoint (``root/.tmp-round-NNNNNN``), weights go there first."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-round-{round:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def commit_checkpoint(root: Path, round: int, trainer_state: dict, extra: dict[str, Any], keep: int = 2) -> Path:
    """Write the trainer state, RNG states and ``state.json`` beside the staged weights, move the staging
    directory into place, point ``LATEST`` at it and prune older checkpoints; returns its directory. Files the
    trainer state names (:class:`~.checkpoint_files.LinkedFile`: the outcome guard's) are linked in, not rewritten."""
    out = root / f"round-{round:06d}"
    tmp = root / f".tmp-{out.name}"
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    torch.save({"trainer": place_files(trainer_state, tmp), "rng": rng}, tmp / "trainer.pt")
    (tmp / "state.json").write_text(json.dumps({"round": round, **extra}, indent=2, sort_keys=True))
    write_manifest(tmp)  # every file fsynced and hashed: the directory renamed next is whole on disk
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    fsync_dir(root)
    try:
        latest = latest_checkpoint(root)
    except CheckpointRefused:  # a marker pointing out of the root is replaced, never followed
        latest = None
    if latest is None or _round_of(latest) <= round:  # LATEST only moves forward
        write_atomic(root / "LATEST", out.name)
    older = sorted(p for p in root.glob("round-*") if _round_of(p) < round)
    for old in older[
        : max(0, len(older) - (max(keep, 2) - 1))
    ]:  # two at least: one to fall back to  # prune only what is older than this checkpoint
        shutil.rmtree(old, ignore_errors=True)
    return out


def _round_of(path: Path) -> int:
    """The round number in a ``round-NNNNNN`` directory name (-1 when it is not one)."""
    try:
        return int(path.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


TIED = "tied"  # model.safetensors metadata: {name: the name its tensor is written under} (tied embeddings)


def _untie(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors to write, tied)``: safetensors refuses shared storage, so a tensor that *is* an earlier one (tied
    embeddings: the same data, shape, strides and dtype) is written once and named in ``tied`` (``{its name: the
    name written}``, restored by :func:`checkpoint_weights`; Gemma 3's 168M-parameter embedding is not written
    twice); a tensor sharing storage any other way gets its own copy."""
    seen: set[int] = set()
    first: dict[tuple, str] = {}
    out, tied = {}, {}
    for k, v in weights.items():
        view = (v.data_ptr(), tuple(v.shape), v.stride(), v.dtype)
        if view in first and v.numel():
            tied[k] = first[view]
            continue
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
        first[view] = k
    return out, tied


CHECKPOINT_NAME = re.compile(r"^round-[0-9]{6,}$")


class CheckpointRefused(RuntimeError):
    """A ``LATEST`` marker that does not name a checkpoint directly inside its root (a path outside it, a link)."""


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/LATEST`` names, None when there is none; :class:`CheckpointRefused` when it names
    anything but a ``round-NNNNNN`` directory directly inside ``root`` (``../x``, an absolute path, a symlink)."""
    marker = root / "LATEST"
    if not marker.is_file():
        return None
    name = marker.read_text(errors="replace").strip()
    if not CHECKPOINT_NAME.match(name):
        raise CheckpointRefused(f"{marker} names {name[:80]!r}, not a round-NNNNNN checkpoint inside {root}")
    path = root / name
    if path.is_symlink() or (path.exists() and path.resolve().parent != root.resolve()):
        raise CheckpointRefused(f"{marker}: {name} is a link out of {root}; refusing to resume from it")
    return path if path.is_dir() else None


def good_checkpoint(root: Path, needed: Callable[[str], bool] | None = None) -> Path | None:
    """The newest whole checkpoint of ``root`` (its manifest verifies, :mod:`.checkpoint_manifest`): the one
    ``LATEST`` names, else (one warning line saying what was wrong) the newest older ``round-NNNNNN`` directory
    that is whole; None when ``root`` holds no checkpoint at all. :class:`CheckpointRefused` for a marker that
    points out of ``root`` (:func:`latest_checkpoint`), or when checkpoints are there and none is whole. A run whose
    checkpoints all predate manifests resumes from them unverified (one warning line), as before manifests.
    ``needed``: whole in the files it accepts (:func:`~.checkpoint_manifest.checkpoint_problem`), for a reader of
    those alone."""
    marker, why = root / "LATEST", ""
    try:
        named = latest_checkpoint(root)
    except CheckpointRefused:
        text = marker.read_text(errors="replace").strip()
        if "/" in text or "\\" in text or text.startswith("."):  # names a path: refused, never followed
            raise
        named, why = None, f"LATEST names {text[:40]!r}"
    dirs = [p for p in root.glob("round-*") if CHECKPOINT_NAME.match(p.name) and p.is_dir() and not p.is_symlink()]
    if named is None and not dirs:
        return None
    if named is None and marker.is_file() and not why:
        why = f"LATEST names {marker.read_text(errors='replace').strip()[:40]!r}, which is gone"
    limit = _round_of(named) if named is not None else None
    legacy = not any((p / MANIFEST).is_file() for p in dirs)  # written before manifests: taken, unverified
    if named is None and not why:
        why = "no LATEST"
    for path in ([named] if named is not None else []) + sorted(
        (p for p in dirs if limit is None or _round_of(p) < limit), key=_round_of, reverse=True
    ):
        if legacy:
            problem = None if (path / "state.json").is_file() else "no state"
        else:
            problem = checkpoint_problem(path, needed)
        if problem is None:
            if why:
                log.warning("checkpoint of %s unusable (%s); resuming from %s", root, why, path.name)
            elif legacy:
                log.warning("checkpoints of %s predate manifests: resuming from %s unverified", root, path.name)
            return path
        why = why or f"{path.name}: {problem}"
    raise CheckpointRefused(f"no whole checkpoint under {root}: {why}")


def checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole weights of checkpoint ``path`` by parameter name: its ``model.safetensors``, or for a sharded
    worker's checkpoint (``dcp/``, :mod:`hacrl_fed.sharded.checkpoint`) the shards read back whole."""
    if (path / "model.safetensors").is_file() or not (path / SHARDED_DIR).is_dir():
        weights = load_file(str(path / "model.safetensors"))
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            tied = json.loads((f.metadata() or {}).get(TIED, "{}"))
        return {**weights, **{name: weights[src] for name, src in tied.items()}}  # a tied tensor is its source
    from hacrl_fed.sharded.dcp_files import read_whole

    return read_whole(path, "model")


def load_checkpoint(path: Path, model: torch.nn.Module) -> tuple[dict, dict[str, Any]]:
    """Load weights into ``model`` and restore RNG states; returns ``(trainer_state, state_json)``. A sharded
    worker's checkpoint has its optimizer state in ``dcp/``: it is read back whole here, keyed by the position of
    each trainable parameter of ``model`` as the one-process optimizer keys it."""
    weights = checkpoint_weights(path)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if k not in weights]:
        real_missing = [k for k in missing if k not in weights]
        if unexpected or any("lm_head" not in k for k in real_missing):
            raise RuntimeError(f"checkpoint {path} does not match the model: missing={missing} unexpected={unexpected}")
    trainer = load_trainer_state(path)
    if trainer.get("optimizer") is None and (path / SHARDED_DIR).is_dir():
        from hacrl_fed.sharded.dcp_files import indexed_optimizer_state, read_whole

        trainer["optimizer"] = indexed_optimizer_state(read_whole(path, "optim"), model)
    return trainer, json.loads((path / "state.json").read_text())


def load_trainer_state(path: Path) -> dict:
    """Restore the RNG states of checkpoint ``path`` and return its trainer state (``trainer.pt``), the files it
    keeps beside (``files/``) as :class:`~.checkpoint_files.LinkedFile` values naming them."""
    blob = torch.load(path / "trainer.pt", weights_only=True)  # never unpickle arbitrary objects
    rng = blob["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    return resolve_files(blob["trainer"], path)
