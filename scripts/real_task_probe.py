"""Which task and prompt format give each real checkpoint signal before training (issue 43 item 5)?

For each candidate (a model, its ``model.prompt_format`` / ``model.few_shot``, the arithmetic task's params and an
optional system prompt) the script renders ``--n`` prompts the way a run's worker does
(:func:`hacrl_fed.models.prompting.prompt_style`), answers each once greedily and ``--k`` times at temperature 1
with the ``fast`` engine (the engine the real-model configs run), and scores them with the task's verifier:

- ``greedy``: greedy accuracy (what the run's held-out evaluation reports, 10-60 % wanted);
- ``pass@1``: mean reward of the samples; ``any@k``: the fraction of prompts with at least one correct sample of
  ``k`` (a group GSPO/HACPO can learn from needs one);
- ``stopped``: the fraction of all answers (greedy and sampled) that ended on a stop id before ``--max-new-tokens``
  (the run's ``round/<org>/stopped_frac``; >= 0.95 wanted); ``tokens``: mean response length.

The prompts are **train-split** problems of task seed ``--seed`` (default 9001, a seed no benchmark runs), so the
choice never looks at a held-out (test-partition) problem. Needs ``make real-models``; run it under the shared lock:

    flock /tmp/hacrl-real.lock python scripts/real_task_probe.py --n 64 --out benchmarks/real_task/probe.json
    python scripts/real_task_probe.py --only gemma-c3-add1   # one candidate by name

Prints a table and writes the JSON (every candidate's settings and numbers, the command, wall seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hacrl_fed.config import ModelConfig
from hacrl_fed.engines import build_engine
from hacrl_fed.models.loading import load_model_and_tokenizer
from hacrl_fed.models.prompting import prompt_style
from hacrl_fed.tasks import get_task
from hacrl_fed.types import FINISH_STOP

ANSWER_ONLY = "Answer with only the number."


@dataclass(frozen=True)
class Candidate:
    """One row of the table: a model, its prompt format and the task it is asked."""

    name: str
    real: str
    prompt_format: str
    few_shot: int
    params: dict[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None


ADD1 = {"difficulty": 1, "ops": "+-", "max_operand": 99}
ADD1_SMALL = {"difficulty": 1, "ops": "+-", "max_operand": 20}
TWO_STEP = {"difficulty": 2, "ops": "+-", "max_operand": 20}
ADD50 = {"difficulty": 1, "ops": "+", "max_operand": 50}
CANDIDATES = (
    Candidate("gemma-c8-add50", "gemma3-270m", "completion", 8, ADD50),
    Candidate("smol-chat-add50-sys", "smollm2-135m", "chat", 0, ADD50, ANSWER_ONLY),
    Candidate("smol-c8-add50", "smollm2-135m", "completion", 8, ADD50),
    Candidate("gemma-c3-add1", "gemma3-270m", "completion", 3, ADD1),
    Candidate("gemma-c8-add1", "gemma3-270m", "completion", 8, ADD1),
    Candidate("gemma-c3-add1-small", "gemma3-270m", "completion", 3, ADD1_SMALL),
    Candidate("gemma-c8-two-step", "gemma3-270m", "completion", 8, TWO_STEP),
    Candidate("gemma-c8-add1-sys", "gemma3-270m", "completion", 8, ADD1, ANSWER_ONLY),
    Candidate("smol-chat-add1", "smollm2-135m", "chat", 0, ADD1),
    Candidate("smol-chat-add1-sys", "smollm2-135m", "chat", 0, ADD1, ANSWER_ONLY),
    Candidate("smol-chat-add1-small-sys", "smollm2-135m", "chat", 0, ADD1_SMALL, ANSWER_ONLY),
    Candidate("smol-chat-two-step-sys", "smollm2-135m", "chat", 0, TWO_STEP, ANSWER_ONLY),
    Candidate("smol-c8-add1", "smollm2-135m", "completion", 8, ADD1),
)


def probe(cand: Candidate, loaded: tuple[Any, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The row of the module docstring for ``cand`` (``loaded``: its model and tokenizer)."""
    model, tok = loaded
    params = {**cand.params, "system_prompt": cand.system_prompt}
    task = get_task("arithmetic", params, seed=args.seed)
    prompts = task.prompts("train", list(range(args.n)))
    style = prompt_style(tok, task, prompt_format=cand.prompt_format, few_shot=cand.few_shot)
    texts = [style.render(tok, p.messages) for p in prompts]
    engine = build_engine("fast", model, tok, batch_size=args.batch_size, extra_stop_ids=style.stop_ids)
    start = time.perf_counter()
    greedy = engine.greedy(texts, max_new_tokens=args.max_new_tokens)
    rows = engine.generate(
        texts, num_samples=args.k, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new_tokens, seed=0
    )
    seconds = time.perf_counter() - start
    rewards = [[task.verify(g.text, p.reference) for g in row] for row, p in zip(rows, prompts)]
    answers = list(greedy) + [g for row in rows for g in row]
    return {
        **asdict(cand),
        "greedy": sum(task.verify(g.text, p.reference) for g, p in zip(greedy, prompts)) / len(prompts),
        "pass@1": sum(map(sum, rewards)) / (len(prompts) * args.k),
        f"any@{args.k}": sum(max(r) >= 1.0 for r in rewards) / len(prompts),
        "stopped": sum(g.finish_reason == FINISH_STOP for g in answers) / len(answers),
        "tokens": sum(len(g.token_ids) for g in answers) / len(answers),
        "prompt_tokens": sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts) / len(texts),
        "seconds": round(seconds, 1),
        "example": {"prompt": texts[0][-160:], "greedy": greedy[0].text, "reference": prompts[0].reference},
    }


def table(rows: list[dict[str, Any]], k: int) -> str:
    head = f"{'candidate':<26} {'format':<12} {'greedy':>6} {'pass@1':>6} {f'any@{k}':>6} {'stopped':>7} {'tokens':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        fmt = f"{r['prompt_format']}/{r['few_shot']}" if r["prompt_format"] == "completion" else "chat"
        lines.append(
            f"{r['name']:<26} {fmt:<12} {r['greedy']:>6.3f} {r['pass@1']:>6.3f} {r[f'any@{k}']:>6.3f} "
            f"{r['stopped']:>7.3f} {r['tokens']:>6.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=64, help="prompts per candidate (train split of --seed)")
    ap.add_argument("--k", type=int, default=4, help="temperature-1 samples per prompt")
    ap.add_argument("--seed", type=int, default=9001, help="task seed (no benchmark runs it)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="candidate names (default: all)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    chosen = [c for c in CANDIDATES if args.only is None or c.name in args.only]
    start, rows, cache = time.perf_counter(), [], {}
    for cand in chosen:
        if cand.real not in cache:
            cache.clear()  # one checkpoint in memory at a time
            cache[cand.real] = load_model_and_tokenizer(ModelConfig(real=cand.real), for_training=False)
        rows.append(probe(cand, cache[cand.real], args))
        print(table(rows[-1:], args.k).splitlines()[-1], flush=True)
    print(table(rows, args.k))
    if args.out:
        out = {"command": " ".join(sys.argv), "settings": vars(args), "rows": rows}
        out["wall_s"] = round(time.perf_counter() - start, 1)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
