"""``hacrl-fed run CONFIG --fork RUN_DIR@ROUND``: a new run, with its own run id and run dir, from round ``ROUND``
of an earlier run (docs/ARCHITECTURE.md "Checkpoints").

What a fork starts from, both written at the end of round ``r`` of the source run:

* every org's worker checkpoint of round ``r`` (``orgs/<org>/checkpoints/<run id>/round-NNNNNN``; workers keep
  two at least, :mod:`hacrl_fed.worker.checkpoint`), checked against its manifest;
* the coordinator's state after round ``r`` (``states/round-NNNNNN.json``, kept for the last rounds every org
  checkpointed, :mod:`hacrl_fed.coordinator.state_file`).

:func:`prepare_fork` copies them into the new run dir under the new run id (each checkpoint's ``state.json`` and
outcome guard state name the new run; a changed learning rate is written into its optimizer state, which a resume
would otherwise restore; a new manifest), with the source's metric rows of rounds ``0 … r``; the run then continues
as a resume of the new run. Only the fields :data:`FORK_SAFE` matches may differ from the source run's
``config.yaml``: the learning rate, the number of rounds, evaluation and logging, and the transport (its numbers are
the same: the entry point records the one it ran on in ``config.yaml``) (:func:`check_fork_config`); any other
difference is refused with one line naming the field. A fork with no change replays the source run's rounds after
``r`` exactly (tested).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from hacrl_fed.config import ConfigError, RunConfig, config_hash, org_trainer
from hacrl_fed.coordinator.state_file import read_snapshot, write_state
from hacrl_fed.fsio import write_atomic
from hacrl_fed.metrics import read_metrics
from hacrl_fed.run_files import CONFIG_FILE, METRICS_FILE
from hacrl_fed.worker.checkpoint import run_checkpoint_root
from hacrl_fed.worker.checkpoint_files import FILES_DIR, link_or_copy
from hacrl_fed.worker.checkpoint_manifest import checkpoint_problem, write_manifest
from hacrl_fed.worker.routing import OUTCOME_KEY

# the config fields a fork may change (dotted paths; list items by index)
FORK_SAFE = re.compile(
    r"^(name|run_dir|trainer\.lr|orgs\.\d+\.trainer\.lr|federation\.(rounds|org_rounds(\..+)?|eval_every|transport)"
    r"|task\.eval_size|generation\.eval_max_new_tokens|wandb(\..+)?)$"
)


def parse_fork(spec: str) -> tuple[Path, int]:
    """``RUN_DIR@ROUND`` → ``(run dir, round)``; ValueError naming ``--fork``."""
    where, sep, round = spec.rpartition("@")
    if not sep or not where or not round.isdigit() or int(round) < 1:
        raise ValueError(f"--fork {spec!r} must look like RUN_DIR@ROUND with ROUND >= 1")
    return Path(where).absolute(), int(round)


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{dotted path: leaf}`` of nested dicts and lists."""
    if isinstance(data, dict):
        items = [(str(k), v) for k, v in data.items()]
    elif isinstance(data, list):
        items = [(str(i), v) for i, v in enumerate(data)]
    else:
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out if out or not prefix else {prefix: data}


def check_fork_config(source: RunConfig, cfg: RunConfig) -> None:
    """:class:`ConfigError` naming the first field (in path order) that differs between ``source`` and ``cfg``
    and is not fork-safe (:data:`FORK_SAFE`)."""
    old, new = _flat(source.model_dump(mode="json")), _flat(cfg.model_dump(mode="json"))
    for path in sorted(old.keys() | new.keys()):
        if old.get(path) != new.get(path) and not FORK_SAFE.match(path):
            raise ConfigError(
                f"--fork: {path} differs from the forked run's ({old.get(path)!r} -> {new.get(path)!r}); a fork may "
                f"change only the learning rate, rounds, evaluation and logging"
            )


def source_config(source_dir: Path) -> RunConfig:
    """The forked run's resolved config (its ``config.yaml``)."""
    from hacrl_fed.config import load_config

    path = source_dir / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"--fork: {path} is missing: {source_dir} is not a run directory")
    return load_config(path)


def prepare_fork(cfg: RunConfig, source_dir: Path, round: int, run_dir: Path, run_id: str) -> None:
    """Write run ``run_id``'s starting point into the new ``run_dir`` from round ``round`` of ``source_dir``
    (module docstring); ConfigError naming what is missing or changed."""
    source = source_config(source_dir)
    check_fork_config(source, cfg)
    if source.federation.staleness >= 1:  # its state is an instant's, not a round's (docs/ALGORITHM.md "Resuming")
        raise ConfigError(
            f"--fork: federation.staleness={source.federation.staleness}: an asynchronous run resumes, "
            "it is not forked yet"
        )
    try:
        state = read_snapshot(source_dir, round)
    except ValueError as err:
        raise ConfigError(f"--fork: {err}") from None
    roots = {o.id: run_checkpoint_root(source_dir / "orgs" / o.id / "checkpoints", state["run_id"]) for o in cfg.orgs}
    for org, root in roots.items():
        problem = checkpoint_problem(root / f"round-{round:06d}")
        if problem is not None:
            raise ConfigError(f"--fork: org {org!r} has no whole checkpoint of round {round} in {root} ({problem})")
    run_dir.mkdir(parents=True, exist_ok=True)
    for org, root in roots.items():
        lr = org_trainer(cfg, org).lr
        new_lr = lr if lr != org_trainer(source, org).lr else None
        _copy_checkpoint(org, root / f"round-{round:06d}", run_dir, run_id, new_lr)
    rows = [row for row in read_metrics(source_dir) if int(row["round"]) <= round]
    write_atomic(run_dir / METRICS_FILE, "".join(json.dumps(row, allow_nan=False) + "\n" for row in rows))
    write_atomic(run_dir / "forked_from.yaml", yaml.safe_dump({"run_dir": str(source_dir), "round": round}))
    write_state(run_dir / "coordinator_state.json", {**state, "run_id": run_id, "config_hash": config_hash(cfg)})


def _copy_checkpoint(org: str, src: Path, run_dir: Path, run_id: str, lr: float | None) -> None:
    """``src`` as run ``run_id``'s checkpoint of org ``org`` in ``run_dir``, with ``LATEST`` naming it; ``lr``:
    the new learning rate (None: unchanged)."""
    root = run_checkpoint_root(run_dir / "orgs" / org / "checkpoints", run_id)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{src.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, copy_function=_link_or_copy)
    info = json.loads((tmp / "state.json").read_text())
    (tmp / "state.json").write_text(json.dumps({**info, "run_id": run_id}, indent=2, sort_keys=True))
    _retarget(tmp / "trainer.pt", run_id, lr, org)
    write_manifest(tmp)
    tmp.replace(root / src.name)
    write_atomic(root / "LATEST", src.name)


def _link_or_copy(src: str, dst: str) -> None:
    """A checkpoint's ``files/`` (the outcome guard's, GBs each) are never written in place: linked; every other
    file is copied (``trainer.pt`` and ``state.json`` are rewritten here, and a link would change the source's)."""
    if Path(src).parent.name == FILES_DIR:
        link_or_copy(Path(src), Path(dst))
    else:
        shutil.copy2(src, dst)


def _retarget(path: Path, run_id: str, lr: float | None, org: str) -> None:
    """Make ``trainer.pt`` run ``run_id``'s: the outcome guard's state names its run (it starts afresh in any
    other), and ``lr`` (when not None) goes into the optimizer state, which a resume restores."""
    blob = torch.load(path, weights_only=True)
    trainer = blob["trainer"]
    if isinstance(trainer.get(OUTCOME_KEY), dict):
        trainer[OUTCOME_KEY]["run_id"] = run_id
    if lr is not None:
        if trainer.get("optimizer") is None:  # a sharded org keeps its optimizer in dcp/
            raise ConfigError(f"--fork: org {org!r} is sharded; its trainer.lr cannot change at a fork")
        for group in trainer["optimizer"]["param_groups"]:
            group["lr"] = lr
    torch.save(blob, path)
