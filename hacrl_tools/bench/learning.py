"""``hacrl-fed bench learning``: the learning-efficiency matrix (settings x methods x seeds), one JSON per cell.

    hacrl-fed bench learning                      # the whole matrix of configs/bench/matrix.yaml
    hacrl-fed bench learning --only model/hacpo --seeds 0   # one piece
    hacrl-fed bench learning --quick              # the reduced matrix (~10 min), into benchmarks/results-quick/
    hacrl-fed bench learning --list               # what would run, what is done, what is skipped and why

A cell is ``(setting, method, seed)``: the setting's config (``configs/bench/<setting>.yaml``) with the method's
overrides, ``seed=<k>`` and the command line's ``--rounds`` / ``--set``, run in this process by the
:class:`~hacrl_fed.coordinator.loop.Coordinator` over in-process workers. It writes
``<results>/<setting>/<method>/seed<k>.json`` (:func:`summarize_cell`: per agent held-out greedy accuracy before,
after and along the run with the rollouts generated so far, rollouts generated, sequences trained on, time per
phase, the algorithm's ratio and clip statistics over the rounds; for the cell its resolved config, its hash, the
code version and the machine). A rerun skips every cell whose JSON holds the same config hash, so the matrix can
run in pieces, in any order, across sessions; a cell whose config changed is rerun and its JSON replaced.
At the end the report (:mod:`hacrl_fed.bench.report`) is rewritten from every JSON found.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger("hacrl_fed.bench.learning")

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "configs" / "bench" / "matrix.yaml"
RESULTS = ROOT / "benchmarks" / "results"
QUICK_RESULTS = ROOT / "benchmarks" / "results-quick"
SCHEMA = 1
# A cell's run dir lives outside the checkout (a temp dir, removed after the cell): `flwr run .` packages the
# repository and refuses deep directory trees such as a run's checkpoints.
ALGOS = ("hacpo", "gspo", "grpo", "naive")


# ------------------------------------------------------------------------------------------------ the matrix


@dataclass(frozen=True)
class Method:
    name: str
    set: dict[str, Any] = field(default_factory=dict)
    scale: dict[str, float] = field(default_factory=dict)
    same_as: str | None = None
    about: str = ""


@dataclass
class Matrix:
    path: Path
    settings: dict[str, dict[str, Any]]  # name -> {"config": Path, "about": str}
    methods: dict[str, Method]
    groups: dict[str, dict[str, list[str]]]  # name -> {"settings": [...], "methods": [...]}
    seeds: list[int]
    quick: dict[str, Any]

    def setting_config(self, setting: str) -> Path:
        return self.settings[setting]["config"]


class MatrixError(ValueError):
    """A malformed matrix file (the message names the entry)."""


def load_matrix(path: str | Path = MATRIX) -> Matrix:
    """Parse and check a matrix YAML (see ``configs/bench/matrix.yaml``); config paths are relative to it."""
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    settings = {}
    for name, s in (data.get("settings") or {}).items():
        if not isinstance(s, dict) or "config" not in s:
            raise MatrixError(f"{path}: settings.{name} needs a 'config'")
        cfg = Path(s["config"])
        settings[name] = {"config": cfg if cfg.is_absolute() else path.parent / cfg, "about": s.get("about", "")}
    methods = {}
    for name, m in (data.get("methods") or {}).items():
        m = m or {}
        unknown = set(m) - {"set", "scale", "same_as", "about"}
        if unknown:
            raise MatrixError(f"{path}: methods.{name}: unknown keys {sorted(unknown)}")
        methods[name] = Method(
            name, dict(m.get("set") or {}), dict(m.get("scale") or {}), m.get("same_as"), m.get("about", "")
        )
    for m in methods.values():
        if m.same_as is not None and m.same_as not in methods:
            raise MatrixError(f"{path}: methods.{m.name}.same_as={m.same_as!r} is not a method")
    groups = {}
    for name, g in (data.get("groups") or {}).items():
        g = {"settings": list(g.get("settings") or []), "methods": list(g.get("methods") or [])}
        for s in g["settings"]:
            if s not in settings:
                raise MatrixError(f"{path}: groups.{name}: unknown setting {s!r}")
        for m in g["methods"]:
            if m not in methods:
                raise MatrixError(f"{path}: groups.{name}: unknown method {m!r}")
        groups[name] = g
    seeds = [int(s) for s in data.get("seeds") or [0, 1, 2]]
    return Matrix(path, settings, methods, groups, seeds, dict(data.get("quick") or {}))


# ------------------------------------------------------------------------------------------------ cells


@dataclass
class Cell:
    setting: str
    method: str
    seed: int
    group: str
    overrides: dict[str, Any] = field(default_factory=dict)
    config: Any = None  # RunConfig, None when skipped
    config_dict: dict[str, Any] | None = None  # the setting's YAML with bench agent paths made absolute
    agents: list[Path] = field(default_factory=list)  # bench agent dirs this cell needs built
    skip: str | None = None  # why it does not run
    same_as: str | None = None
    hash: str | None = None

    @property
    def key(self) -> str:
        return f"{self.setting}/{self.method}/seed{self.seed}"

    def path(self, results: Path) -> Path:
        return Path(results) / self.setting / self.method / f"seed{self.seed}.json"


def field_exists(dotted: str) -> bool:
    """Whether ``dotted`` (``algorithm.alpha``) names a field of the run config (``seed``, ``orgs`` included)."""
    from pydantic import BaseModel

    from hacrl_fed.config import RunConfig

    model: Any = RunConfig
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            # a dict-valued field (task.params, vllm_kwargs) takes any key below it
            return model is dict
        ann = fields[part].annotation
        if i == len(parts) - 1:
            return True
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        elif getattr(ann, "__origin__", None) is dict or ann is dict:
            model = dict
        else:
            return False
    return True


def _get_dotted(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        data = getattr(data, part)
    return data


def _resolve_model_paths(raw: dict[str, Any]) -> tuple[dict[str, Any], list[Path]]:
    """The setting's YAML with every relative ``model.path`` made absolute (relative to the repository root), and
    the bench agent dirs among them (built on demand by :func:`hacrl_fed.bench.agents.ensure_agent`)."""
    from hacrl_fed.bench.agents import agent_name

    raw = json.loads(json.dumps(raw))
    agents = []
    for org in raw.get("orgs") or []:
        model = org.get("model") or {}
        if model.get("path"):
            p = Path(model["path"]).expanduser()
            p = p if p.is_absolute() else ROOT / p
            if agent_name(p) is not None:
                agents.append(p)
            if p.exists() or agent_name(p) is not None:
                model["path"] = str(p)
    return raw, agents


def portable_hash(cfg) -> str:
    """First 12 hex digits of sha256 over the resolved config, ``run_dir`` and ``name`` excluded and model paths
    under the repository given relative to it (the same cell hashes alike in every checkout)."""
    data = cfg.model_dump(mode="json", exclude={"run_dir", "name"})
    for org in data["orgs"]:
        for key in ("path", "tokenizer"):
            value = org["model"].get(key)
            if value and Path(value).is_absolute():
                try:
                    org["model"][key] = str(Path(value).relative_to(ROOT))
                except ValueError:
                    pass
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def build_cell(
    matrix: Matrix,
    setting: str,
    method: str,
    seed: int,
    group: str,
    *,
    rounds: int | None = None,
    extra: dict[str, Any] | None = None,
) -> Cell:
    """One cell: its overrides, its config (or why it is skipped), its hash."""
    from hacrl_fed.config import ConfigError, load_config

    cell = Cell(setting, method, seed, group)
    m = matrix.methods[method]
    if m.same_as is not None:
        cell.same_as = m.same_as
        cell.skip = f"same config as {m.same_as} (reported from its cells)"
        return cell
    raw = yaml.safe_load(matrix.setting_config(setting).read_text()) or {}
    raw, cell.agents = _resolve_model_paths(raw)
    cell.config_dict = raw
    overrides: dict[str, Any] = dict(m.set)
    missing = [k for k in overrides if not field_exists(k)]
    if missing:
        cell.overrides = overrides
        cell.skip = "needs knob " + ", ".join(missing) + " (not a config field yet)"
        return cell
    overrides.update(extra or {})
    if rounds is not None:
        overrides["federation.rounds"] = int(rounds)
    overrides["seed"] = int(seed)
    overrides["name"] = f"bench-{setting}-{method}"
    try:
        base = load_config(raw, {k: v for k, v in overrides.items() if k not in m.scale})
        for key, factor in m.scale.items():
            value = _get_dotted(base, key) * factor
            overrides[key] = int(round(value)) if isinstance(_get_dotted(base, key), int) else value
        cell.config = load_config(raw, overrides)
    except ConfigError as err:
        cell.overrides = overrides
        cell.skip = f"config refused: {err}"
        return cell
    except AttributeError as err:
        cell.skip = f"bad scale field: {err}"
        return cell
    cell.overrides = overrides
    cell.hash = portable_hash(cell.config)
    return cell


def _match(patterns: list[str], setting: str, method: str, group: str) -> bool:
    if not patterns:
        return True
    for pat in patterns:
        if "/" in pat:
            s_pat, _, m_pat = pat.partition("/")
            if fnmatch.fnmatchcase(setting, s_pat or "*") and fnmatch.fnmatchcase(method, m_pat or "*"):
                return True
        elif fnmatch.fnmatchcase(setting, pat) or fnmatch.fnmatchcase(group, pat):
            return True
    return False


def plan_cells(
    matrix: Matrix,
    *,
    only: Iterable[str] = (),
    seeds: Iterable[int] | None = None,
    rounds: int | None = None,
    extra: dict[str, Any] | None = None,
    quick: bool = False,
) -> list[Cell]:
    """Every cell of the matrix (or of ``matrix.quick``) selected by ``only`` (``SETTING``, ``GROUP``,
    ``SETTING/METHOD``, shell patterns allowed), in group, setting, method, seed order, without duplicates."""
    only = list(only)
    q = matrix.quick if quick else {}
    extra = {**(q.get("set") or {}), **(extra or {})}
    seed_list = list(seeds) if seeds is not None else list(q.get("seeds") or matrix.seeds)
    cells, seen = [], set()
    for group, g in matrix.groups.items():
        for setting in g["settings"]:
            if quick and setting not in (q.get("settings") or []):
                continue
            for method in g["methods"]:
                if quick and method not in (q.get("methods") or []):
                    continue
                if not _match(only, setting, method, group) or (setting, method) in seen:
                    continue
                seen.add((setting, method))
                for seed in seed_list:
                    cells.append(build_cell(matrix, setting, method, seed, group, rounds=rounds, extra=extra))
    return cells


def cell_status(cell: Cell, results: Path) -> str:
    """``skip`` | ``done`` (a JSON with this config hash exists) | ``stale`` (another config) | ``todo``."""
    if cell.skip is not None:
        return "skip"
    path = cell.path(results)
    if not path.is_file():
        return "todo"
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return "stale"
    return "done" if old.get("config_hash") == cell.hash else "stale"


# ------------------------------------------------------------------------------------------------ one cell


def _git_version() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "hacrl_fed"))}
    except Exception:  # not a checkout, no git
        return {"commit": None, "dirty": None}


def machine_info() -> dict[str, Any]:
    import torch

    cpus: int | None
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    mem = None
    try:
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": cpus,
        "cpu_model": cpu_model,
        "memory_gib": mem,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _shares(per_round: dict[str, list[float]]) -> dict[str, float]:
    """Each loss share (``hacpo/cross_in_band_frac`` ..., and per source ``hacpo/cross_in_band_frac/<org>``) over
    the whole run: the trainer's :func:`~hacrl_fed.algorithm.fractions_from_counts` applied to the counts summed
    over rounds."""
    from hacrl_fed.algorithm import FRACTION_COUNTS, fractions_from_counts

    summed = {k: sum(v) for k, v in per_round.items()}
    summed.update(dict.fromkeys(FRACTION_COUNTS, 0.0))  # every share, recomputed (or dropped) from its counts
    return {
        k: v
        for k, v in fractions_from_counts(summed).items()
        if k in FRACTION_COUNTS or k.rpartition("/")[0] in FRACTION_COUNTS
    }


def _stats(values: list[float]) -> dict[str, float]:
    tail = values[-max(1, len(values) // 4) :]
    return {
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "late_mean": statistics.fmean(tail),
        "rounds": len(values),
    }


def summarize_cell(cfg, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-agent results of one finished run from its ``metrics.jsonl`` records (see the module docstring)."""
    rounds = sorted({int(r["round"]) for r in records})
    by_round: dict[int, dict[str, Any]] = {}
    for rec in records:  # a resumed run may log a round twice: the later values win
        by_round.setdefault(int(rec["round"]), {}).update({k: v for k, v in rec.items() if v is not None})
    agents = {}
    for org in [o.id for o in cfg.orgs]:
        generated, curve, reward_curve = 0.0, [], []
        sums: dict[str, float] = {}
        algo: dict[str, list[float]] = {}
        capability = []
        for t in rounds:
            rec = by_round[t]
            generated += float(rec.get(f"round/{org}/rollouts_received", 0.0))
            for key, name in (
                (f"round/{org}/rollouts_accepted", "rollouts_accepted"),
                (f"round/{org}/rollouts_rejected", "rollouts_rejected"),
                (f"{org}/train/num_rows", "sequences_trained"),
                (f"{org}/train/num_self", "self_sequences_trained"),
                (f"{org}/train/num_cross", "cross_sequences_trained"),
                (f"{org}/train/foreign_received", "foreign_received"),
                (f"{org}/train/foreign_unscored", "foreign_unscored"),
                (f"{org}/train/steps", "optimizer_steps"),
                (f"{org}/time/generate", "time_generate_s"),
                (f"{org}/time/verify", "time_verify_s"),
                (f"{org}/time/trust", "time_trust_s"),
                (f"{org}/time/score", "time_score_s"),
                (f"{org}/time/train", "time_train_s"),
                (f"eval/{org}/time/eval", "time_eval_s"),
                (f"round/{org}/failed", "rounds_failed"),
                (f"round/{org}/train_failed", "train_failed"),
            ):
                if key in rec:
                    sums[name] = sums.get(name, 0.0) + float(rec[key])
            sums["time_calls_s"] = sums.get("time_calls_s", 0.0) + sum(
                float(v) for k, v in rec.items() if k.startswith("time/call/") and k.endswith(f"/{org}")
            )
            if f"eval/{org}/accuracy" in rec:
                curve.append([t, int(generated), float(rec[f"eval/{org}/accuracy"])])
            if f"round/{org}/accuracy" in rec:
                reward_curve.append([t, float(rec[f"round/{org}/accuracy"])])
            if f"capability/{org}" in rec and t > 0:
                capability.append(float(rec[f"capability/{org}"]))
            prefix = f"{org}/"
            for key, value in rec.items():
                if not key.startswith(prefix):
                    continue
                rest = key[len(prefix) :]
                head = rest.split("/", 1)[0]
                if head in ALGOS or rest in (
                    "train/loss",
                    "train/grad_norm",
                    "train/kl",
                    "train/adv_abs_mean",
                    "gen/mean_tokens",
                    "gen/stop_frac",
                ):
                    algo.setdefault(rest, []).append(float(value))
        before = curve[0][2] if curve and curve[0][0] == 0 else None
        after = curve[-1][2] if curve else None
        agents[org] = {
            "accuracy_before": before,
            "accuracy_after": after,
            "gain": None if before is None or after is None else after - before,
            "curve": curve,  # [round, rollouts generated through that round, held-out accuracy]
            "train_reward": reward_curve,  # [round, mean verified reward of the org's own rollouts]
            "rollouts_generated": int(generated),
            **{k: (round(v, 4) if k.startswith("time_") else int(v)) for k, v in sorted(sums.items())},
            "capability": _stats(capability) if capability else None,
            "stats": {k: _stats(v) for k, v in sorted(algo.items())},
            "shares": _shares(algo),  # every *_frac over the whole run, from the summed counts
        }
    round_times = [float(by_round[t]["time/round"]) for t in rounds if "time/round" in by_round[t]]
    return {
        "rounds": max(rounds) if rounds else 0,
        "skipped_rounds": int(sum(float(by_round[t].get("round/skipped", 0.0)) for t in rounds)),
        "round_time_s": _stats(round_times) if round_times else None,
        "agents": agents,
    }


def _quiet() -> None:
    for name in ("hacrl_fed", "transformers", "torch"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("hacrl_fed.bench").setLevel(logging.INFO)


def run_cell(cell: Cell, results: Path, *, keep_runs: Path | None = None, allow_build: bool = True) -> dict[str, Any]:
    """Run ``cell`` in-process and write its JSON (atomically); returns the JSON's content. The run dir is a temp
    dir removed afterwards, or ``<keep_runs>/<setting>/<method>/seed<k>`` kept."""
    from hacrl_fed.bench.agents import ensure_agent
    from hacrl_fed.coordinator.inprocess import InProcessTransport
    from hacrl_fed.coordinator.loop import Coordinator, write_json_atomic
    from hacrl_fed.metrics import RunLogger, read_metrics
    from hacrl_fed.worker import build_worker

    if cell.skip is not None or cell.config is None:
        raise ValueError(f"{cell.key} does not run: {cell.skip}")
    for agent in cell.agents:
        ensure_agent(agent, allow_build=allow_build)
    cfg = cell.config
    if keep_runs is not None:
        run_dir = Path(keep_runs) / cell.setting / cell.method / f"seed{cell.seed}"
        if run_dir.exists():  # an earlier attempt: cells restart from scratch
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
    else:
        run_dir = Path(tempfile.mkdtemp(prefix=f"hacrl-bench-{cell.setting}-{cell.method}-seed{cell.seed}-"))
    started = time.time()
    try:
        t0 = time.perf_counter()
        transport = InProcessTransport({o.id: build_worker(cfg, o.id, run_dir=run_dir) for o in cfg.orgs})
        setup_s = time.perf_counter() - t0
        try:
            with RunLogger(run_dir, tensorboard=False) as logger:
                t1 = time.perf_counter()
                summary = Coordinator(cfg, transport, run_dir, logger=logger).run()
                run_s = time.perf_counter() - t1
        finally:
            transport.close()
            del transport
            gc.collect()
        records = read_metrics(run_dir)
    except BaseException:
        if keep_runs is None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    result = {
        "schema": SCHEMA,
        "setting": cell.setting,
        "method": cell.method,
        "seed": cell.seed,
        "group": cell.group,
        "config_hash": cell.hash,
        "overrides": cell.overrides,
        "config": cfg.model_dump(mode="json"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "wall_time_s": round(time.time() - started, 2),
        "setup_s": round(setup_s, 2),
        "run_s": round(run_s, 2),
        "coordinator_wall_s": round(summary.wall_time_s, 2),
        "code": _git_version(),
        "machine": machine_info(),
        "rollouts_per_round": {o.id: cfg.federation.prompts_per_round * _num_samples(cfg, o.id) for o in cfg.orgs},
        **summarize_cell(cfg, records),
    }
    out = cell.path(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, _finite(result))
    if keep_runs is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _num_samples(cfg, org: str) -> int:
    from hacrl_fed.config import org_generation

    return org_generation(cfg, org).num_samples


def _finite(obj: Any) -> Any:
    """``obj`` with non-finite floats replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def describe(result: dict[str, Any]) -> str:
    accs = " ".join(
        f"{org} {a['accuracy_before']:.3f}->{a['accuracy_after']:.3f}"
        for org, a in result["agents"].items()
        if a["accuracy_before"] is not None and a["accuracy_after"] is not None
    )
    return f"{result['rounds']} rounds in {result['wall_time_s']:.0f} s; {accs}"


# ------------------------------------------------------------------------------------------------ command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hacrl-fed bench learning",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--matrix", type=Path, default=MATRIX, help="matrix YAML (default configs/bench/matrix.yaml)")
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="results dir (default benchmarks/results, with --quick benchmarks/results-quick)",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SETTING[/METHOD]",
        help="run only these cells: a setting, a group, or setting/method (shell patterns; repeatable)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the matrix's seeds")
    p.add_argument("--rounds", type=int, default=None, help="override federation.rounds of every cell")
    p.add_argument("--quick", action="store_true", help="the matrix's reduced 'quick' selection")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field in every cell (part of the cell's config hash)",
    )
    p.add_argument("--list", action="store_true", help="print the plan (done / to run / skipped) and exit")
    p.add_argument("--no-build", action="store_true", help="skip cells whose bench agents are not built yet")
    p.add_argument("--no-report", action="store_true", help="do not rewrite the report at the end")
    p.add_argument(
        "--keep-runs",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep each cell's run dir (metrics.jsonl, checkpoints) as DIR/<setting>/<method>/seed<k>; keep DIR "
        "outside the repository (flwr run packages it)",
    )
    p.add_argument("--max-cells", type=int, default=None, help="stop after running this many cells")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, i.e. all cores)")
    return p


def main_learning(argv: list[str] | None = None) -> int:
    from hacrl_fed.config import ConfigError, parse_overrides

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = args.results or (QUICK_RESULTS if args.quick else RESULTS)
    try:
        matrix = load_matrix(args.matrix)
        extra = parse_overrides([kv for group in args.overrides for kv in group])
        cells = plan_cells(matrix, only=args.only, seeds=args.seeds, rounds=args.rounds, extra=extra, quick=args.quick)
    except (MatrixError, ConfigError, OSError) as err:
        print(f"hacrl-fed bench learning: error: {err}", file=sys.stderr)
        return 2
    if not cells:
        print("hacrl-fed bench learning: no cell matches", file=sys.stderr)
        return 2
    status = {c.key: cell_status(c, results) for c in cells}
    todo = [c for c in cells if status[c.key] in ("todo", "stale")]
    print(
        f"{len(cells)} cells: {sum(s == 'done' for s in status.values())} done, {len(todo)} to run, "
        f"{sum(s == 'skip' for s in status.values())} skipped; results in {results}"
    )
    for c in cells:
        if status[c.key] == "skip":
            print(f"  skip {c.key}: {c.skip}")
        elif args.list:
            print(f"  {status[c.key]:5s} {c.key}  (config {c.hash})")
    if args.list:
        return 0
    failed: list[str] = []
    ran, times = 0, list[float]()
    for c in todo:
        if args.max_cells is not None and ran >= args.max_cells:
            print(f"stopping after {ran} cells (--max-cells)")
            break
        if args.no_build and any(not _built(a) for a in c.agents):
            print(
                f"  skip {c.key}: needs bench agents {[a.name for a in c.agents if not _built(a)]} "
                "(hacrl-fed bench agents build ...)"
            )
            continue
        if cell_status(c, results) == "done":  # finished meanwhile by another process on the same results
            print(f"  done {c.key} (by another run meanwhile)")
            continue
        eta = f", ~{statistics.fmean(times) * (len(todo) - ran) / 60:.0f} min left" if times else ""
        print(
            f"[{ran + 1}/{len(todo)}] {c.key}{' (config changed: rerun)' if status[c.key] == 'stale' else ''}{eta}",
            flush=True,
        )
        try:
            result = run_cell(c, results, keep_runs=args.keep_runs, allow_build=not args.no_build)
        except KeyboardInterrupt:
            print("interrupted: finished cells are kept; rerun the same command to continue", file=sys.stderr)
            return 1
        except Exception as err:  # one failed cell must not stop the matrix
            log.exception("cell %s failed", c.key)
            failed.append(f"{c.key}: {type(err).__name__}: {err}")
            continue
        ran += 1
        times.append(result["wall_time_s"])
        print(f"    {describe(result)}", flush=True)
    if not args.no_report:
        from hacrl_fed.bench.report import write_report

        report = write_report(results, matrix)
        print(f"report: {report}")
    if failed:
        print("failed cells:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


def _built(agent: Path) -> bool:
    from hacrl_fed.bench.agents import agent_name, is_built

    name = agent_name(agent)
    return name is not None and is_built(agent, name)
