"""PolicyWorker with real (micro) transformers agents: generate → train → evaluate, cross-tokenizer, resume."""

import json
from pathlib import Path

import pytest
import torch

from hacrl_fed.config import load_config
from hacrl_fed.trainer import LocalTrainer, TrainRow
from hacrl_fed.types import EvalRequest, RoundPlan, SamplingParams, TrainRequest
from hacrl_fed.worker import WorkerAPI, build_worker
from hacrl_fed.worker.checkpoint_manifest import write_manifest
from hacrl_fed.worker.guard import RequestRefused
from tests.helpers_tiny import PAPER_TRAINER

ORGS = [{"id": "char", "model": {"zoo": "micro-qwen-char"}}, {"id": "bpe", "model": {"zoo": "micro-gpt2-bpe"}}]


def make_cfg(algorithm="hacpo", **extra):
    data = {"name": "t", "seed": 3, "orgs": ORGS, "algorithm": {"name": algorithm},
            # every foreign row reaches the update (rule all, no likelihood screen: their own tests)
            "trainer": {"lr": 1e-3, "minibatch_size": 16, "micro_batch_size": 8, **PAPER_TRAINER},
            "generation": {"num_samples": 4, "max_new_tokens": 12}, "task": {"name": "arithmetic", "eval_size": 8},
            # these tests feed hand-made foreign rewards and unsigned rollouts: the trust boundary (signatures,
            # re-verification) is tested in test_security_attacks.py
            "security": {"signing": False, "reverify_rewards": False}}
    data.update(extra)
    return load_config(data)


def plan_for(worker, round_, n=4, seed=11):
    prompts = tuple(worker.task.prompts("train", list(range(round_ * 10, round_ * 10 + n))))
    return RoundPlan("run", round_, "arithmetic", prompts, SamplingParams(max_new_tokens=12, num_samples=4, seed=seed))


def params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def cfg():
    return make_cfg()


def test_worker_satisfies_api_and_generates(cfg, tmp_path):
    w = build_worker(cfg, "char", run_dir=tmp_path)
    assert isinstance(w, WorkerAPI)
    batch = w.generate(plan_for(w, 1))
    assert len(batch.rollouts) == 16 and batch.org_id == "char" and batch.round == 1
    assert {(r.prompt_id, r.sample_index) for r in batch.rollouts} == {(p, j) for p in range(10, 14) for j in range(4)}
    for r in batch.rollouts:
        assert 0.0 <= r.reward <= 1.0 and r.logprob_sum <= 0 and 1 <= r.token_count <= 13
        assert r.finish_reason in ("stop", "length")
    assert batch.accuracy == pytest.approx(sum(r.reward for r in batch.rollouts) / 16)


def test_cross_tokenizer_train_changes_weights_and_reports_metrics(cfg, tmp_path):
    a, b = build_worker(cfg, "char", run_dir=tmp_path), build_worker(cfg, "bpe", run_dir=tmp_path)
    plan = plan_for(a, 1)
    ra, rb = a.generate(plan), b.generate(plan)
    before = params(a.model)
    # give the learner a non-uniform joint group so advantages are non-zero
    foreign = tuple(r.__class__(**{**r.__dict__, "reward": float(i % 2)}) for i, r in enumerate(rb.rollouts))
    report = a.train(TrainRequest("run", 1, "char", plan.prompts, foreign, {"char": 0.5, "bpe": 0.25}))
    assert report.metrics["train/num_cross"] == 16 and report.metrics["train/num_self"] == 16
    assert "hacpo/cross_clip_low_frac" in report.metrics and report.metrics["train/steps"] == 2
    assert any(not torch.equal(x, y) for x, y in zip(before, params(a.model)))
    with pytest.raises(RequestRefused, match="generated nothing"):
        a.train(TrainRequest("run", 1, "char", plan.prompts, foreign, {}))


def test_gspo_ignores_foreign_rows(tmp_path):
    cfg = make_cfg("gspo")
    a, b = build_worker(cfg, "char", run_dir=tmp_path), build_worker(cfg, "bpe", run_dir=tmp_path)
    plan = plan_for(a, 2)
    a.generate(plan)
    rep = a.train(TrainRequest("run", 2, "char", plan.prompts, b.generate(plan).rollouts, {}))
    assert rep.metrics.get("train/num_cross", 0.0) == 0.0


def test_bad_requests(cfg, tmp_path):
    w = build_worker(cfg, "char", run_dir=tmp_path)
    with pytest.raises(ValueError, match="task"):
        w.generate(RoundPlan("run", 1, "jsonl", (), SamplingParams()))
    plan = plan_for(w, 1)
    w.generate(plan)
    with pytest.raises(ValueError, match="org"):
        w.train(TrainRequest("run", 1, "bpe", plan.prompts, (), {}))


def test_evaluate_greedy_is_deterministic(cfg, tmp_path):
    w = build_worker(cfg, "bpe", run_dir=tmp_path)
    req = EvalRequest("run", 0, "arithmetic", tuple(w.task.prompts("test", range(8))), max_new_tokens=12)
    r1, r2 = w.evaluate(req), w.evaluate(req)
    assert r1.num_prompts == 8 and 0.0 <= r1.accuracy <= 1.0 and r1.accuracy == r2.accuracy


def test_checkpoint_resume_gives_identical_next_round(cfg, tmp_path):
    a, b = build_worker(cfg, "char", run_dir=tmp_path), build_worker(cfg, "bpe", run_dir=tmp_path)
    p1, p2 = plan_for(a, 1), plan_for(a, 2)
    a.generate(p1)
    a.train(TrainRequest("run", 1, "char", p1.prompts, b.generate(p1).rollouts, {"char": 0.4, "bpe": 0.2}))
    path = a.checkpoint(1)
    assert (Path(path) / "model.safetensors").is_file()
    foreign2 = b.generate(p2).rollouts
    want = a.generate(p2)
    a.train(TrainRequest("run", 2, "char", p2.prompts, foreign2, {"char": 0.4, "bpe": 0.2}))
    resumed = build_worker(cfg, "char", run_dir=tmp_path, resume=True)
    assert resumed.last_round == 1 and a.health()["version"] == "2" and resumed.health()["version"] == "1"
    got = resumed.generate(p2)
    assert got.rollouts == want.rollouts and got.accuracy == want.accuracy
    resumed.train(TrainRequest("run", 2, "char", p2.prompts, foreign2, {"char": 0.4, "bpe": 0.2}))
    for x, y in zip(params(a.model), params(resumed.model)):
        assert torch.allclose(x, y, atol=1e-6)
    # the count of updates comes back from the checkpoint (an asynchronous org that rejoined has done fewer updates
    # than its round: 0 here), or is its round for a checkpoint written before the field
    state = Path(path) / "state.json"
    saved = json.loads(state.read_text())
    assert saved["version"] == 1
    without = {k: v for k, v in saved.items() if k != "version"}
    for recorded, reported in ((0, "0"), (None, "1"), ("0", "1"), (-1, "1")):  # not a count >= 0: its round
        state.write_text(json.dumps(without if recorded is None else {**without, "version": recorded}))
        write_manifest(Path(path))  # as that worker wrote it: a whole checkpoint
        assert build_worker(cfg, "char", run_dir=tmp_path, resume=True).health()["version"] == reported


def _fixed_rows(worker, n=8):
    plan = plan_for(worker, 5, n=n // 4)
    batch = worker.generate(plan)
    rows = worker._own.rows
    for i, r in enumerate(rows):
        r.reward = float(i % 2)
    worker._own = None
    return rows, batch


@pytest.mark.parametrize("algorithm,lr", [("grpo", 1e-4), ("hacpo", 1e-5)])
def test_training_step_lowers_loss_on_fixed_batch(tmp_path, algorithm, lr):
    """A step lowers the loss of the same batch. HACPO's self band is 1 +- 4e-4, so its step must stay inside the
    trust region (small lr); so must GRPO's token ratios (0.2/0.28 band)."""
    cfg = make_cfg(algorithm)
    w = build_worker(cfg, "char", run_dir=tmp_path)
    rows, _ = _fixed_rows(w)
    before = params(w.model)
    trainer = LocalTrainer(w.model, cfg.algorithm.model_copy(update={"name": algorithm}),
                           cfg.trainer.model_copy(update={"lr": lr, "minibatch_size": 64}), w.tokenizer.pad_token_id)
    losses = [trainer.update(rows, 0, [1.0])["train/loss"] for _ in range(3)]
    assert losses[1] < losses[0] and losses[2] < losses[0], losses
    assert any(not torch.equal(x, y) for x, y in zip(before, params(w.model)))


def test_trainrow_rejects_nothing_silently_when_empty(cfg, tmp_path):
    w = build_worker(cfg, "char", run_dir=tmp_path)
    out = w.trainer.update([TrainRow([1, 2], [], 1.0, 0, 0, True, -1.0, [])], 0, [1.0])
    assert out["train/steps"] == 0.0


def test_report_has_mean_advantage_per_source(cfg, tmp_path):
    a, b = build_worker(cfg, "char", run_dir=tmp_path), build_worker(cfg, "bpe", run_dir=tmp_path)
    plan = plan_for(a, 1)
    a.generate(plan)
    foreign = tuple(r.__class__(**{**r.__dict__, "reward": float(i % 2)}) for i, r in enumerate(b.generate(plan).rollouts))
    rep = a.train(TrainRequest("run", 1, "char", plan.prompts, foreign, {"char": 0.5, "bpe": 0.25}))
    assert {"hacpo/adv_mean/char", "hacpo/adv_mean/bpe"} <= set(rep.metrics)


def test_lora_trains_only_adapters(tmp_path):
    cfg = make_cfg("hacpo", trainer={"lr": 1e-2, "minibatch_size": 16, "micro_batch_size": 8,
                                      "lora": {"enabled": True, "r": 4, "target_modules": "all-linear"}})
    a, b = build_worker(cfg, "char", run_dir=tmp_path), build_worker(cfg, "bpe", run_dir=tmp_path)
    named = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    plan = plan_for(a, 1)
    a.generate(plan)
    foreign = tuple(r.__class__(**{**r.__dict__, "reward": float(i % 2)}) for i, r in enumerate(b.generate(plan).rollouts))
    a.train(TrainRequest("run", 1, "char", plan.prompts, foreign, {"char": 0.5, "bpe": 0.5}))
    changed = {n for n, p in a.model.named_parameters() if not torch.equal(p, named[n])}
    assert changed and all("lora_" in n for n in changed)
    assert a.generate(plan_for(a, 2)).rollouts  # the wrapped model still generates


def test_perf_metrics_per_phase(cfg, tmp_path):
    a, b = build_worker(cfg, "char", run_dir=tmp_path), build_worker(cfg, "bpe", run_dir=tmp_path)
    plan = plan_for(a, 1)
    batch = a.generate(plan)
    gen = batch.metrics
    assert gen["perf/generate/tokens"] == sum(r.token_count for r in batch.rollouts)
    assert gen["perf/generate/tokens_per_s"] > 0 and gen["perf/generate/peak_rss_mb"] > 0  # CPU: peak RSS
    rep = a.train(TrainRequest("run", 1, "char", plan.prompts, b.generate(plan).rollouts, {"char": 0.5, "bpe": 0.2}))
    m = rep.metrics
    assert m["perf/score/tokens"] > 0 and m["perf/train/tokens"] == m["train/num_tokens"] > 0
    for phase in ("score", "train"):
        assert m[f"perf/{phase}/tokens_per_s"] > 0 and m[f"perf/{phase}/seconds"] > 0
        assert f"perf/{phase}/peak_rss_mb" in m and f"perf/{phase}/peak_gpu_mem_mb" not in m


def test_trainer_numerics_options_reach_the_worker(tmp_path):
    cfg = make_cfg("hacpo", trainer={"lr": 1e-3, "minibatch_size": 16, "micro_batch_size": 8,
                                      "gradient_checkpointing": True, "precision": "bf16-master"},
                   orgs=[{"id": "char", "model": {"zoo": "micro-qwen-char", "device": "cpu", "dtype": "bfloat16"}}])
    w = build_worker(cfg, "char", run_dir=tmp_path)
    assert next(w.model.parameters()).dtype == torch.bfloat16 and w.trainer.master is not None
    assert any(getattr(m, "_hacrl_checkpointed", False) for m in w.model.modules())
    plan = plan_for(w, 1)
    w.generate(plan)
    rep = w.train(TrainRequest("run", 1, "char", plan.prompts, (), {"char": 0.5}))
    assert rep.metrics["train/steps"] >= 1


def test_vllm_engine_gets_the_generation_section_and_sleeps_during_train(tmp_path, monkeypatch):
    import helpers_fake_vllm

    fake = helpers_fake_vllm.install(monkeypatch)
    orgs = [{"id": "char", "model": {"zoo": "micro-qwen-char"}, "seed": 1234,
             "generation": {"engine": "vllm", "gpu_memory_utilization": 0.25, "max_model_len": 200,
                            "dtype": "float16", "sleep_during_train": True,
                            "vllm_kwargs": {"swap_space": 1, "enforce_eager": True}}},
            {"id": "bpe", "model": {"zoo": "micro-gpt2-bpe"}}]
    cfg = make_cfg("hacpo", orgs=orgs)
    a, b = build_worker(cfg, "char", run_dir=tmp_path), build_worker(cfg, "bpe", run_dir=tmp_path)
    (llm,) = fake.LLM.instances  # only the vllm org built one
    from hacrl_fed.models.loading import model_sources

    path = model_sources(cfg.org("char").model)[0]
    assert llm.kwargs == dict(model=path, tokenizer=path, dtype="float16", gpu_memory_utilization=0.25, seed=1234,
                              enforce_eager=True, logprobs_mode="raw_logprobs", generation_config="vllm",
                              max_model_len=200, max_num_seqs=64, enable_sleep_mode=True, swap_space=1)
    plan = plan_for(a, 1)
    batch = a.generate(plan)
    assert len(batch.rollouts) == 16 and batch.metrics["perf/generate/tokens"] > 0
    asleep = []
    update = a.trainer.update
    monkeypatch.setattr(a.trainer, "update", lambda *args, **kw: (asleep.append(llm.asleep), update(*args, **kw))[1])
    llm.calls.clear()
    a.train(TrainRequest("run", 1, "char", plan.prompts, b.generate(plan).rollouts, {"char": 0.5, "bpe": 0.2}))
    assert asleep == [True]
    assert llm.calls == [("sleep", 1), ("wake_up",), ("apply_model",), ("reset_prefix_cache",)]
    for name, p in llm.model.named_parameters():  # the engine generates with the updated weights
        assert torch.allclose(p, dict(a.model.named_parameters())[name].float())
    assert a.generate(plan_for(a, 2)).rollouts


def test_per_byte_logprob_norm_divides_both_sides_by_the_response_bytes(tmp_path):
    from hacrl_fed.types import Rollout
    from hacrl_fed.worker.ledger import Ledger

    for norm in ("per_token", "per_byte"):
        cfg = make_cfg()
        cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"logprob_norm": norm})})
        w = build_worker(cfg, "char", run_dir=tmp_path / norm)
        plan = plan_for(w, 1)
        w.generate(plan)
        pid = plan.prompts[0].prompt_id
        text = "12 é"  # 5 UTF-8 bytes
        foreign = Rollout("bpe", 1, pid, 0, text, "length", 1.0, logprob_sum=-6.0, token_count=3)
        ledger = Ledger()
        rows = w.intake.retokenize([foreign], w._own, ["char", "bpe"], ledger)
        dropped = ledger.unscored()
        assert dropped == 0 and len(rows) == 1
        if norm == "per_byte":
            assert rows[0].norm_length == 5.0 and rows[0].old_seq_log_prob == pytest.approx(-6.0 / 5)
        else:
            assert rows[0].norm_length == 0.0 and rows[0].old_seq_log_prob == pytest.approx(-2.0)
