"""``hacrl-fed bench trl``: our GSPO update against TRL's ``GRPOTrainer`` on the same work, side by side.

    hacrl-fed bench trl [--batches 6] [--repeats 3] [--model qwen-char|smollm2-135m|DIR] [--engine fast]
                        [--sides ours trl defaults] [--out benchmarks/trl]

The same model (zoo ``qwen-char`` by default; ``smollm2-135m`` / ``gemma3-270m``: a packaged real checkpoint,
converted once as ``model.real`` does), the same prompts (arithmetic train ids 0.., rendered as our worker renders
them for that model), the same batch (16 prompts x 8 samples, 32 new tokens at temperature 1, 2 optimizer steps of
64 sequences per batch, AdamW at a constant learning rate, grad-norm clip 1) and the same GSPO objective
(sequence-level ratio of token-mean log-probs, clip ``[1 - 3e-4, 1 + 4e-4]``, group-normalised rewards, no KL).
Three sides (:mod:`hacrl_tools.bench.trl_ours` for ours):

- **ours** (like for like): one :class:`~hacrl_fed.worker.policy_worker.PolicyWorker` (``algorithm.name=gspo``,
  ``generation.engine`` from ``--engine``: ``fast`` by default, ``hf`` for transformers' ``generate()``) driven
  through ``generate`` (sampling, log-probs, verification) and ``train`` (the update), with every option TRL lacks
  set explicitly (:data:`~hacrl_tools.bench.trl_ours.LIKE_FOR_LIKE`: the outcome guard, the likelihood screen,
  signing, samples.jsonl, ... off; printed with the table);
- **TRL**: ``GRPOTrainer`` with ``importance_sampling_level="sequence"`` and every relevant option set explicitly
  (:mod:`hacrl_tools.bench.trl_runner`), in its own virtual environment that this command creates on first use
  (``~/.cache/hacrl_fed/peer-trl-venv``: CPU torch pinned first, ``pip install torch==2.13.0``, so that pip never
  pulls a CUDA build; then ``trl``, the same ``transformers`` as ours, and ``pydantic`` for the shared answer
  check);
- **defaults**: our worker on the same work with the project's defaults for everything else (guard on, as a user
  runs it): the defaults' cost, reported beside the comparison, never inside ours / TRL.

Each repeat runs the sides in turn (ours, TRL, defaults, ours, ...), each in a fresh process with the same torch
thread count, so that load from other work on the machine falls on every side alike; the 1-minute load average is
recorded before and after each run. Per run: the wall time of each batch (generation + update; the first batch is
left out as warm-up), completions per second = completions per batch / median batch time, and the process's peak
RSS. Reported: medians over the runs of each side, and the ratios ours / TRL and defaults / ours as the mean of the
per-repeat ratios ± its standard error. Writes ``<out>/trl.json`` (``trl-<model>.json`` for a model other than
``qwen-char``).
"""

from __future__ import annotations

import json
import os
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
from hacrl_fed.lifecycle import OFFLINE_ENV
from hacrl_tools import code_path


def default_venv() -> Path:
    """``$HACRL_FED_CACHE/peer-trl-venv`` (default ``~/.cache/hacrl_fed/peer-trl-venv``): outside the checkout,
    whose files the Flower CLI scans when it packages the app."""
    from hacrl_fed.models.catalog import cache_root

    return cache_root() / "peer-trl-venv"


OUT = Path("benchmarks") / "trl"  # relative to the working directory
TORCH_PIN = "torch==2.13.0"
TRL_PIN = "trl==1.16.0"
STAMP = ".hacrl-peer-installed"


def ensure_venv(venv: Path, *, trl_pin: str = TRL_PIN, log=print) -> Path:
    """The peer venv's python; creates the venv (CPU torch first, then TRL) when its stamp is missing."""
    import transformers

    pins = [trl_pin, f"transformers=={transformers.__version__}", "pydantic>=2.7,<3"]
    stamp = venv / STAMP
    want = json.dumps({"torch": TORCH_PIN, "packages": pins})
    py = venv / "bin" / "python"
    if stamp.is_file() and stamp.read_text() == want and py.exists():
        return py
    log(f"peer venv: creating {venv} ({TORCH_PIN}, then {' '.join(pins)}); a few minutes")
    base = getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH_PIN], check=True)  # CPU torch first: a bare torch would pull a CUDA build
    subprocess.run([*pip, *pins], check=True)
    stamp.write_text(want)
    return py


def child_env() -> dict[str, str]:
    """Both sides' environment: offline (:data:`hacrl_fed.lifecycle.OFFLINE_ENV`), unbuffered, this checkout's code
    first on ``PYTHONPATH`` (which the TRL side's ``python -I`` ignores)."""
    env = {**os.environ, **OFFLINE_ENV, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (code_path(), env.get("PYTHONPATH")) if x)
    return env


def peer_command(py: Path | str, spec: Path, out: Path) -> list[str]:
    """The TRL side's child process: the peer venv's ``python -I`` on :mod:`hacrl_tools.bench.trl_runner`.

    ``-I`` puts neither the script's folder nor ``PYTHONPATH`` on ``sys.path``, so the peer's packages (``trl``,
    ``torch``, ...) come from its venv and no module of ours can shadow them; the runner appends this checkout's
    code path (the last argument) after them, for the shared answer check only."""
    runner = Path(__file__).with_name("trl_runner.py")
    return [str(py), "-I", str(runner), str(spec), str(out), code_path()]


def model_dir(model: str) -> Path:
    """The HF folder of ``--model``: a folder as given, a packaged real checkpoint (converted once, as
    ``model.real`` does), else a zoo agent."""
    from hacrl_fed.models.catalog import resolve_zoo
    from hacrl_fed.models.real import REAL, real_source

    if Path(model).is_dir():
        return Path(model)
    return real_source(model) if model in REAL else resolve_zoo(model)


def make_spec(args: TrlOptions, path: Path) -> dict[str, Any]:
    """The shared work: model dir, rendered prompts (as our worker renders them for this model: its
    :class:`~hacrl_fed.models.prompting.PromptStyle`) and references, GSPO and batch settings."""
    from transformers import AutoTokenizer

    from hacrl_fed.models.prompting import prompt_style
    from hacrl_fed.tasks import get_task

    folder = model_dir(args.model)
    task = get_task("arithmetic", {"difficulty": 2}, seed=args.seed)
    tok = AutoTokenizer.from_pretrained(str(folder))
    style = prompt_style(tok, task)
    ids = list(range(args.prompts * args.batches))
    prompts = [
        {"id": p.prompt_id, "text": style.render(tok, p.messages), "reference": p.reference}
        for p in task.prompts("train", ids)
    ]
    spec = {
        "model_dir": str(folder),
        "model": args.model,
        "seed": args.seed,
        "threads": args.threads,
        "prompts_per_batch": args.prompts,
        "num_samples": args.samples,
        "steps_per_batch": args.steps,
        "batches": args.batches,
        "max_new_tokens": args.max_new_tokens,
        "lr": args.lr,
        "engine": args.engine,
        "clip_low": 3e-4,
        "clip_high": 4e-4,
        "prompts": prompts,
    }
    path.write_text(json.dumps(spec))
    return spec


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    """Completions/s of one run: completions per batch over the median batch time, first batch left out; the
    mean batch time beside it (a side whose work varies by batch, like the guard's periodic checks, shows there)."""
    times = run["batch_s"][1:] if len(run["batch_s"]) > 1 else run["batch_s"]
    med = statistics.median(times)
    out = {
        "completions_per_s": run["completions_per_batch"] / med,
        "median_batch_s": med,
        "mean_batch_s": statistics.fmean(times),
        "first_batch_s": run["batch_s"][0],
        "peak_rss_mb": run["peak_rss_mb"],
        "import_s": run.get("import_s"),
        "setup_s": run.get("setup_s"),
    }
    for phase, values in (run.get("phases") or {}).items():  # seconds per batch, first batch left out too
        kept = values[1:] if len(values) > 1 else values
        out[f"{phase}_s"] = statistics.median(kept) if kept else None
    return out


SIDE_KEYS = ("completions_per_s", "median_batch_s", "mean_batch_s", "first_batch_s", "peak_rss_mb")


def side_medians(runs: list[dict[str, Any]], side: str) -> dict[str, Any] | None:
    """Medians over ``side``'s runs of every :func:`summarize_run` figure, and its mean reward; None: no run."""
    s = [summarize_run(r) for r in runs if r["side"] == side]
    if not s:
        return None
    out: dict[str, Any] = {}
    for k in sorted({k for x in s for k in x}):
        vals = [x[k] for x in s if x.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    rewards = [r["mean_reward"] for r in runs if r["side"] == side and r.get("mean_reward") is not None]
    out["mean_reward"] = statistics.fmean(rewards) if rewards else None
    out["runs"] = len(s)
    return out


def paired_ratio(runs: list[dict[str, Any]], top: str, bottom: str, key: str = "completions_per_s"):
    """``top`` / ``bottom`` of ``key`` per repeat (runs with the same ``repeat``): mean, standard error (None for
    one repeat) and the per-repeat ratios; None where no repeat has both sides."""
    by_rep: dict[int, dict[str, float]] = {}
    for r in runs:
        by_rep.setdefault(int(r.get("repeat", 0)), {})[r["side"]] = summarize_run(r)[key]
    ratios = [sides[top] / sides[bottom] for _, sides in sorted(by_rep.items()) if top in sides and bottom in sides]
    if not ratios:
        return None
    se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
    return {"mean": statistics.fmean(ratios), "se": se, "per_repeat": ratios}


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per side over runs; ours / TRL (ratio of medians, and the per-repeat ratios' mean ± SE); the
    defaults' cost beside it (defaults / ours, by median and by mean batch time); the load averages."""
    out: dict[str, Any] = {}
    for side in ("ours", "trl", "defaults"):
        s = side_medians(runs, side)
        if s:
            out[side] = s
    if "ours" in out and "trl" in out:
        out["throughput_ratio_ours_over_trl"] = out["ours"]["completions_per_s"] / out["trl"]["completions_per_s"]
        out["peak_rss_ratio_ours_over_trl"] = out["ours"]["peak_rss_mb"] / out["trl"]["peak_rss_mb"]
        out["paired_ours_over_trl"] = paired_ratio(runs, "ours", "trl")
    if "ours" in out and "defaults" in out:
        out["paired_defaults_over_ours"] = paired_ratio(runs, "defaults", "ours")
        out["paired_defaults_over_ours_mean_batch"] = paired_ratio(runs, "ours", "defaults", "mean_batch_s")
    if "trl" in out and "defaults" in out:
        out["paired_defaults_over_trl"] = paired_ratio(runs, "defaults", "trl")
    loads = [x for r in runs for x in (r.get("loadavg_before"), r.get("loadavg_after")) if x]
    if loads:
        one = [float(x[0]) for x in loads]
        out["loadavg_1min"] = {"mean": statistics.fmean(one), "min": min(one), "max": max(one)}
    return out


@dataclass
class TrlOptions:
    """What ``hacrl-fed bench trl`` was asked (:mod:`hacrl_fed.cli.bench` parses and checks it; defaults there)."""

    model: str
    prompts: int
    samples: int
    steps: int
    batches: int
    repeats: int
    max_new_tokens: int
    lr: float
    seed: int
    engine: str
    threads: int | None
    venv: Path | None
    trl: str
    sides: list[str]
    out: Path


def result_name(model: str) -> str:
    """``trl.json`` for the default model, ``trl-<name>.json`` for another (a folder: its name)."""
    return "trl.json" if model == "qwen-char" else f"trl-{Path(model).name}.json"


def side_command(side: str, spec_path: Path, out: Path, trl_py: Path | None) -> list[str]:
    """The child process of one run of ``side``."""
    if side == "trl":
        if trl_py is None:
            raise ValueError("the TRL side needs the peer venv's python")
        return peer_command(trl_py, spec_path, out)
    return [sys.executable, "-m", "hacrl_tools.bench.trl_ours", str(spec_path), str(out), side]


def run_side(side: str, rep: int, cmd: list[str], out: Path, env: dict[str, str]) -> dict[str, Any]:
    """One run in a fresh process; its JSON with the repeat and the 1-minute load average before and after."""
    before = list(os.getloadavg())
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    run = json.loads(out.read_text())
    run.update(repeat=rep, loadavg_before=before, loadavg_after=list(os.getloadavg()))
    return run


def run_trl(args: TrlOptions) -> int:
    """Every side on the same work, in turn within each repeat, ``repeats`` runs each; the JSON (rewritten after
    every run, so an interrupted bench keeps the runs it finished) and a table."""
    if args.threads is None:
        args.threads = available_cpus()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hacrl-peer-"))
    try:
        trl_py = ensure_venv(args.venv or default_venv(), trl_pin=args.trl, log=log) if "trl" in args.sides else None
        spec_path = work / "spec.json"
        spec = make_spec(args, spec_path)
        runs: list[dict[str, Any]] = []
        path = write_result(args, spec, runs)
        for rep in range(args.repeats):
            for side in args.sides:
                out = work / f"{side}-{rep}.json"
                log(f"  trl: run {rep + 1}/{args.repeats}, {side} ...")
                runs.append(run_side(side, rep, side_command(side, spec_path, out, trl_py), out, child_env()))
                s = summarize_run(runs[-1])
                log(f"    {rate(s['completions_per_s'])} completions/s, peak RSS {s['peak_rss_mb']:.0f} MiB")
                path = write_result(args, spec, runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_result(args, spec, json.loads(path.read_text())["summary"], path)
    return 0


def write_result(args: TrlOptions, spec: dict[str, Any], runs: list[dict[str, Any]]) -> Path:
    """``<out>/<result_name>``: machine, code, spec, the like-for-like options, every run so far, the summary."""
    from hacrl_tools.bench.learning import _git_version, machine_info
    from hacrl_tools.bench.trl_ours import LIKE_FOR_LIKE

    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine_info(),
        "code": _git_version(),
        "spec": {k: v for k, v in spec.items() if k != "prompts"},
        "like_for_like": {k: {"value": v, "why": why} for k, (v, why) in LIKE_FOR_LIKE.items()},
        "runs": runs,
        "summary": compare(runs),
    }
    path = args.out / result_name(args.model)
    path.write_text(json.dumps(result, indent=1))
    return path


def print_result(args: TrlOptions, spec: dict[str, Any], summary: dict[str, Any], path: Path) -> None:
    """The summary table, then the like-for-like options beside the project's defaults."""
    from hacrl_tools.bench.trl_ours import like_for_like_table, resolved

    print(format_summary(summary))
    print("\nours (like for like) sets, the defaults side leaves at the project's defaults:\n")
    print(like_for_like_table(resolved(spec, "defaults")))
    print(f"\n{path.name}: {path}")


def rate(x: float) -> str:
    """A throughput: one decimal, or three significant digits below 1 (a real model on a loaded machine)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def format_ratio(r: dict[str, Any] | None) -> str:
    """``1.80 ± 0.05 (n=3)``: a :func:`paired_ratio`; ``–`` for none."""
    if not r:
        return "–"
    se = "no SE (one repeat)" if r["se"] is None else f"± {r['se']:.2f}"
    return f"x{r['mean']:.2f} {se} (n={len(r['per_repeat'])}: {', '.join(f'{x:.2f}' for x in r['per_repeat'])})"


def format_summary(summary: dict[str, Any]) -> str:
    """The comparison as a Markdown table; ``generate s`` / ``update s``: median seconds per batch of generation
    (sampling, the sampled tokens' log-probs, rewards) and of the update (the optimizer steps); then ours / TRL,
    and the defaults' cost beside it."""
    lines = [
        "| side | completions/s | median batch s | mean batch s | generate s | update s | peak RSS MiB | reward "
        "| runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None, digits: int) -> str:
        return "–" if x is None else f"{x:.{digits}f}"

    for side in ("ours", "trl", "defaults"):
        s = summary.get(side)
        if s:
            lines.append(
                f"| {side} | {rate(s['completions_per_s'])} | {s['median_batch_s']:.3f} "
                f"| {f(s.get('mean_batch_s'), 3)} "
                f"| {f(s.get('generate_s'), 3)} | {f(s.get('update_s'), 3)} | {s['peak_rss_mb']:.0f} "
                f"| {f(s.get('mean_reward'), 3)} | {s['runs']} |"
            )
    if "throughput_ratio_ours_over_trl" in summary:
        lines.append(
            f"\nours / TRL (like for like): throughput {format_ratio(summary.get('paired_ours_over_trl'))}; "
            f"ratio of medians x{summary['throughput_ratio_ours_over_trl']:.2f}, "
            f"peak RSS x{summary['peak_rss_ratio_ours_over_trl']:.2f}"
        )
    if "paired_defaults_over_ours" in summary:
        lines.append(
            "beside it, the defaults' cost: defaults / ours throughput "
            f"{format_ratio(summary['paired_defaults_over_ours'])}"
            f" (by mean batch {format_ratio(summary.get('paired_defaults_over_ours_mean_batch'))}); "
            f"defaults / TRL {format_ratio(summary.get('paired_defaults_over_trl'))}"
        )
    if "loadavg_1min" in summary:
        la = summary["loadavg_1min"]
        lines.append(f"1-minute load average around the runs: mean {la['mean']:.1f} ({la['min']:.1f}–{la['max']:.1f})")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit("usage: hacrl-fed bench trl (our sides' child is python -m hacrl_tools.bench.trl_ours)")
