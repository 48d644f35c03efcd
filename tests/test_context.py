"""A prompt that cannot fit a model's context with its token budget is caught before generation: at worker start-up
with a clear error naming the org, the prompt's length and the context, otherwise skipped and counted per call."""

from __future__ import annotations

import json

import pytest

from hacrl_fed.config import BuildError, load_config
from hacrl_fed.models.context import check_task_fits, context_length, fits
from hacrl_fed.types import EvalRequest, RoundPlan, SamplingParams
from hacrl_fed.worker import build_worker

ORGS = [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}, {"id": "globex", "model": {"zoo": "micro-gpt2-bpe"}}]
LONG_QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May? ") * 3


def _jsonl(tmp_path, long_in: str = "test", n: int = 40):
    """GSM8K-style rows; the one long question sits in the held-out split (``test``) or in train."""
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(n)]
    long = {"question": LONG_QUESTION, "answer": "#### 72"}
    train.write_text("\n".join(json.dumps(r) for r in rows + ([long] if long_in == "train" else [])) + "\n")
    test.write_text("\n".join(json.dumps(r) for r in ([long] if long_in == "test" else []) + rows[:5]) + "\n")
    return {"name": "jsonl", "params": {"path": str(train), "test_path": str(test)}, "eval_size": 4}


def _cfg(task, **generation):
    return load_config({"name": "ctx", "seed": 0, "orgs": ORGS, "task": task,
                        "generation": {"num_samples": 2, "max_new_tokens": 16, "eval_max_new_tokens": 16,
                                       **generation},
                        "federation": {"prompts_per_round": 10}})


def test_context_length_reads_the_models_config():
    from transformers import GPT2Config, Qwen3Config

    assert context_length(GPT2Config(n_positions=256)) == (256, "max_position_embeddings")  # an alias
    assert context_length(Qwen3Config(max_position_embeddings=1024)) == (1024, "max_position_embeddings")
    assert context_length(Qwen3Config(max_position_embeddings=1024), 300) == (300, "generation.max_model_len")
    assert fits(200, 56, 256) and not fits(200, 57, 256) and fits(10**6, 10**6, None)


@pytest.mark.parametrize("long_in, field", [("test", "eval_max_new_tokens"), ("train", "max_new_tokens")])
def test_worker_start_up_refuses_prompts_that_do_not_fit(tmp_path, long_in, field):
    cfg = _cfg(_jsonl(tmp_path, long_in))
    with pytest.raises(BuildError) as err:
        build_worker(cfg, "globex", run_dir=tmp_path)
    msg = str(err.value)
    long_id = 0 if long_in == "test" else 35  # the last train row (the 5 test questions leave train)
    assert msg.startswith(f"org 'globex': {long_in} prompt {long_id} of task 'jsonl' is ") and "\n" not in msg
    assert f"generation.{field}=16" in msg and "the model's context of 256 tokens (max_position_embeddings)" in msg
    length = int(msg.split(" is ", 1)[1].split(" tokens", 1)[0])
    assert length + 16 > 256 and length > 200


def test_worker_start_up_accepts_prompts_that_fit(tmp_path):
    cfg = _cfg(_jsonl(tmp_path, long_in="none"))
    worker = build_worker(cfg, "globex", run_dir=tmp_path)
    assert worker.context == 256


def _prompt_tokens(worker, prompts):
    return [len(worker.tokenizer(worker.prompts.render(p), add_special_tokens=False)["input_ids"]) for p in prompts]


def test_prompts_found_too_long_per_call_are_skipped_and_counted(tmp_path):
    cfg = _cfg(_jsonl(tmp_path, long_in="none"))
    worker = build_worker(cfg, "acme", run_dir=tmp_path)
    prompts = tuple(worker.task.prompts("train", range(10)))  # "What is i + i?" with 1- and 2-digit i
    lengths = _prompt_tokens(worker, prompts)
    worker.context = min(lengths) + 16  # as if start-up had not seen the longer ones (a procedural task's rest)
    fitting = {p.prompt_id for p, n in zip(prompts, lengths) if n + 16 <= worker.context}
    assert 0 < len(fitting) < len(prompts)
    batch = worker.generate(RoundPlan("run", 1, "jsonl", prompts,
                                      SamplingParams(max_new_tokens=16, num_samples=2, seed=1)))
    assert {r.prompt_id for r in batch.rollouts} == fitting and len(batch.rollouts) == 2 * len(fitting)
    assert batch.metrics["gen/skipped_too_long"] == len(prompts) - len(fitting)
    test = tuple(worker.task.prompts("test", range(4)))
    worker.context = max(_prompt_tokens(worker, test)) + 15  # the longest held-out prompt does not fit
    report = worker.evaluate(EvalRequest("run", 0, "jsonl", test, max_new_tokens=16))
    assert report.num_prompts == 4 and 1 <= report.metrics["skipped_too_long"] <= 4


def test_check_task_fits_scans_every_prompt_of_an_in_memory_task(tmp_path):
    from hacrl_fed.models import render_prompt
    from hacrl_fed.tasks import get_task
    from tests.helpers_tiny import tiny_char_tokenizer

    task = get_task("jsonl", _jsonl(tmp_path, long_in="train", n=3000)["params"])
    assert task.in_memory and task.size("train") > 2048
    tok = tiny_char_tokenizer()
    render = lambda p: render_prompt(tok, p.messages)  # noqa: E731
    # the long train question is the last row: beyond a procedural task's scan limit, found here
    with pytest.raises(BuildError, match=r"org 'a': train prompt 2995 of task 'jsonl' is \d+ tokens"):
        check_task_fits("a", task, tok, render, 300, "max_position_embeddings", max_new_tokens=16,
                        eval_max_new_tokens=16, eval_ids=range(4))
    got = check_task_fits("a", task, tok, render, 4096, "max_position_embeddings", max_new_tokens=16,
                          eval_max_new_tokens=16, eval_ids=range(4))
    assert got["train"] > len(LONG_QUESTION) > 2 * got["test"]
