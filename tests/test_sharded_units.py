"""The sharded worker's pieces in one process: per-batch seeding, rank shares, metric merging, refused settings."""

from __future__ import annotations

import pytest
import torch

from hacrl_fed.config import load_config
from hacrl_fed.engines import FastEngine, HFEngine
from hacrl_fed.engines.hf import _seeded, sampling_kwargs
from hacrl_fed.sharded.fsdp import shares
from hacrl_fed.sharded.worker import check_supported
from hacrl_fed.update_metrics import MetricAccumulator as _MetricAccumulator
from tests.helpers_tiny import render, tiny_char_tokenizer, tiny_model

SAMPLING = dict(num_samples=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8)


@pytest.mark.parametrize("engine_cls", [HFEngine, FastEngine])
def test_a_seed_per_batch_makes_each_batch_independent_of_the_others(engine_cls):
    tok = tiny_char_tokenizer()
    engine = engine_cls(tiny_model("qwen3", tok, seed=1), tok, batch_size=6, seed_per_batch=True)
    prompts = [render(tok, f"{a} + {a}") for a in range(4)]  # 16 sequences: batches at 0, 6 and 12
    whole = [g for row in engine.generate(prompts, **SAMPLING, seed=5) for g in row]
    flat = [ids for ids in tok(prompts, add_special_tokens=False)["input_ids"] for _ in range(4)]
    with _seeded(123, torch.device("cpu")):  # any stream before it: the batch reseeds itself
        torch.rand(7)
        alone = engine.sample_batch(flat, 12, 8, sampling_kwargs(1.0, 1.0, 0), 5)
    assert [g.token_ids for g in alone] == [g.token_ids for g in whole[12:]]
    chained = engine_cls(engine.model, tok, batch_size=6)  # the default: one stream per call, another draw
    assert [g.token_ids for row in chained.generate(prompts, **SAMPLING, seed=5) for g in row] != [
        g.token_ids for g in whole
    ]


def test_rank_shares_cover_every_item_once_and_pad_with_zero_scale_stand_ins():
    items = [[0], [1], [2], [3], [4]]
    got = [shares(items, r, 2) for r in range(2)]
    assert got[0] == [([0], 1.0), ([2], 1.0), ([4], 1.0)]
    assert got[1] == [([1], 1.0), ([3], 1.0), ([0], 0.0)]  # one stand-in: both ranks run three passes
    assert shares(items, 0, 1) == [(i, 1.0) for i in items] and shares([], 1, 2) == []
    assert shares(items[:1], 1, 3) == [([0], 0.0)]  # fewer micro-batches than ranks


def test_merged_metrics_equal_one_accumulator_over_all_steps():
    steps = [
        ({"a": 1.0, "x_min": 0.5, "x_max": 2.0, "num_rows": 3.0}, 2.0),
        ({"a": 4.0, "x_min": -1.0, "x_max": 1.0, "num_rows": 1.0}, 1.0),
        ({"a": 0.0, "x_min": 0.0, "x_max": 5.0, "num_rows": 2.0}, 3.0),
    ]
    one, left, right = _MetricAccumulator(), _MetricAccumulator(), _MetricAccumulator()
    for i, (m, w) in enumerate(steps):
        one.add(m, w)
        (left if i % 2 == 0 else right).add(m, w)
    left.merge(right)
    assert left.result() == pytest.approx(one.result())
    assert one.result() == pytest.approx({"a": 6.0 / 6, "x_min": -1.0, "x_max": 5.0, "num_rows": 6.0})


def _cfg(ranks: int, **extra):
    org = {"id": "char", "model": {"zoo": "micro-qwen-char"}, "sharding": {"ranks": ranks}}
    return load_config({"name": "t", "orgs": [org], "task": {"name": "arithmetic"}, **extra})


def test_unsupported_sharded_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"orgs\[0\]\.generation\.engine=vllm with orgs\[0\]\.sharding\.ranks=2"):
        check_supported(_cfg(2, generation={"engine": "vllm"}), "char")
    with pytest.raises(ValueError, match=r"orgs\[0\]\.trainer\.precision=bf16-master.*sharding\.mixed_precision"):
        check_supported(_cfg(2, trainer={"precision": "bf16-master"}), "char")
    with pytest.raises(ValueError, match=r"orgs\[0\]\.trainer\.outcome_guard\.enabled=true .*with orgs\[0\]\.sharding\.ranks=2"):
        check_supported(_cfg(2, trainer={"outcome_guard": {"enabled": True}}), "char")
    # the guard is on by default: a sharded org must turn it off itself, and the refusal says how
    with pytest.raises(ValueError, match=r"set orgs\[0\]\.trainer\.outcome_guard\.enabled: false"):
        check_supported(_cfg(2), "char")
    check_supported(_cfg(1, trainer={"outcome_guard": {"enabled": True}}), "char", world_size=1)
    unguarded = {"outcome_guard": {"enabled": False}}
    check_supported(_cfg(2, trainer=unguarded), "char", world_size=2)
    with pytest.raises(ValueError, match=r"orgs\[0\]\.sharding\.ranks=2 .*but the worker's process group has 3 ranks"):
        check_supported(_cfg(2, trainer=unguarded), "char", world_size=3)
    check_supported(_cfg(1, generation={"engine": "vllm"}), "char", world_size=1)  # one plain process: all engines
    check_supported(_cfg(2, generation={"engine": "fast"}, trainer=unguarded), "char", world_size=2)


def test_the_sharded_gpu_recipe_loads_and_is_supported_at_8_ranks():
    from pathlib import Path

    from hacrl_fed.config import org_generation, org_trainer

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "recipes" / "qwen3-8b-sharded+qwen3-1.7b.yaml")
    big = cfg.org("qwen3-8b").sharding
    assert (big.ranks, big.backend, big.mixed_precision, big.cpu_offload) == (8, "nccl", "bf16", True)
    assert org_generation(cfg, "qwen3-8b").engine == "hf" and org_generation(cfg, "qwen3-8b").seed_per_batch
    assert org_trainer(cfg, "qwen3-8b").precision == "model" and org_trainer(cfg, "qwen3-8b").gradient_checkpointing
    check_supported(cfg, "qwen3-8b", world_size=8)
    check_supported(cfg, "qwen3-1.7b", world_size=1)


def test_an_error_that_cannot_travel_to_the_other_ranks_travels_as_its_text():
    from hacrl_fed.sharded.fsdp import portable

    class Local(Exception):  # defined in a function: pickle cannot find it by name
        pass

    plain = ValueError("bad")
    assert portable(plain) is plain
    moved = portable(Local("rank 0 failed"))
    assert type(moved) is RuntimeError and str(moved) == "Local: rank 0 failed"
