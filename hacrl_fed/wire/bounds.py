"""How large a message to a policy worker can honestly be, from the run config: the worker's gRPC receive limit.

The largest request an org's worker receives is its ``TrainRequest`` (its plan's prompts plus every other org's
signed batch of ``prompts × G`` rollouts) or its ``EvalRequest`` (``task.eval_size`` prompts). With
``P = federation.prompts_per_round``, ``G_o`` and ``T_o`` each org's ``generation.num_samples`` and
``generation.max_new_tokens``, ``b = security.max_bytes_per_token``:

    train = P × PROMPT_BYTES + Σ_o P × G_o × (T_o × b + ROLLOUT_OVERHEAD) + orgs × BATCH_OVERHEAD + SLACK
    eval  = task.eval_size × PROMPT_BYTES + SLACK

and the bound is the larger of the two (at most ``federation.max_message_mb``); with asynchronous rounds
(``federation.staleness >= 1``, window ``W``) the batches' part of ``train`` is ``W`` times larger.
``PROMPT_BYTES`` is the room for one prompt (chat messages and reference, as UTF-8, 64 KiB): a task whose
prompts are longer gets its requests refused by gRPC (RESOURCE_EXHAUSTED). ``configs/demo.yaml`` gives 13.5 MiB
(its 200 eval prompts' room dominates; a train request needs at most 2.7 MiB) and ``configs/smoke.yaml`` 2.0 MiB,
instead of a flat 256 MiB: a larger message is refused by gRPC before it is read into Python.
"""

from __future__ import annotations

from hacrl_fed.config import RunConfig, org_generation
from hacrl_fed.wire.codec import WireLimits

PROMPT_BYTES = 64 * 2**10  # one prompt's chat messages + reference (UTF-8), with their protobuf framing
ROLLOUT_OVERHEAD = 256  # one Rollout's fixed fields, framing and (sealed) AEAD tag / padding marker
BATCH_OVERHEAD = 64 * 2**10  # one RolloutBatch's header, metrics map, signature and wrapped keys
SLACK = 2**20  # the request's own header and capability table, and margin


def worker_limits(cfg: RunConfig) -> WireLimits:
    """The decode-time caps of a worker of this run: unsigned loose rows only counted when signing; with
    asynchronous rounds (``federation.staleness >= 1``) a train request's rounds bounded by the window ``W`` and its
    source batches and tags by ``W x (orgs - 1)``."""
    fed = cfg.federation
    if fed.staleness < 1:
        return WireLimits(skip_unsigned_foreign=cfg.security.signing)
    return WireLimits(
        skip_unsigned_foreign=cfg.security.signing, window=fed.effective_window, max_sources=len(cfg.orgs) - 1
    )


def max_request_bytes(cfg: RunConfig, org_id: str) -> int:
    """The largest request ``org_id``'s worker can need for this config, in bytes (module docstring)."""
    del org_id  # every org receives the same shape of request (its own plan is part of P × PROMPT_BYTES)
    fed, b = cfg.federation, cfg.security.max_bytes_per_token
    p = fed.prompts_per_round
    rollouts = 0
    for o in cfg.orgs:
        gen = org_generation(cfg, o.id)
        rollouts += p * gen.num_samples * (gen.max_new_tokens * b + ROLLOUT_OVERHEAD)
    w = fed.effective_window if fed.staleness >= 1 else 1  # asynchronous rounds: batches of W rounds
    train = p * PROMPT_BYTES + w * (rollouts + len(cfg.orgs) * BATCH_OVERHEAD) + SLACK
    evaluate = cfg.task.eval_size * PROMPT_BYTES + SLACK
    return min(max(train, evaluate), fed.max_message_mb * 2**20)
