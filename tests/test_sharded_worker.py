"""The sharded policy worker (issue 28) on CPU with gloo: 2 ranks under torchrun against the 1-process worker.

One torchrun launch (``tests/sharded_round.py``, 2 ranks) runs every case; the reference is the same script's
``run_case`` in this process (no process group: the plain worker). Rollouts and evaluation must be equal; the
weights after the update equal up to float32 round-off: ``atol = 1e-5`` on updates of 1e-3 (full parameters, lr
1e-3) to 2e-2 (LoRA, lr 1e-2) per weight (measured difference <= 1e-6: the gradient's sum over ranks runs in
another order).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.sharded_round import cfg_data, resume_case, run_case, step_case

ROOT = Path(__file__).resolve().parents[1]
# -batchseed: generation.seed_per_batch; -gc: gradient checkpointing; -offload: sharding.cpu_offload (a no-op for a
# model on the CPU: it must change nothing); -kl: algorithm.kl_beta 0.05 (the KL term's mean over all self tokens);
# -ckpt: a checkpoint of round 1, then round 2 (the resume tests); -inband: algorithm.baseline_rows: in_band (the
# step-0 ratios scored whole on every rank)
CASES = (
    "hacpo-ckpt",
    "gspo-batchseed",
    "hacpo-lora-batchseed-ckpt",
    "gspo-lora",
    "hacpo-kl-gc-offload",
    "hacpo-inband",
)


def torchrun(nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc tests/sharded_round.py args`` with
    this worktree first on the path and one thread per rank; the whole process group is killed on a timeout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(ROOT / "tests" / "sharded_round.py"),
        *args,
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """One launch of 2 ranks: every case, the checkpointed run, and the resume of the plain checkpointed run."""
    out = tmp_path_factory.mktemp("sharded")
    torch.set_num_threads(1)
    torch.save(run_case("hacpo-ckpt", 1, out / "run-1"), out / "hacpo-ckpt-1.pt")
    resume = f"resume:hacpo-ckpt:{out / 'run-1' / 'hacpo-ckpt'}"
    torchrun(2, str(out), *CASES, "hacpo-bf16", "hacpo-batchseed-step", resume)
    return out


def one_process(two_ranks: Path, case: str, tmp_path: Path) -> dict:
    """The one-process run of ``case`` (the fixture's when it made one)."""
    made = two_ranks / f"{case}-1.pt"
    return torch.load(made, weights_only=False) if made.is_file() else run_case(case, 1, tmp_path)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_give_the_one_process_round(two_ranks, tmp_path, case):
    torch.set_num_threads(1)
    want = one_process(two_ranks, case, tmp_path)
    got = torch.load(two_ranks / f"{case}-2.pt", weights_only=False)
    assert got["rollouts"] == want["rollouts"] and got["eval"] == want["eval"]
    # 16 sequences in engine batches of 8: with a seed per batch each rank samples one, else rank 0 samples both
    assert want["batches"] == [[0, 8]]
    assert got["batches"] == ([[0], [8]] if "batchseed" in case else [[0, 8], []])
    for key in ("train/steps", "train/num_rows", "train/num_self", "train/num_cross", "train/num_backward"):
        assert got["train"][key] == want["train"][key], key
    for key in ("train/loss", "train/grad_norm", "train/kl"):
        assert got["train"][key] == pytest.approx(want["train"][key], rel=1e-5, abs=1e-7), key
    baseline = [k for k in want["train"] if "baseline_cross" in k]
    assert bool(baseline) == ("inband" in case)
    assert all(got["train"][k] == want["train"][k] for k in baseline)  # every rank took the same rows
    assert want["train"]["train/grad_norm"] > 0 and (want["train"]["train/kl"] > 0) == ("kl" in case)
    moved = max((want["weights"][k] - want["before"][k]).abs().max().item() for k in want["weights"])
    assert moved > 5e-4  # the update is far above the tolerance
    for k, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][k], w, atol=1e-5, rtol=0, msg=k)


@pytest.mark.slow
def test_bf16_mixed_precision_trains_float32_shards_close_to_the_float32_update(two_ranks, tmp_path):
    """sharding.mixed_precision: bf16 computes in bfloat16: the same rollouts (sampled before the update), the loss
    within 2%, float32 weights, and an update pointing the float32 update's way (Adam's first steps are nearly
    sign steps, so bf16 noise flips small components: measured cosine 0.68)."""
    want = one_process(two_ranks, "hacpo-ckpt", tmp_path)  # its round 1 is the plain hacpo round
    got = torch.load(two_ranks / "hacpo-bf16-2.pt", weights_only=False)
    assert got["rollouts"] == want["rollouts"]
    assert got["train"]["train/loss"] == pytest.approx(want["train"]["train/loss"], rel=0.02)
    assert {w.dtype for w in got["weights"].values()} == {torch.float32}

    def step(r: dict) -> torch.Tensor:
        return torch.cat([(r["weights"][k] - r["before"][k]).flatten() for k in sorted(r["weights"])])

    assert torch.nn.functional.cosine_similarity(step(got), step(want), dim=0) > 0.5
    assert 0 < _max_diff(got["weights"], want["weights"]) < 1e-2


@pytest.mark.slow
def test_two_rounds_through_step_give_the_one_process_rewards(two_ranks, tmp_path):
    """The endpoint's API: round 1's plan, then train + evaluate + checkpoint + round 2's plan in one message. Every
    part succeeds; each round's rollouts and rewards are the one-process ones (round 2's log-prob sums, sampled
    after an update equal only up to round-off, within 1e-4)."""
    want = step_case("hacpo-batchseed-step", 1, tmp_path)
    got = torch.load(two_ranks / "hacpo-batchseed-step-2.pt", weights_only=False)
    assert got["errors"] == want["errors"] == ["", "", "", ""]
    assert got["rounds"][0] == want["rounds"][0] and got["eval"] == want["eval"]
    for mine, theirs in zip(got["rounds"][1], want["rounds"][1], strict=True):
        assert mine["logprob_sum"] == pytest.approx(theirs["logprob_sum"], abs=1e-4)
        assert {**mine, "logprob_sum": 0.0} == {**theirs, "logprob_sum": 0.0}
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert (Path(got["checkpoint"]) / "dcp").is_dir()


@pytest.mark.slow
def test_resume_with_another_number_of_ranks(two_ranks):
    """1 -> 2 (the 2 ranks resumed the plain checkpoint) and 2 -> 1 (here, from the sharded one): the weights come
    back bit for bit, round 2 samples the same rollouts and trains to the uninterrupted run's weights."""
    plain, sharded = (torch.load(two_ranks / f"hacpo-ckpt-{n}.pt", weights_only=False) for n in (1, 2))
    up = torch.load(two_ranks / "resume-hacpo-ckpt-2.pt", weights_only=False)
    down = resume_case("hacpo-ckpt", 1, two_ranks / "run-2" / "hacpo-ckpt")
    assert (Path(sharded["checkpoint"]) / "dcp").is_dir() and not (
        Path(sharded["checkpoint"]) / "model.safetensors"
    ).exists()
    assert _max_diff(up["resumed"], plain["weights"]) == 0.0 and _max_diff(down["resumed"], sharded["weights"]) == 0.0
    assert up["round2"][0] == plain["round2"][0] and down["round2"][0] == sharded["round2"][0]
    assert _max_diff(plain["weights2"], plain["weights"]) > 1e-3  # round 2 moves the weights (Adam's 2nd step)
    for resumed, ref in ((up, plain), (down, sharded), (down, plain)):
        assert _max_diff(resumed["weights2"], ref["weights2"]) < 1e-5


@pytest.mark.slow
def test_a_sharded_lora_checkpoint_resumes_in_one_process(two_ranks):
    """The adapters' shards and their AdamW state come back by name in a one-process worker (2 -> 1)."""
    sharded = torch.load(two_ranks / "hacpo-lora-batchseed-ckpt-2.pt", weights_only=False)
    down = resume_case("hacpo-lora-batchseed-ckpt", 1, two_ranks / "run-2" / "hacpo-lora-batchseed-ckpt")
    assert _max_diff(down["resumed"], sharded["weights"]) == 0.0 and down["round2"][0] == sharded["round2"][0]
    assert _max_diff(sharded["weights2"], sharded["weights"]) > 1e-3
    assert _max_diff(down["weights2"], sharded["weights2"]) < 1e-5


@pytest.mark.slow
def test_export_from_a_sharded_checkpoint_equals_the_plain_export(two_ranks, tmp_path):
    from safetensors.torch import load_file

    from hacrl_fed.export import export_model

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg_data("hacpo-ckpt", 1)))
    out = {
        n: export_model(two_ranks / f"run-{n}" / "hacpo-ckpt", "char", tmp_path / f"export-{n}", config=config)
        for n in (1, 2)
    }
    assert sorted(p.name for p in out[1].iterdir()) == sorted(p.name for p in out[2].iterdir())
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert (out[1] / name).read_text() == (out[2] / name).read_text(), name
    exported = {n: load_file(str(out[n] / "model.safetensors")) for n in (1, 2)}
    sharded = torch.load(two_ranks / "hacpo-ckpt-2.pt", weights_only=False)["weights"]
    assert _max_diff(exported[2], {k: sharded[k] for k in exported[2]}) == 0.0  # the sharded run's own weights
    assert _max_diff(exported[2], exported[1]) < 1e-5  # and the plain run's up to round-off
