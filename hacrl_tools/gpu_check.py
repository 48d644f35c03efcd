"""One prepared GPU check: ``scripts/gpu_check.sh`` (= ``hacrl-fed gpu-check``), nothing downloaded.

Steps, each timed and recorded in one JSON (``--out DIR``/``gpu_check.json``) and a short printed table:

1. **build**: a Qwen2.5-0.5B-shaped model with random weights (24 layers, hidden 896, 14 heads of 64, 2 KV heads,
   151936-entry vocabulary; untied head, 0.63 B parameters) and the zoo's ``llama-bpe`` tokenizer, made on the
   device and saved to a work dir. The head's rows past the tokenizer's 400 tokens are zero and the others scaled,
   so sampling stays on real tokens (and responses run to ``max_new_tokens``: a fixed workload).
2. **gpu tests**: ``pytest -m gpu`` (tests/test_gpu.py) in a subprocess.
3. **rounds (hf)**: two federated rounds, in-process, of that model (``big``: bf16 weights, fp32 masters, gradient
   checkpointing) and the zoo's ``qwen-char`` agent (``tiny``: fp32 weights under bf16 autocast), both on the
   device: per round the round time, per org and phase (generate, score, train) tokens/s and peak GPU memory
   (the workers' ``perf/`` metrics), the run's peak GPU memory, and the published log-probs' error against an
   unpadded single-sequence recompute of each org.
4. **vllm tests** and **rounds (vllm)**: the same with ``big`` generating through vLLM (sleeping during the
   update) — only where ``import vllm`` works (a supported release and a CUDA device); otherwise skipped with why.

``--dry-run`` runs every step on CPU with a micro model in seconds (tests/test_gpu_check.py runs it, so the script
cannot rot). A ``--budget-s`` guard skips the steps that would start after the budget is spent. Exit status 1
when a step failed.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hacrl_fed.lifecycle import OFFLINE_ENV

TOKENIZER_ZOO = "llama-bpe"
HEAD_SCALE = 8.0  # in-vocabulary head rows x this: their logits outweigh the 151k zero rows (>95% of samples)

# Qwen2.5-0.5B's body (the head is untied here, see the module doc)
BIG_SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    vocab_size=151936,
)
MICRO_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    vocab_size=512,
)

# max / mean |published - recompute| per weight dtype. float32 is the sharp check (padding or position-id bugs
# show as 4e-3 ... 0.2); bfloat16 compares two forward passes of different batch shapes through 24 layers of
# rounding, so only gross errors fail it.
LOGPROB_TOLERANCE = {"float32": (1e-3, 1e-4), "bfloat16": (1.0, 0.05)}


@dataclass(frozen=True)
class Settings:
    """Sizes of one check (full: one H200, under 10 minutes; dry run: CPU, seconds)."""

    dry_run: bool
    device: str
    shape: dict
    tiny_zoo: str
    prompts: int  # B
    samples: int  # G
    max_new_tokens: int
    tiny_max_new_tokens: int
    eval_size: int
    eval_max_new_tokens: int
    minibatch_size: int
    micro_batch_size: int
    gen_batch_size: int
    rounds: int = 2
    logprob_prompts: int = 4
    pytest_timeout_s: int = 300

    @classmethod
    def for_run(cls, dry_run: bool) -> Settings:
        if dry_run:
            return cls(
                True,
                "cpu",
                MICRO_SHAPE,
                "micro-qwen-char",
                prompts=2,
                samples=2,
                max_new_tokens=8,
                tiny_max_new_tokens=8,
                eval_size=4,
                eval_max_new_tokens=8,
                minibatch_size=8,
                micro_batch_size=4,
                gen_batch_size=8,
                logprob_prompts=2,
                pytest_timeout_s=300,
            )
        return cls(
            False,
            "cuda",
            BIG_SHAPE,
            "qwen-char",
            prompts=16,
            samples=8,
            max_new_tokens=256,
            tiny_max_new_tokens=128,
            eval_size=16,
            eval_max_new_tokens=64,
            minibatch_size=64,
            micro_batch_size=16,
            gen_batch_size=128,
        )


# -- steps ------------------------------------------------------------------------------------------------------


def build_model(out: Path, s: Settings, seed: int = 0) -> dict[str, Any]:
    """Save a random ``s.shape`` Qwen2 model with the zoo tokenizer to ``out``; returns its description."""
    from transformers import AutoModelForCausalLM, Qwen2Config
    from transformers.utils import logging as hf_logging

    from hacrl_fed.models.catalog import shipped_dir
    from hacrl_fed.models.loading import load_tokenizer

    hf_logging.disable_progress_bar()
    tok = load_tokenizer(str(shipped_dir(TOKENIZER_ZOO)))
    vocab = len(tok)
    cfg = Qwen2Config(
        **s.shape,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(s.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        head = model.lm_head.weight
        head[vocab:] = 0
        head[:vocab] *= HEAD_SCALE
    model.save_pretrained(out)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {
        "path": str(out),
        "params": params,
        "shape": s.shape,
        "tokenizer": TOKENIZER_ZOO,
        "tokenizer_tokens": vocab,
        "dtype": "bfloat16",
    }


def run_config(model_dir: Path, s: Settings, engine: str) -> dict[str, Any]:
    """The two-org run: ``big`` (the built model, bf16 + fp32 masters) and ``tiny`` (zoo, fp32 + bf16 autocast)."""
    big_gen: dict[str, Any] = {}
    if engine == "vllm":
        big_gen = {
            "engine": "vllm",
            "dtype": "bfloat16",
            "gpu_memory_utilization": 0.3,
            "max_model_len": 1024,
            "sleep_during_train": True,
            "vllm_kwargs": {"enforce_eager": True},
        }
    return {
        "name": f"gpu-check-{engine}",
        "seed": 0,
        "algorithm": {"name": "hacpo", "kl_beta": 0.001},
        "trainer": {
            "lr": 1e-6,
            "minibatch_size": s.minibatch_size,
            "micro_batch_size": s.micro_batch_size,
            "precision": "bf16-master",
            "gradient_checkpointing": True,
        },
        "generation": {
            "engine": "hf",
            "num_samples": s.samples,
            "max_new_tokens": s.max_new_tokens,
            "eval_max_new_tokens": s.eval_max_new_tokens,
            "batch_size": s.gen_batch_size,
        },
        "task": {"name": "arithmetic", "params": {"difficulty": 2}, "eval_size": s.eval_size},
        "orgs": [
            {
                "id": "big",
                "model": {"path": str(model_dir), "device": s.device, "dtype": "bfloat16"},
                "generation": big_gen,
            },
            {
                "id": "tiny",
                "model": {"zoo": s.tiny_zoo, "device": s.device, "dtype": "float32"},
                "trainer": {"precision": "bf16-autocast"},
                "generation": {"max_new_tokens": s.tiny_max_new_tokens},
            },
        ],
        "federation": {
            "rounds": s.rounds,
            "prompts_per_round": s.prompts,
            "eval_every": 0,
            "min_orgs": 2,
            "transport": "inprocess",
        },
    }


def logprob_error(worker, s: Settings) -> dict[str, Any]:
    """|published - recompute| of ``worker``'s engine on a few prompts; the recompute scores each sequence alone
    (no padding) with the worker's model, so padding, batching and engine differences all show."""
    from hacrl_fed.scoring import build_scoring_batch_from_ids, per_token_log_probs

    prompts = worker.task.prompts("test", list(range(s.logprob_prompts)))
    texts = [worker.prompts.render(p) for p in prompts]
    gens = worker.engine.generate(
        texts, num_samples=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=min(64, s.max_new_tokens), seed=123
    )
    prompt_ids = worker.tokenizer(texts, add_special_tokens=False)["input_ids"]
    pad = worker.tokenizer.pad_token_id
    errors: list[float] = []
    for p, row in zip(prompt_ids, gens):
        for g in row:
            if not g.token_ids:
                continue
            fresh = per_token_log_probs(worker.model, build_scoring_batch_from_ids([p], [g.token_ids], pad), 1)[0]
            errors += [abs(a - b) for a, b in zip(g.token_log_probs, fresh)]
    dtype = str(next(worker.model.parameters()).dtype).removeprefix("torch.")
    max_tol, mean_tol = LOGPROB_TOLERANCE.get(dtype, LOGPROB_TOLERANCE["bfloat16"])
    max_err = max(errors, default=0.0)
    mean_err = sum(errors) / len(errors) if errors else 0.0
    return {
        "dtype": dtype,
        "tokens": len(errors),
        "max_abs": max_err,
        "mean_abs": mean_err,
        "ok": bool(errors) and max_err <= max_tol and mean_err <= mean_tol,
        "tolerance": {"max_abs": max_tol, "mean_abs": mean_tol},
    }


def _cuda(s: Settings) -> bool:
    return torch.device(s.device).type == "cuda" and torch.cuda.is_available()


def run_rounds(model_dir: Path, work: Path, s: Settings, engine: str) -> dict[str, Any]:
    """Two federated rounds in-process; returns round times, per-org/phase perf, peak memory, log-prob errors."""
    from hacrl_fed.config import load_config
    from hacrl_fed.coordinator.inprocess import InProcessTransport
    from hacrl_fed.coordinator.loop import Coordinator
    from hacrl_fed.worker import build_worker

    cfg = load_config(run_config(model_dir, s, engine))
    run_dir = work / f"run-{engine}"
    if _cuda(s):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    workers = {o.id: build_worker(cfg, o.id, run_dir=run_dir) for o in cfg.orgs}
    setup_s = time.perf_counter() - t0
    transport = InProcessTransport(workers)
    rounds: list[dict[str, float]] = []
    try:
        coord = Coordinator(cfg, transport, run_dir, logger=None, on_round=lambda r: rounds.append(dict(r.metrics)))
        summary = coord.run()
        errors = {org: logprob_error(w, s) for org, w in workers.items()}
    finally:
        transport.close()
    out: dict[str, Any] = {
        "engine": engine,
        "setup_s": setup_s,
        "round_time_s": [m.get("time/round") for m in rounds],
        "rounds_trained": [m.get("round/orgs_trained") for m in rounds],
        "wall_time_s": summary.wall_time_s,
        "accuracy": {org: {"before": o.accuracy_before, "after": o.accuracy_after} for org, o in summary.orgs.items()},
        "perf": {
            org: {
                f"round{i + 1}": {
                    k.removeprefix(f"{org}/perf/"): v for k, v in m.items() if k.startswith(f"{org}/perf/")
                }
                for i, m in enumerate(rounds)
            }
            for org in workers
        },
        "logprob_error": errors,
    }
    if _cuda(s):
        out["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        from hacrl_fed.perf import peak_rss_mb

        out["peak_rss_mb"] = peak_rss_mb()
    del workers, transport
    gc.collect()
    if _cuda(s):
        torch.cuda.empty_cache()
    ok = (
        len(rounds) == s.rounds
        and all(m.get("round/orgs_trained") == 2 for m in rounds)
        and all(e["ok"] for e in errors.values())
    )
    out["status"] = "passed" if ok else "failed"
    return out


def run_pytest(marker: str, files: list[str], work: Path, timeout_s: int, repo: Path) -> dict[str, Any]:
    """``pytest -m marker files`` in a subprocess in ``repo`` (the checkout's root); counts from its JUnit XML."""
    import importlib.util

    missing = [f for f in files if not (repo / f).is_file()]
    if missing:
        return {"status": "skipped", "reason": f"test files not found: {missing}"}
    if importlib.util.find_spec("pytest") is None:
        return {"status": "skipped", "reason": "pytest is not installed"}
    xml = work / f"junit-{marker}.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", marker, *files, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    try:
        proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"timed out after {timeout_s} s"}
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if xml.is_file():
        root = ET.parse(xml).getroot()
        suites = [root] if root.tag == "testsuite" else list(root)
        for suite in suites:
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    result = {
        "returncode": proc.returncode,
        "passed": passed,
        "failed": counts["failures"] + counts["errors"],
        "skipped": counts["skipped"],
        "tail": proc.stdout[-2000:] + proc.stderr[-1000:],
    }
    if proc.returncode not in (0, 5) or result["failed"]:
        result["status"] = "failed"
    else:
        result["status"] = "passed" if passed else "skipped"
    return result


def vllm_available(s: Settings) -> str | None:
    """None when the vLLM steps can run here, else why not."""
    if not _cuda(s):
        return "no CUDA device" if not s.dry_run else "dry run (CPU)"
    try:
        from hacrl_fed.engines.vllm import import_vllm

        import_vllm()
    except Exception as err:  # ImportError, or a broken install
        return f"vllm not importable: {type(err).__name__}: {str(err)[:300]}"
    return None


# -- driver -----------------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_mem_mb=props.total_memory / 2**20)
    try:  # the installed version, without importing vllm (that happens only before the vLLM steps)
        from importlib.metadata import PackageNotFoundError, version

        env["vllm"] = version("vllm")
    except PackageNotFoundError:
        env["vllm"] = None
    return env


def _step(results: dict, name: str, start: float, budget_s: float, fn) -> Any:
    """Run ``fn()`` as step ``name`` (timed, exceptions recorded) unless the budget is spent."""
    if time.perf_counter() - start > budget_s:
        results["steps"][name] = {"status": "skipped", "reason": f"time budget of {budget_s:.0f} s spent"}
        return None
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as err:
        out = {"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    if isinstance(out, dict):
        out.setdefault("status", "passed")
        out["seconds"] = time.perf_counter() - t0
    results["steps"][name] = out
    return out


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def format_table(results: dict[str, Any]) -> str:
    """The short summary printed at the end."""
    lines = [f"{'step':<16} {'status':<8} {'seconds':>8}  details"]
    for name, step in results["steps"].items():
        detail = step.get("reason") or step.get("error", "")
        if "passed" in step and "failed" in step:
            detail = f"{step['passed']} passed, {step['failed']} failed, {step['skipped']} skipped"
        if "round_time_s" in step:
            mem = step.get("peak_gpu_mem_mb", step.get("peak_rss_mb"))
            kind = "GPU" if "peak_gpu_mem_mb" in step else "RSS"
            detail = f"rounds {', '.join(_fmt(t) for t in step['round_time_s'])} s; peak {kind} {_fmt(mem, '.0f')} MiB"
        if name == "build" and "params" in step:
            detail = f"{step['params'] / 1e6:.1f} M params, {step['dtype']}"
        lines.append(f"{name:<16} {step.get('status', '?'):<8} {_fmt(step.get('seconds')):>8}  {detail[:100]}")
    for name, step in results["steps"].items():
        if "perf" not in step:
            continue
        lines.append("")
        lines.append(f"{name}: last round, per org and phase")
        lines.append(f"  {'org':<6} {'phase':<9} {'tokens/s':>10} {'peak MiB':>9}")
        for org, by_round in step["perf"].items():
            last = by_round[max(by_round)] if by_round else {}
            for phase in ("generate", "score", "train"):
                mem = last.get(f"{phase}/peak_gpu_mem_mb", last.get(f"{phase}/peak_rss_mb"))
                lines.append(
                    f"  {org:<6} {phase:<9} {_fmt(last.get(f'{phase}/tokens_per_s')):>10} {_fmt(mem, '.0f'):>9}"
                )
        for org, err in step.get("logprob_error", {}).items():
            lines.append(
                f"  log-prob |error| vs recompute, {org} ({err['dtype']}): max {err['max_abs']:.2e}, "
                f"mean {err['mean_abs']:.2e} over {err['tokens']} tokens"
                f"{'' if err['ok'] else '  (over tolerance)'}"
            )
    lines.append(f"total {results['total_seconds']:.1f} s; {'OK' if results['ok'] else 'FAILED'}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Options:
    """What ``hacrl-fed gpu-check`` (``scripts/gpu_check.sh``) was asked; :mod:`hacrl_fed.cli.gpu_check` parses it."""

    dry_run: bool
    out: Path
    work_dir: Path | None
    keep_work: bool
    budget_s: float
    skip_tests: bool
    skip_vllm: bool
    repo: Path  # the checkout whose tests/ the pytest steps run (scripts/gpu_check.sh: its root)


def run(args: Options) -> dict[str, Any]:
    s = Settings.for_run(args.dry_run)
    if not s.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (torch.cuda.is_available() is False); use --dry-run on CPU")
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="hacrl-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"dry_run": s.dry_run, "settings": asdict(s), "environment": environment(), "steps": {}}
    model_dir = work / "big-model"
    try:
        _step(results, "build", start, args.budget_s, lambda: build_model(model_dir, s))
        built = results["steps"]["build"].get("status") == "passed"
        if args.skip_tests:
            results["steps"]["gpu tests"] = {"status": "skipped", "reason": "--skip-tests"}
        else:
            _step(
                results,
                "gpu tests",
                start,
                args.budget_s,
                lambda: run_pytest("gpu", ["tests/test_gpu.py"], work, s.pytest_timeout_s, args.repo),
            )
        if built:
            _step(results, "rounds (hf)", start, args.budget_s, lambda: run_rounds(model_dir, work, s, "hf"))
        why_not = "--skip-vllm" if args.skip_vllm else vllm_available(s)
        if why_not is not None:
            for name in ("vllm tests", "rounds (vllm)"):
                results["steps"][name] = {"status": "skipped", "reason": why_not}
        else:
            if args.skip_tests:
                results["steps"]["vllm tests"] = {"status": "skipped", "reason": "--skip-tests"}
            else:
                _step(
                    results,
                    "vllm tests",
                    start,
                    args.budget_s,
                    lambda: run_pytest("vllm", ["tests/test_engines.py"], work, s.pytest_timeout_s, args.repo),
                )
            if built:
                _step(results, "rounds (vllm)", start, args.budget_s, lambda: run_rounds(model_dir, work, s, "vllm"))
    finally:
        if not args.keep_work and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    results["total_seconds"] = time.perf_counter() - start
    results["ok"] = all(step.get("status") != "failed" for step in results["steps"].values())
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2, sort_keys=True, default=str))
    return results


def check(opts: Options) -> int:
    """Every step (:func:`run`), then the table; 0 when no step failed, else 1."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    results = run(opts)
    print(format_table(results))
    print(f"results in {Path(opts.out) / 'gpu_check.json'}")
    return 0 if results["ok"] else 1
