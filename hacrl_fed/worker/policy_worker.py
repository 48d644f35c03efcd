"""An organization's policy worker: owns the private model, generates and verifies rollouts, trains locally.

Implements :class:`hacrl_fed.worker.api.WorkerAPI`. Each round: :meth:`generate` (pre-update weights) then
:meth:`train` (own rollouts of that round + foreign ones). Only text, rewards and sequence log-probs leave it.

Rounds of a run are trained at most once: after ``train`` of round ``t`` of run ``R`` (remembered in checkpoints),
``generate`` refuses every plan of run ``R`` with round ``<= t`` with :class:`StaleRoundError`. That happens when
a coordinator restarts from a state older than the worker's (killed between a train and its state write, with the
worker kept running or resumed from a newer checkpoint); the coordinator counts it as this org's gap for that
round (``stale_round``) and the org rejoins at round ``t + 1``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hacrl_fed.config import RunConfig, org_generation, org_trainer
from hacrl_fed.engines import EngineOptions, build_engine
from hacrl_fed.models.chat import eos_token_id, render_prompt
from hacrl_fed.models.loading import load_model_and_tokenizer, model_sources
from hacrl_fed.perf import PhaseMeter

from hacrl_fed.scoring import response_token_ids
from hacrl_fed.seeding import stable_seed
from hacrl_fed.tasks import get_task
from hacrl_fed.trainer import LocalTrainer, TrainRow
from hacrl_fed.types import (
    EvalReport, EvalRequest, Prompt, Rollout, RolloutBatch, RoundPlan, TrainReport, TrainRequest,
)
from hacrl_fed.worker.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

log = logging.getLogger(__name__)


class StaleRoundError(RuntimeError):
    """A plan for a round this worker already trained in the same run (see the module docstring)."""


FOREIGN_LENGTH_FACTOR = 8  # foreign responses longer than this × max_new_tokens (learner tokens) are not trained on


@dataclass
class _OwnRound:
    """What :meth:`PolicyWorker.generate` keeps for this round's :meth:`PolicyWorker.train`."""

    round: int
    max_new_tokens: int
    prompt_ids: dict[int, list[int]]  # prompt_id -> learner tokens of the rendered prompt
    rows: list[TrainRow]


class PolicyWorker:
    """One organization's model, tokenizer, optimizer and generation engine."""

    def __init__(self, cfg: RunConfig, org_id: str, *, run_dir: str | Path, resume: bool = False):
        self.cfg, self.org_id = cfg, org_id
        org = cfg.org(org_id)
        self.gen_cfg, self.trainer_cfg = org_generation(cfg, org_id), org_trainer(cfg, org_id)
        self.seed = org.seed if org.seed is not None else stable_seed(cfg.seed, "org", org_id) % (2**31)
        torch.manual_seed(self.seed)
        self.model, self.tokenizer = load_model_and_tokenizer(org.model)
        if self.trainer_cfg.lora.enabled:
            self.model = _wrap_lora(self.model, self.trainer_cfg)
        self.task = get_task(cfg.task.name, cfg.task.params, seed=cfg.seed)
        model_path, tokenizer_path = model_sources(org.model)
        self.engine = build_engine(self.gen_cfg.engine, self.model, self.tokenizer,
                                   EngineOptions.from_config(self.gen_cfg, seed=self.seed, model_path=model_path,
                                                             tokenizer_path=tokenizer_path))
        self.eos_id = eos_token_id(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.trainer = LocalTrainer(self.model, cfg.algorithm, self.trainer_cfg, pad if pad is not None else self.eos_id)
        self.ckpt_root = Path(run_dir) / "orgs" / org_id / "checkpoints"
        self.last_round = 0
        self.last_run_id: str | None = None  # run of last_round (None: nothing trained, or an older checkpoint)
        self._own: _OwnRound | None = None
        self._prompt_cache: dict[tuple[int, tuple], str] = {}
        if resume:
            self.restore()

    # -- rendering -------------------------------------------------------------------------------------------
    def _render(self, prompt: Prompt) -> str:
        key = (prompt.prompt_id, prompt.messages)
        if key not in self._prompt_cache:
            if len(self._prompt_cache) > 100_000:
                self._prompt_cache.clear()
            self._prompt_cache[key] = render_prompt(self.tokenizer, prompt.messages)
        return self._prompt_cache[key]

    def _check_task(self, task: str) -> None:
        if task != self.task.name:
            raise ValueError(f"request is for task {task!r} but worker {self.org_id!r} runs {self.task.name!r}")

    # -- WorkerAPI -------------------------------------------------------------------------------------------
    def generate(self, plan: RoundPlan) -> RolloutBatch:
        """Sample ``G`` responses per prompt with the pre-update weights, verify, and publish them."""
        self._check_task(plan.task)
        if plan.run_id == self.last_run_id and plan.round <= self.last_round:
            raise StaleRoundError(f"worker {self.org_id!r} already trained round {self.last_round} of run "
                                  f"{plan.run_id!r}; refusing a plan for round {plan.round}")
        t0 = time.perf_counter()
        perf = PhaseMeter(self._device())
        sp = plan.sampling
        texts = [self._render(p) for p in plan.prompts]
        gens = self.engine.generate(texts, num_samples=sp.num_samples, temperature=sp.temperature, top_p=sp.top_p,
                                    top_k=sp.top_k, max_new_tokens=sp.max_new_tokens,
                                    seed=stable_seed(sp.seed, self.seed) % (2**31))
        t1 = time.perf_counter()
        gen_perf = perf.lap("generate", sum(g.token_count for row in gens for g in row))
        prompt_ids = dict(zip((p.prompt_id for p in plan.prompts),
                              self.tokenizer(texts, add_special_tokens=False)["input_ids"]))
        rollouts, rows = [], []
        for prompt, samples in zip(plan.prompts, gens):
            for j, g in enumerate(samples):
                reward = float(self.task.verify(g.text, prompt.reference))
                rollouts.append(Rollout(self.org_id, plan.round, prompt.prompt_id, j, g.text, g.finish_reason,
                                        reward, g.logprob_sum, g.token_count))
                rows.append(TrainRow(list(prompt_ids[prompt.prompt_id]), list(g.token_ids), reward,
                                     prompt.prompt_id, 0, True, g.logprob_sum / max(g.token_count, 1),
                                     list(g.token_log_probs)))
        self._own = _OwnRound(plan.round, sp.max_new_tokens, prompt_ids, rows)
        acc = sum(r.reward for r in rollouts) / max(len(rollouts), 1)
        metrics = {"time/generate": t1 - t0, "time/verify": time.perf_counter() - t1,
                   "gen/mean_tokens": sum(r.token_count for r in rollouts) / max(len(rollouts), 1),
                   "gen/stop_frac": sum(r.finish_reason == "stop" for r in rollouts) / max(len(rollouts), 1),
                   **gen_perf}
        return RolloutBatch(plan.run_id, plan.round, self.org_id, tuple(rollouts), acc, metrics)

    def train(self, request: TrainRequest) -> TrainReport:
        """Score foreign rollouts with this model's tokenizer and run this round's update."""
        own = self._own
        if own is None or own.round != request.round:
            raise RuntimeError(f"train for round {request.round} but this worker generated "
                               f"{'nothing' if own is None else f'round {own.round}'}")
        if request.org_id != self.org_id:
            raise ValueError(f"train request for org {request.org_id!r} sent to worker {self.org_id!r}")
        t0 = time.perf_counter()
        perf = PhaseMeter(self._device())
        agents = sorted(set(request.capability) | {self.org_id} | {r.org_id for r in request.foreign})
        learner = agents.index(self.org_id)
        capability = [float(request.capability.get(a, 1.0)) for a in agents]
        for row in own.rows:
            row.source = learner
        foreign_rows, dropped = self._foreign_rows(request, own, agents)
        score_perf = perf.lap("score", sum(len(r.response_ids) for r in foreign_rows))
        t1 = time.perf_counter()
        with self.engine.released():  # a vLLM engine may sleep during the update (generation.sleep_during_train)
            metrics = self.trainer.update(own.rows + foreign_rows, learner, capability, names=agents)
        self.engine.sync_weights(self.model)
        metrics.update({**score_perf, **perf.lap("train", metrics.get("train/num_tokens", 0.0))})
        self._own = None
        self.last_round, self.last_run_id = request.round, request.run_id
        metrics.update({"time/score": t1 - t0, "time/train": time.perf_counter() - t1,
                        "train/foreign_received": float(len(request.foreign)),
                        "train/foreign_unscored": float(dropped)})
        return TrainReport(request.run_id, request.round, self.org_id, metrics)

    def _foreign_rows(self, request: TrainRequest, own: _OwnRound, agents: list[str]) -> tuple[list[TrainRow], int]:
        """Re-tokenize foreign responses with this learner's template and tokenizer (EOS iff the source stopped)."""
        prompts = {p.prompt_id for p in request.prompts}
        usable = [r for r in request.foreign
                  if r.org_id != self.org_id and r.prompt_id in prompts and r.prompt_id in own.prompt_ids
                  and r.token_count > 0 and math.isfinite(r.logprob_sum)]
        dropped = len(request.foreign) - len(usable)
        if not usable:
            return [], dropped
        # prompts: this round's rendered-and-tokenized ids from generate(); responses: the learner's tokens
        responses = response_token_ids(self.tokenizer, [r.response for r in usable],
                                       [r.finish_reason for r in usable], eos_token_id=self.eos_id)
        cap = FOREIGN_LENGTH_FACTOR * own.max_new_tokens
        rows = []
        for r, resp in zip(usable, responses):
            if not resp or len(resp) > cap:  # kept with no tokens: counts in the group's baseline, not trained on
                dropped += 1
                resp = []
            rows.append(TrainRow(own.prompt_ids[r.prompt_id], resp, float(r.reward), r.prompt_id,
                                 agents.index(r.org_id), False, r.mean_log_prob))
        return rows, dropped

    def evaluate(self, request: EvalRequest) -> EvalReport:
        """Greedy accuracy on held-out prompts."""
        self._check_task(request.task)
        t0 = time.perf_counter()
        gens = self.engine.greedy([self._render(p) for p in request.prompts], max_new_tokens=request.max_new_tokens)
        rewards = [float(self.task.verify(g.text, p.reference)) for p, g in zip(request.prompts, gens)]
        acc = sum(rewards) / max(len(rewards), 1)
        return EvalReport(request.run_id, request.round, self.org_id, acc, len(rewards),
                          {"time/eval": time.perf_counter() - t0})

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def health(self) -> dict[str, str]:
        return {"org_id": self.org_id, "status": "ok", "round": str(self.last_round),
                "params": str(sum(p.numel() for p in self.model.parameters()))}

    def checkpoint(self, round: int) -> str:
        path = save_checkpoint(self.ckpt_root, round, self.model, self.trainer.state_dict(),
                               {"org_id": self.org_id, "last_round": self.last_round, "run_id": self.last_run_id})
        return str(path)

    def restore(self) -> int:
        """Load the latest checkpoint if any; returns the restored round (0 when none)."""
        path = latest_checkpoint(self.ckpt_root)
        if path is None:
            return 0
        trainer_state, state = load_checkpoint(path, self.model)
        self.trainer.load_state_dict(trainer_state)
        self.engine.sync_weights(self.model)
        self.last_round = int(state["last_round"])
        self.last_run_id = state.get("run_id")
        log.info("worker %s resumed from %s (round %d)", self.org_id, path, self.last_round)
        return self.last_round


def _wrap_lora(model, trainer_cfg):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:  # pragma: no cover - peft is optional
        raise ImportError("trainer.lora.enabled needs peft: pip install 'hacrl-fed[lora]'") from err
    lc = trainer_cfg.lora
    return get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                            target_modules=lc.target_modules, task_type="CAUSAL_LM"))
