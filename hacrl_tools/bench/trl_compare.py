"""``hacrl-fed bench trl``: our GSPO update against TRL's ``GRPOTrainer`` on the same work, side by side.

    hacrl-fed bench trl [--batches 6] [--repeats 3] [--model qwen-char] [--engine fast] [--out benchmarks/trl]

The same tiny model (zoo ``qwen-char`` by default), the same prompts (arithmetic train ids 0.., rendered with the
model's own chat template), the same batch (16 prompts x 8 samples, 32 new tokens at temperature 1, 2 optimizer
steps of 64 sequences per batch, AdamW at a constant learning rate, grad-norm clip 1) and the same GSPO objective
(sequence-level ratio of token-mean log-probs, clip ``[1 - 3e-4, 1 + 4e-4]``, group-normalised rewards, no KL):

- **ours**: one :class:`~hacrl_fed.worker.policy_worker.PolicyWorker` (``algorithm.name=gspo``, signing off since
  TRL signs nothing, ``generation.engine`` from ``--engine``: ``fast`` by default, ``hf`` for transformers'
  ``generate()``) driven through ``generate`` (sampling, log-probs, verification) and ``train`` (the update);
- **TRL**: ``GRPOTrainer`` with ``importance_sampling_level="sequence"`` and every relevant option set explicitly
  (:mod:`hacrl_tools.bench.trl_runner`), in its own virtual environment that this command creates on first use
  (``~/.cache/hacrl_fed/peer-trl-venv``: CPU torch pinned first, ``pip install torch==2.13.0``, so that pip never
  pulls a CUDA build; then
  ``trl``, the same ``transformers`` as ours, and ``pydantic`` for the shared answer check).

Runs alternate (ours, TRL, ours, TRL, ...), each in a fresh process with the same torch thread count. Per run: the
wall time of each batch (generation + update; the first batch is left out as warm-up), completions per second =
completions per batch / median batch time, and the process's peak RSS. Reported: medians over the runs of each
side, and ours / TRL. Writes ``<out>/trl.json``.
"""

from __future__ import annotations

import json
import os
import resource
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


def make_spec(args: TrlOptions, path: Path) -> dict[str, Any]:
    """The shared work: model dir, rendered prompts and references, GSPO and batch settings."""
    from transformers import AutoTokenizer

    from hacrl_fed.models.catalog import resolve_zoo
    from hacrl_fed.models.chat import render_prompt
    from hacrl_fed.tasks import get_task

    model_dir = resolve_zoo(args.model) if not Path(args.model).is_dir() else Path(args.model)
    task = get_task("arithmetic", {"difficulty": 2}, seed=args.seed)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = list(range(args.prompts * args.batches))
    prompts = [
        {"id": p.prompt_id, "text": render_prompt(tok, p.messages), "reference": p.reference}
        for p in task.prompts("train", ids)
    ]
    spec = {
        "model_dir": str(model_dir),
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


def ours_config(spec: dict[str, Any]) -> dict[str, Any]:
    """Our side's run config for the spec's work: one org (``peer``), GSPO with the spec's clip and no KL, the
    spec's batch shape and engine, signing off (TRL signs nothing)."""
    B, G, steps = int(spec["prompts_per_batch"]), int(spec["num_samples"]), int(spec["steps_per_batch"])
    return {
        "name": "peer",
        "seed": spec["seed"],
        "orgs": [{"id": "peer", "model": {"path": spec["model_dir"]}}],
        "algorithm": {
            "name": "gspo",
            "self_clip_low": spec["clip_low"],
            "self_clip_high": spec["clip_high"],
            "kl_beta": 0.0,
        },
        "trainer": {
            "lr": spec["lr"],
            "minibatch_size": B * G // steps,
            "micro_batch_size": B * G // steps,
            "grad_clip": 1.0,
            "weight_decay": 0.0,
        },
        "generation": {
            "engine": spec.get("engine", "fast"),
            "num_samples": G,
            "max_new_tokens": spec["max_new_tokens"],
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "batch_size": B * G,
        },
        "task": {"name": "arithmetic", "params": {"difficulty": 2}},
        "federation": {"rounds": int(spec["batches"]), "prompts_per_round": B},
        "security": {"signing": False},
    }


def ours_main(argv: list[str]) -> int:
    """``_ours SPEC OUT``: the same work through our policy worker (run in a fresh process)."""
    t_start = time.perf_counter()
    if len(argv) != 2:
        raise SystemExit("usage: python -m hacrl_tools.bench.trl_compare _ours SPEC OUT")
    spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    import torch

    from hacrl_fed.config import load_config
    from hacrl_fed.tasks import get_task
    from hacrl_fed.types import RoundPlan, SamplingParams, TrainRequest
    from hacrl_fed.worker import build_worker

    torch.set_num_threads(int(spec["threads"]))
    t_import = time.perf_counter() - t_start
    B, G = int(spec["prompts_per_batch"]), int(spec["num_samples"])
    cfg = load_config(ours_config(spec))
    task = get_task("arithmetic", {"difficulty": 2}, seed=spec["seed"])
    work = Path(tempfile.mkdtemp(prefix="peer-ours-"))
    try:
        worker = build_worker(cfg, "peer", run_dir=work)
        t_setup = time.perf_counter() - t_start - t_import
        ids = [p["id"] for p in spec["prompts"]]
        batch_s, rewards = [], []
        phases: dict[str, list[float]] = {"generate": [], "update": []}
        for i in range(int(spec["batches"])):
            prompts = tuple(task.prompts("train", ids[i * B : (i + 1) * B]))
            sampling = SamplingParams(1.0, 1.0, 0, int(spec["max_new_tokens"]), G, 1000 + i)
            plan = RoundPlan("peer-run", i + 1, "arithmetic", prompts, sampling)
            t0 = time.perf_counter()
            batch = worker.generate(plan)
            t1 = time.perf_counter()
            worker.train(TrainRequest("peer-run", i + 1, "peer", prompts, (), {"peer": 1.0}))
            t2 = time.perf_counter()
            batch_s.append(t2 - t0)
            phases["generate"].append(t1 - t0)  # sampling, the sampled tokens' log-probs, rewards
            phases["update"].append(t2 - t1)  # the optimizer steps (forward and backward)
            rewards.append(batch.accuracy)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    Path(out_path).write_text(
        json.dumps(
            {
                "side": "ours",
                "batch_s": batch_s,
                "phases": phases,
                "completions_per_batch": B * G,
                "import_s": t_import,
                "setup_s": t_setup,
                "peak_rss_mb": peak,
                "mean_reward": statistics.fmean(rewards),
            }
        )
    )
    return 0


def summarize_run(run: dict[str, Any]) -> dict[str, Any]:
    """Completions/s of one run: completions per batch over the median batch time, first batch left out."""
    times = run["batch_s"][1:] if len(run["batch_s"]) > 1 else run["batch_s"]
    med = statistics.median(times)
    out = {
        "completions_per_s": run["completions_per_batch"] / med,
        "median_batch_s": med,
        "peak_rss_mb": run["peak_rss_mb"],
        "import_s": run.get("import_s"),
        "setup_s": run.get("setup_s"),
    }
    for phase, values in (run.get("phases") or {}).items():  # seconds per batch, first batch left out too
        kept = values[1:] if len(values) > 1 else values
        out[f"{phase}_s"] = statistics.median(kept) if kept else None
    return out


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per side over runs, and the ratio ours / TRL."""
    out: dict[str, Any] = {}
    for side in ("ours", "trl"):
        s = [summarize_run(r) for r in runs if r["side"] == side]
        if s:
            out[side] = {
                k: statistics.median([x[k] for x in s if x.get(k) is not None])
                for k in ("completions_per_s", "median_batch_s", "peak_rss_mb", "import_s", "setup_s")
            }
            for k in sorted({k for x in s for k in x if k.endswith("_s") and k not in out[side]}):
                vals = [x[k] for x in s if x.get(k) is not None]
                out[side][k] = statistics.median(vals) if vals else None
            out[side]["runs"] = len(s)
    if "ours" in out and "trl" in out:
        out["throughput_ratio_ours_over_trl"] = out["ours"]["completions_per_s"] / out["trl"]["completions_per_s"]
        out["peak_rss_ratio_ours_over_trl"] = out["ours"]["peak_rss_mb"] / out["trl"]["peak_rss_mb"]
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


def run_trl(args: TrlOptions) -> int:
    """Both sides on the same work, alternating, ``repeats`` runs each; ``<out>/trl.json`` and a table."""
    if args.threads is None:
        args.threads = available_cpus()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hacrl-peer-"))
    env = child_env()
    try:
        trl_py = ensure_venv(args.venv or default_venv(), trl_pin=args.trl, log=log) if "trl" in args.sides else None
        spec_path = work / "spec.json"
        spec = make_spec(args, spec_path)
        runs = []
        for rep in range(args.repeats):
            for side in args.sides:
                out = work / f"{side}-{rep}.json"
                if side == "ours":
                    cmd = [sys.executable, "-m", "hacrl_tools.bench.trl_compare", "_ours", str(spec_path), str(out)]
                else:
                    assert trl_py is not None  # made above whenever "trl" is a side
                    cmd = peer_command(trl_py, spec_path, out)
                log(f"  trl: run {rep + 1}/{args.repeats}, {side} ...")
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
                if proc.returncode != 0:
                    raise RuntimeError(f"{side} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
                run = json.loads(out.read_text())
                run["repeat"] = rep
                runs.append(run)
                s = summarize_run(run)
                log(f"    {s['completions_per_s']:.1f} completions/s, peak RSS {s['peak_rss_mb']:.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from hacrl_tools.bench.learning import _git_version, machine_info

    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": machine_info(),
        "code": _git_version(),
        "spec": {k: v for k, v in spec.items() if k != "prompts"},
        "runs": runs,
        "summary": compare(runs),
    }
    (args.out / "trl.json").write_text(json.dumps(result, indent=1))
    print(format_summary(result["summary"]))
    print(f"trl.json: {args.out / 'trl.json'}")
    return 0


def format_summary(summary: dict[str, Any]) -> str:
    """The comparison as a Markdown table; ``generate s`` / ``update s``: median seconds per batch of generation
    (sampling, the sampled tokens' log-probs, rewards) and of the update (the optimizer steps)."""
    lines = [
        "| side | completions/s | median batch s | generate s | update s | peak RSS MiB | import s | setup s | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None, digits: int) -> str:
        return "–" if x is None else f"{x:.{digits}f}"

    for side in ("ours", "trl"):
        s = summary.get(side)
        if s:
            lines.append(
                f"| {side} | {s['completions_per_s']:.1f} | {s['median_batch_s']:.3f} | {f(s.get('generate_s'), 3)} "
                f"| {f(s.get('update_s'), 3)} | {s['peak_rss_mb']:.0f} | {f(s.get('import_s'), 1)} "
                f"| {f(s.get('setup_s'), 1)} | {s['runs']} |"
            )
    if "throughput_ratio_ours_over_trl" in summary:
        lines.append(
            f"\nours / TRL: throughput x{summary['throughput_ratio_ours_over_trl']:.2f}, "
            f"peak RSS x{summary['peak_rss_ratio_ours_over_trl']:.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # the "ours" side's child process of run_trl (not a command)
    if len(sys.argv) > 1 and sys.argv[1] == "_ours":
        raise SystemExit(ours_main(sys.argv[2:]))
    raise SystemExit("usage: hacrl-fed bench trl (this module's own entry is the _ours child process)")
