"""Before any worker starts: each org's peak memory, estimated from its model config and the plan's batch sizes,
against the memory this machine has available; a run that cannot fit is refused with one line naming the org, the
phase and the fields to change (:func:`check_memory`, called by ``hacrl-fed run`` for the orgs it builds or starts
and by ``hacrl-fed simulate``).

Per org, with ``P`` parameters (counted on the meta device: no weights are read), ``P_t`` of them trained and
``b`` bytes per weight (``model.dtype``)::

    resident    weights P·b (+ P·b for a KL reference model), optimizer 2·P_t·b (AdamW's two moments; bf16-master:
                a float32 master and float32 moments, 12·P_t), outcome guard  guard_copies() · (P_t·b + optimizer)
    generate    KV cache  N·L·layers·2·kv_heads·head_dim·b, and a few float32 [N, V] step logits  4·N·V·4
    train       gradients P_t·b, activations  m·L·layers·(8·h + 4·i + heads·L)·b (gradient checkpointing: one
                layer's, plus each layer's input m·L·h·b), logits 3·HEAD_CHUNK_BYTES (the chunked head; a zoo
                vocabulary's whole-tensor path: 3·m·L·V·4)

with ``N = generation.batch_size``, ``m = trainer.micro_batch_size``, ``L`` = :data:`PROMPT_TOKENS` +
``generation.max_new_tokens``, ``h``/``i`` the hidden and MLP widths, plus :data:`PROCESS_BYTES` per process (torch,
transformers, tokenizers). An org's peak is its resident memory plus its largest phase. Orgs in one process
(``--transport inprocess``) run their phases one after another: the host's peak is one process's overhead, every
org's resident memory and the largest phase. Orgs in processes of their own (launched gRPC workers, simulation):
the sum of each org's peak and overhead. The estimate is an order of magnitude (each phase's measured peak is the
metric ``<org>/perf/<phase>/peak_rss_mb``), so only a plan that exceeds the available memory (``MemAvailable``)
is refused;
orgs on a CUDA device, sharded orgs and the ``vllm`` engine are not counted in the host's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hacrl_fed.config import BuildError, ConfigError, RunConfig, org_generation, org_trainer

GIB = float(2**30)
PROCESS_BYTES = 1 << 30  # torch + transformers + tokenizers in one Python process
PROMPT_TOKENS = 128  # assumed prompt length (chat template included) for the plan's sequences


def guard_copies(guard: Any) -> float:
    """Copies of the trained weights + optimizer state the outcome guard keeps in memory beside the learner's. 0
    since issue 44: its validated reference and its shadow live in files (hacrl_fed/worker/stash.py), read
    memory-mapped (page cache, reclaimable) only while one is copied onto the model. The one place the estimate
    reads the guard's footprint from: change it with the guard."""
    del guard  # on or off, nothing resident
    return 0.0


@dataclass
class OrgMemory:
    """One org's estimate in bytes: ``resident`` parts and each phase's own parts."""

    org: str
    index: int
    resident: dict[str, float] = field(default_factory=dict)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def phase_peak(self) -> tuple[str, float]:
        """``(phase, bytes)`` of the org's largest phase (its own parts only)."""
        name = max(self.phases, key=lambda p: sum(self.phases[p].values()))
        return name, sum(self.phases[name].values())

    def peak(self) -> float:
        return sum(self.resident.values()) + self.phase_peak()[1]

    def parts(self) -> str:
        """``weights 1.10, optimizer 2.20, ... GiB`` of the resident parts and the largest phase's."""
        items = {**self.resident, **self.phases[self.phase_peak()[0]]}
        shown = [f"{k} {v / GIB:.2f}" for k, v in items.items() if v >= 0.005 * GIB]
        return (", ".join(shown) + " GiB") if shown else "each part under 0.01 GiB"


def _shape(config: Any) -> dict[str, int]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    return {
        "h": h,
        "i": int(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * h),
        "layers": int(text.num_hidden_layers),
        "heads": heads,
        "kv": int(getattr(text, "num_key_value_heads", None) or heads),
        "d": int(getattr(text, "head_dim", None) or h // heads),
        "vocab": int(text.vocab_size),
    }


def count_parameters(config: Any) -> int:
    """Parameters of the model ``config`` describes, built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def estimate_org(cfg: RunConfig, org_id: str, config: Any, params: int, dtype_bytes: int) -> OrgMemory:
    """The estimate of org ``org_id`` (module doc) for its model ``config`` with ``params`` parameters."""
    from hacrl_fed.models.lm_head import HEAD_CHUNK_BYTES
    from hacrl_fed.scoring import ONE_PASS_MAX_VOCAB

    s, gen, trainer = _shape(config), org_generation(cfg, org_id), org_trainer(cfg, org_id)
    b, length = dtype_bytes, PROMPT_TOKENS + gen.max_new_tokens
    trained = params * 0.02 if trainer.lora.enabled else float(params)
    master = trainer.precision == "bf16-master"
    optimizer = trained * (12 if master else 2 * b)
    out = OrgMemory(org_id, [o.id for o in cfg.orgs].index(org_id))
    out.resident = {
        "weights": params * b * (2 if cfg.algorithm.kl_beta > 0 else 1),
        "optimizer": optimizer,
        "outcome guard": guard_copies(trainer.outcome_guard) * (trained * b + optimizer),
    }
    kv = gen.batch_size * length * s["layers"] * 2 * s["kv"] * s["d"] * b
    out.phases["generate"] = {"KV cache": kv, "step logits": 4.0 * gen.batch_size * s["vocab"] * 4}
    tokens = trainer.micro_batch_size * length
    per_layer = tokens * (8 * s["h"] + 4 * s["i"] + s["heads"] * length) * b
    layers = 1 + s["layers"] * s["h"] * tokens * b / per_layer if trainer.gradient_checkpointing else s["layers"]
    out.phases["train"] = {
        "gradients": trained * b,
        "activations": per_layer * layers,
        "logits": 3.0 * (HEAD_CHUNK_BYTES if s["vocab"] > ONE_PASS_MAX_VOCAB else tokens * s["vocab"] * 4),
    }
    return out


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (memory a new process can take without swapping), None
    where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_peak(orgs: Sequence[OrgMemory], one_process: bool) -> float:
    """The host's peak for ``orgs`` (module doc): one process, or one process each."""
    if not orgs:
        return 0.0
    if one_process:
        return PROCESS_BYTES + sum(sum(o.resident.values()) for o in orgs) + max(o.phase_peak()[1] for o in orgs)
    return sum(PROCESS_BYTES + o.peak() for o in orgs)


def _fields(cfg: RunConfig, org: OrgMemory, phase: str) -> str:
    """The settings of ``org`` that shrink ``phase`` (or its resident memory), named as config fields."""
    trainer, at = org_trainer(cfg, org.org), f"orgs[{org.index}]"
    if phase == "generate":
        names = [f"{at}.generation.batch_size", f"{at}.generation.max_new_tokens"]
    else:
        names = [f"{at}.trainer.micro_batch_size"]
        if not trainer.gradient_checkpointing:
            names.append(f"{at}.trainer.gradient_checkpointing: true")
    if trainer.outcome_guard.enabled:
        names.append(f"{at}.trainer.outcome_guard.counterfactual: false (or enabled: false)")
    return ", ".join(names)


def refusal(cfg: RunConfig, orgs: Sequence[OrgMemory], one_process: bool, available: float) -> str | None:
    """The one-line refusal when the host's estimated peak exceeds ``available`` bytes, else None."""
    total = host_peak(orgs, one_process)
    if total <= available:
        return None
    worst = max(orgs, key=lambda o: o.peak())
    phase, _ = worst.phase_peak()
    where = "in one process" if one_process else "in a process each"
    return (
        f"memory: org {worst.org!r} needs an estimated {worst.peak() / GIB:.2f} GiB in phase {phase} "
        f"({worst.parts()}); the {len(orgs)} org(s) on this host {where} {total / GIB:.2f} GiB, more than the "
        f"{available / GIB:.2f} GiB available: lower {_fields(cfg, worst, phase)}"
    )


def estimate_orgs(cfg: RunConfig, org_ids: Sequence[str]) -> list[OrgMemory]:
    """The estimates of the orgs of ``org_ids`` whose memory is this host's (module doc)."""
    import torch

    from hacrl_fed.models.loading import model_sources, resolve_device, resolve_dtype
    from hacrl_fed.preflight import model_config

    out = []
    for org_id in org_ids:
        org, gen = cfg.org(org_id), org_generation(cfg, org_id)
        device = resolve_device(org.model.device)
        if device.type != "cpu" or org.sharding.ranks > 1 or gen.engine == "vllm":
            continue
        try:
            config = model_config(org.model, model_sources(org.model)[0])
        except BuildError:  # the worker reports it in its own words; nothing to estimate
            continue
        dtype_bytes = torch.empty(0, dtype=resolve_dtype(org.model.dtype, device)).element_size()
        out.append(estimate_org(cfg, org_id, config, count_parameters(config), dtype_bytes))
    return out


def check_memory(cfg: RunConfig, org_ids: Sequence[str], *, one_process: bool) -> list[OrgMemory]:
    """Raise :class:`ConfigError` (one line: org, phase, fields) when the orgs of ``org_ids`` cannot fit in this
    host's available memory (module doc); → the estimates."""
    orgs = estimate_orgs(cfg, org_ids)
    available = available_bytes()
    line = refusal(cfg, orgs, one_process, available) if available is not None else None
    if line is not None:
        raise ConfigError(line)
    return orgs
