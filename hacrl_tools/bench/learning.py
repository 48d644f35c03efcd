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
phase, the algorithm's ratio and clip statistics over the rounds, the foreign rows offered / selected / left out by
the rule and by the budget per source summed over the rounds (``selection``), the held-out accuracy per slice along
the run for a task with slices (``slice_curves``, absent otherwise), with asynchronous rounds the held-out accuracy
against the driver's clock (``clock_curve``, absent otherwise), with the outcome guard on its verdicts
(``outcome``: rollbacks, adoptions of its shadow, validations, the sources blamed; absent otherwise); for the cell
its resolved config, its
hash, the code version and the machine). A rerun skips every cell whose JSON holds the same config hash, so the
matrix can run in pieces, in any order, across sessions; a cell whose config changed is rerun and its JSON replaced.
At the end the report (:mod:`hacrl_tools.bench.report`) is rewritten from every JSON found.
"""

from __future__ import annotations

import gc
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hacrl_fed.host import available_cpus
from hacrl_tools.bench.matrix import QUICK_RESULTS, RESULTS, Cell, MatrixError, cell_status, load_matrix, plan_cells
from hacrl_tools.bench.report import write_report

log = logging.getLogger("hacrl_fed.bench.learning")

SCHEMA = 1
# A cell's run dir lives outside the checkout (a temp dir, removed after the cell): `flwr run .` packages the
# repository and refuses deep directory trees such as a run's checkpoints.
ALGOS = ("hacpo", "gspo", "grpo", "naive")


# ------------------------------------------------------------------------------------------------ one cell


def _git_version() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=20).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "hacrl_fed"))}
    except Exception:  # not a checkout, no git
        return {"commit": None, "dirty": None}


def machine_info() -> dict[str, Any]:
    import torch

    cpus = available_cpus()
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


# a per-org metric key ({org}: the org's id) -> the cell's field that sums it over rounds
SUMMED = (
    ("round/{org}/rollouts_accepted", "rollouts_accepted"),
    ("round/{org}/rollouts_rejected", "rollouts_rejected"),
    ("{org}/train/num_rows", "sequences_trained"),
    ("{org}/train/num_self", "self_sequences_trained"),
    ("{org}/train/num_cross", "cross_sequences_trained"),
    ("{org}/train/foreign_received", "foreign_received"),
    ("{org}/train/foreign_unscored", "foreign_unscored"),
    ("{org}/train/steps", "optimizer_steps"),
    ("{org}/time/generate", "time_generate_s"),
    ("{org}/time/verify", "time_verify_s"),
    ("{org}/time/trust", "time_trust_s"),
    ("{org}/time/score", "time_score_s"),
    ("{org}/time/train", "time_train_s"),
    ("eval/{org}/time/eval", "time_eval_s"),
    ("round/{org}/failed", "rounds_failed"),
    ("round/{org}/train_failed", "train_failed"),
)
# <org>/<key> series kept for their statistics, besides every key under an algorithm's prefix (ALGOS)
SERIES = ("train/loss", "train/grad_norm", "train/kl", "train/adv_abs_mean", "gen/mean_tokens", "gen/stop_frac")


def summarize_cell(cfg, records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-agent results of one finished run from its ``metrics.jsonl`` records (see the module docstring)."""
    rounds = sorted({int(r["round"]) for r in records})
    by_round: dict[int, dict[str, Any]] = {}
    for rec in records:  # a resumed run may log a round twice: the later values win
        by_round.setdefault(int(rec["round"]), {}).update({k: v for k, v in rec.items() if v is not None})
    agents = {org: summarize_agent(org, [(t, by_round[t]) for t in rounds]) for org in [o.id for o in cfg.orgs]}
    round_times = [float(by_round[t]["time/round"]) for t in rounds if "time/round" in by_round[t]]
    return {
        "rounds": max(rounds) if rounds else 0,
        "skipped_rounds": int(sum(float(by_round[t].get("round/skipped", 0.0)) for t in rounds)),
        "round_time_s": _stats(round_times) if round_times else None,
        "agents": agents,
    }


def _outcome(org: str, rounds: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """``{"outcome": ...}`` with the outcome guard on (``<org>/outcome/...``, docs/METRICS.md), else nothing: the
    rounds it rolled back, the regressions that did nothing (``spared``: the shadow no better), the rounds it adopted
    its shadow, each validation ``[round, learner, shadow or None]`` accuracy on
    the private split, the last round's ``[round, learner, shadow]`` accuracy on the final split where there is one
    (``final``), and per source the rounds it was blamed (struck)."""
    head = f"{org}/outcome/"
    if not any(k.startswith(head) for _, rec in rounds for k in rec):
        return {}
    out: dict[str, Any] = {"rollbacks": [], "spared": [], "adopted": [], "validations": [], "blamed": {}}
    for t, rec in rounds:
        if rec.get(head + "rollback"):
            out["rollbacks"].append(t)
        if rec.get(head + "spared"):
            out["spared"].append(t)
        if rec.get(head + "adopted"):
            out["adopted"].append(t)
        if rec.get(head + "validated") and head + "val_accuracy" in rec:
            shadow = rec.get(head + "shadow_accuracy")
            out["validations"].append([t, float(rec[head + "val_accuracy"]), None if shadow is None else float(shadow)])
        if head + "final_accuracy" in rec:
            out["final"] = [t, float(rec[head + "final_accuracy"]), float(rec[head + "shadow_final_accuracy"])]
        for key in rec:
            src, _, what = key[len(head) :].partition("/")
            if key.startswith(head) and what in ("blamed_counterfactual", "quarantined_until"):
                out["blamed"].setdefault(src, [])
                if t not in out["blamed"][src]:
                    out["blamed"][src].append(t)
    return {"outcome": out}


def summarize_agent(org: str, rounds: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """One agent's results from ``(round, merged record)`` pairs in round order (the module docstring's fields)."""
    generated, curve, reward_curve, clock_curve = 0.0, [], [], []
    sums: dict[str, float] = {}
    algo: dict[str, list[float]] = {}
    capability = []
    selection: dict[str, float] = {}  # select/<source>/<count> and select/<count>, summed over rounds
    for t, rec in rounds:
        generated += float(rec.get(f"round/{org}/rollouts_received", 0.0))
        for template, name in SUMMED:
            if (key := template.format(org=org)) in rec:
                sums[name] = sums.get(name, 0.0) + float(rec[key])
        sums["time_calls_s"] = sums.get("time_calls_s", 0.0) + sum(
            float(v) for k, v in rec.items() if k.startswith("time/call/") and k.endswith(f"/{org}")
        )
        if f"eval/{org}/accuracy" in rec:
            curve.append([t, int(generated), float(rec[f"eval/{org}/accuracy"])])
            clock = 0.0 if t == 0 else rec.get(f"async/{org}/trained_at_s")
            if clock is not None:
                clock_curve.append([t, float(clock), float(rec[f"eval/{org}/accuracy"])])
        if f"round/{org}/accuracy" in rec:
            reward_curve.append([t, float(rec[f"round/{org}/accuracy"])])
        if f"capability/{org}" in rec and t > 0:
            capability.append(float(rec[f"capability/{org}"]))
        for rest, value in ((k[len(org) + 1 :], v) for k, v in rec.items() if k.startswith(f"{org}/")):
            head = rest.split("/", 1)[0]
            if head == "select":
                selection[rest] = selection.get(rest, 0.0) + float(value)
            if head in ALGOS or rest in SERIES:
                algo.setdefault(rest, []).append(float(value))
    before = curve[0][2] if curve and curve[0][0] == 0 else None
    after = curve[-1][2] if curve else None
    return {
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
        **_outcome(org, rounds),
        "selection": {k: int(v) for k, v in sorted(selection.items())},  # foreign rows offered/selected/dropped
        **({"slice_curves": slices} if (slices := slice_curves(org, rounds)) else {}),
        # asynchronous rounds: [round, the driver's clock when the org's weights after that round existed, accuracy]
        **({"clock_curve": clock_curve} if len(clock_curve) > 1 else {}),
    }


def slice_curves(org: str, rounds: list[tuple[int, dict[str, Any]]]) -> dict[str, list[list[float]]]:
    """``{slice: [[round, held-out accuracy], ...]}`` from ``eval/<org>/slice/<slice>/accuracy`` (``{}`` for a
    task without slices)."""
    prefix, suffix = f"eval/{org}/slice/", "/accuracy"
    out: dict[str, list[list[float]]] = {}
    for t, rec in rounds:
        for key, value in rec.items():
            if key.startswith(prefix) and key.endswith(suffix):
                out.setdefault(key[len(prefix) : -len(suffix)], []).append([t, float(value)])
    return dict(sorted(out.items()))


def _quiet() -> None:
    for name in ("hacrl_fed", "transformers", "torch"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("hacrl_fed.bench").setLevel(logging.INFO)


def run_cell(cell: Cell, results: Path, *, keep_runs: Path | None = None, allow_build: bool = True) -> dict[str, Any]:
    """Run ``cell`` in-process and write its JSON (atomically); returns the JSON's content. The run dir is a temp
    dir removed afterwards, or ``<keep_runs>/<setting>/<method>/seed<k>`` kept."""
    from hacrl_fed.coordinator.inprocess import InProcessTransport
    from hacrl_fed.coordinator.loop import Coordinator
    from hacrl_fed.fsio import write_json_atomic
    from hacrl_fed.metrics import RunLogger, read_metrics
    from hacrl_fed.worker import build_worker
    from hacrl_tools.bench.agents import ensure_agent

    if cell.skip is not None or cell.config is None:
        raise ValueError(f"{cell.key} does not run: {cell.skip}")
    for agent in cell.agents:
        ensure_agent(agent, allow_build=allow_build)
    cfg = cell.config
    run_dir = _cell_run_dir(cell, keep_runs)
    started = time.time()
    try:
        t0 = time.perf_counter()
        transport = InProcessTransport(
            {o.id: build_worker(cfg, o.id, run_dir=run_dir) for o in cfg.orgs}, clock=cell.clock()
        )
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
        "config": cell.stored_config(),
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


def _cell_run_dir(cell: Cell, keep_runs: Path | None) -> Path:
    """A fresh run dir for ``cell``: ``<keep_runs>/<setting>/<method>/seed<k>`` (an earlier attempt's removed: cells
    restart from scratch), else a new temp dir."""
    if keep_runs is None:
        return Path(tempfile.mkdtemp(prefix=f"hacrl-bench-{cell.setting}-{cell.method}-seed{cell.seed}-"))
    run_dir = Path(keep_runs) / cell.setting / cell.method / f"seed{cell.seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    return run_dir


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


@dataclass(frozen=True)
class LearningOptions:
    """What ``hacrl-fed bench learning`` was asked (:mod:`hacrl_fed.cli.bench` parses it; defaults there)."""

    matrix: Path
    results: Path | None  # None: RESULTS, or QUICK_RESULTS with quick
    only: list[str]
    seeds: list[int] | None
    rounds: int | None
    quick: bool
    overrides: list[str]  # KEY=VALUE, applied to every cell (part of its config hash)
    list_only: bool
    no_build: bool
    no_report: bool
    keep_runs: Path | None
    max_cells: int | None
    threads: int | None


def run_matrix(opts: LearningOptions) -> int:
    """Run every cell of the plan that is not done yet (one JSON each), then rewrite the report; the exit code
    (2: a bad matrix or override, or no cell matches; 1: some cell failed)."""
    from hacrl_fed.config import ConfigError, parse_overrides

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _quiet()
    if opts.threads:
        import torch

        torch.set_num_threads(opts.threads)
    results = opts.results or (QUICK_RESULTS if opts.quick else RESULTS)
    try:
        matrix = load_matrix(opts.matrix)
        extra = parse_overrides(list(opts.overrides))
        cells = plan_cells(matrix, only=opts.only, seeds=opts.seeds, rounds=opts.rounds, extra=extra, quick=opts.quick)
    except (MatrixError, ConfigError, OSError) as err:
        print(f"hacrl-fed bench learning: error: {err}", file=sys.stderr)
        return 2
    if not cells:
        print("hacrl-fed bench learning: no cell matches", file=sys.stderr)
        return 2
    status = {c.key: cell_status(c, results) for c in cells}
    todo = [c for c in cells if status[c.key] in ("todo", "stale")]
    _print_plan(cells, status, results, list_only=opts.list_only)
    if opts.list_only:
        return 0
    failed: list[str] = []
    ran, times = 0, list[float]()
    for c in todo:
        if opts.max_cells is not None and ran >= opts.max_cells:
            print(f"stopping after {ran} cells (--max-cells)")
            break
        if (note := _not_now(c, results, no_build=opts.no_build)) is not None:
            print(note)
            continue
        eta = f", ~{statistics.fmean(times) * (len(todo) - ran) / 60:.0f} min left" if times else ""
        print(
            f"[{ran + 1}/{len(todo)}] {c.key}{' (config changed: rerun)' if status[c.key] == 'stale' else ''}{eta}",
            flush=True,
        )
        try:
            result = run_cell(c, results, keep_runs=opts.keep_runs, allow_build=not opts.no_build)
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
    if not opts.no_report:
        report = write_report(results, matrix)
        print(f"report: {report}")
    if failed:
        print("failed cells:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


def _print_plan(cells: list[Cell], status: dict[str, str], results: Path, *, list_only: bool) -> None:
    """The plan's counts, each skipped cell with its reason, and (``list_only``) every cell with its status."""
    todo = sum(s in ("todo", "stale") for s in status.values())
    print(
        f"{len(cells)} cells: {sum(s == 'done' for s in status.values())} done, {todo} to run, "
        f"{sum(s == 'skip' for s in status.values())} skipped; results in {results}"
    )
    for c in cells:
        if status[c.key] == "skip":
            print(f"  skip {c.key}: {c.skip}")
        elif list_only:
            print(f"  {status[c.key]:5s} {c.key}  (config {c.hash})")


def _not_now(c: Cell, results: Path, *, no_build: bool) -> str | None:
    """Why a cell to run is passed over now (its agents not built under ``no_build``, or another process finished
    it meanwhile on the same results), or None to run it."""
    if no_build and any(not _built(a) for a in c.agents):
        return (
            f"  skip {c.key}: needs bench agents {[a.name for a in c.agents if not _built(a)]} "
            "(hacrl-fed bench agents build ...)"
        )
    if cell_status(c, results) == "done":
        return f"  done {c.key} (by another run meanwhile)"
    return None


def _built(agent: Path) -> bool:
    from hacrl_tools.bench.agents import agent_name, is_built

    name = agent_name(agent)
    return name is not None and is_built(agent, name)
