"""Sequence scoring: (prompt, response) pairs → token tensors → per-token log-probs under a causal LM.

Layout of a :class:`ScoringBatch` (the same layout ``generate()`` produces)::

    row i:  [pad ... pad | prompt_i ][ response_i | pad ... pad ]
             <------- P columns ----><------- T columns ------->

Prompts are left-padded to a common width ``P`` and responses right-padded to ``T``, so response token ``j`` of
every row sits in column ``P + j`` and its log-prob is read from the logits at column ``P + j - 1``. Positions are
left-padding-aware, ``position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)``, so a padded row scores
exactly like the same row unpadded (docs/ALGORITHM.md: without this, log-probs drift by 4e-3 … 0.2).

Log-probs are temperature-1 and dropout-free: the model is put in eval mode for the forward pass (and its previous
mode restored), logits are upcast to float32 and ``log p(x_t) = logit[x_t] - logsumexp(logit)``.

Re-tokenization of foreign text (:func:`build_scoring_batch`): the rendered prompt and the response are tokenized
*separately* and their ids concatenated; the joined string is never re-tokenized. A BPE tokenizer may merge
characters across the prompt/response boundary, which would move the boundary and shift which tokens count as the
response; tokenizing separately keeps the response exactly the learner's tokenization of the published text
(this is also how the learner's own sampler sees it: the prompt ids are fixed, the response follows).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hacrl_fed.models.lm_head import chunked_log_probs, head_parts
from hacrl_fed.models.native import shared_prompt_logits
from hacrl_fed.types import FINISH_REASONS, FINISH_STOP


@dataclass
class ScoringBatch:
    """Token tensors for scoring, all ``[B, L]`` with ``L = prompt_width + response_width`` (layout: module doc).

    ``attention_mask`` is 1 on real prompt and response tokens; ``response_mask`` is 1 on the response tokens whose
    log-probs are taken (a subset of ``attention_mask`` in columns ``>= prompt_width``). Both are ``torch.long``.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_mask: Tensor
    prompt_width: int

    def __post_init__(self) -> None:
        shape = self.input_ids.shape
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(shape)}")
        for name in ("attention_mask", "position_ids", "response_mask"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"{name} shape {tuple(getattr(self, name).shape)} != input_ids shape {tuple(shape)}")
        if not 0 <= self.prompt_width <= shape[1]:
            raise ValueError(f"prompt_width {self.prompt_width} outside [0, {shape[1]}]")

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_width(self) -> int:
        """``T``: columns after the prompt block (the longest response)."""
        return int(self.input_ids.shape[1]) - self.prompt_width

    @property
    def response_lengths(self) -> Tensor:
        """``[B]`` number of scored response tokens per row."""
        return self.response_mask.sum(-1)

    def to(self, device: torch.device | str) -> ScoringBatch:
        return ScoringBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.position_ids.to(device),
            self.response_mask.to(device),
            self.prompt_width,
        )

    def rows(self, index: slice | Sequence[int]) -> ScoringBatch:
        """The sub-batch of rows ``index``, with columns that are padding in every selected row trimmed off."""
        ids, attn, resp = self.input_ids[index], self.attention_mask[index], self.response_mask[index]
        p = self.prompt_width
        prompt_len = int(attn[:, :p].sum(-1).max()) if ids.shape[0] else 0
        resp_len = int(resp[:, p:].sum(-1).max()) if ids.shape[0] else 0
        cols = slice(p - prompt_len, p + resp_len)
        attn = attn[:, cols]
        return ScoringBatch(ids[:, cols], attn, _positions(attn), resp[:, cols], prompt_len)


def _positions(attention_mask: Tensor) -> Tensor:
    """Left-padding-aware position ids: ``(cumsum(mask) - 1).clamp(min=0)``, shape of ``attention_mask``."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def build_scoring_batch_from_ids(
    prompt_token_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], pad_id: int
) -> ScoringBatch:
    """Pack exact token ids (e.g. an agent's own rollouts) into a :class:`ScoringBatch`.

    Every prompt needs at least one token (the first response token is predicted from the last prompt token).
    Responses may be empty (then nothing is scored for that row). ``pad_id`` fills padding only; masks come from
    the lengths, so a response may legitimately contain ``pad_id``.
    """
    if len(prompt_token_ids) != len(response_ids):
        raise ValueError(f"prompt_token_ids has {len(prompt_token_ids)} rows but response_ids has {len(response_ids)}")
    if pad_id is None:
        raise ValueError("pad_id is None: the tokenizer needs a pad or EOS token")
    for i, p in enumerate(prompt_token_ids):
        if len(p) == 0:
            raise ValueError(f"prompt_token_ids[{i}] is empty: a prompt needs at least one token")
    b = len(prompt_token_ids)
    p_width = max((len(p) for p in prompt_token_ids), default=0)
    t_width = max((len(r) for r in response_ids), default=0)
    ids = torch.full((b, p_width + t_width), int(pad_id), dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompt_token_ids, response_ids)):
        ids[i, p_width - len(p) : p_width] = torch.as_tensor(list(p), dtype=torch.long)
        ids[i, p_width : p_width + len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        attn[i, p_width - len(p) : p_width + len(r)] = 1
        resp[i, p_width : p_width + len(r)] = 1
    return ScoringBatch(ids, attn, _positions(attn), resp, p_width)


def build_scoring_batch(
    tokenizer,
    prompt_texts: Sequence[str],
    responses: Sequence[str],
    finish_reasons: Sequence[str],
    *,
    max_response_tokens: int | None = None,
    eos_token_id: int | None = None,
) -> ScoringBatch:
    """Re-tokenize published (prompt, response, finish_reason) triples for a learner's tokenizer.

    ``prompt_texts`` are already rendered with the learner's chat template (generation prompt included) and are
    tokenized with ``add_special_tokens=False`` (the template carries any BOS). Each response is tokenized on its
    own with ``add_special_tokens=False`` and ``split_special_tokens=True`` (published text cannot smuggle in
    control tokens), then the learner's EOS (``eos_token_id`` or ``tokenizer.eos_token_id``) is appended iff
    ``finish_reason == "stop"``. Prompt and response ids are concatenated, never the joined text (module doc).
    ``max_response_tokens`` keeps only the first that many response tokens (EOS included in the count).
    """
    n = len(prompt_texts)
    if len(responses) != n or len(finish_reasons) != n:
        raise ValueError(
            f"prompt_texts, responses, finish_reasons lengths differ: {n}, {len(responses)}, {len(finish_reasons)}"
        )
    for i, reason in enumerate(finish_reasons):
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish_reasons[{i}] = {reason!r}; expected one of {FINISH_REASONS}")
    if max_response_tokens is not None and max_response_tokens < 0:
        raise ValueError(f"max_response_tokens must be >= 0, got {max_response_tokens}")
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None and FINISH_STOP in finish_reasons:
        raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id to score 'stop' responses")
    prompt_token_ids = tokenizer(list(prompt_texts), add_special_tokens=False)["input_ids"] if n else []
    full = response_token_ids(
        tokenizer, responses, finish_reasons, eos_token_id=eos, max_response_tokens=max_response_tokens
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return build_scoring_batch_from_ids(prompt_token_ids, full, pad)


def response_token_ids(
    tokenizer,
    responses: Sequence[str],
    finish_reasons: Sequence[str],
    *,
    eos_token_id: int | None,
    max_response_tokens: int | None = None,
) -> list[list[int]]:
    """The learner's token ids of published responses: ``tokenizer(text, add_special_tokens=False,
    split_special_tokens=True)`` plus ``eos_token_id`` iff ``finish_reason == "stop"``, cut to
    ``max_response_tokens`` (EOS included in the count). The rules of :func:`build_scoring_batch`."""
    if not responses:
        return []
    ids = tokenizer(list(responses), add_special_tokens=False, split_special_tokens=True)["input_ids"]
    out = []
    for r, reason in zip(ids, finish_reasons):
        row = list(r)
        if reason == FINISH_STOP:
            if eos_token_id is None:
                raise ValueError("a 'stop' response needs the learner's eos_token_id")
            row.append(int(eos_token_id))
        out.append(row if max_response_tokens is None else row[:max_response_tokens])
    return out


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    base = getattr(model, "get_base_model", lambda: model)()  # a PEFT wrapper forwards to its base model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def token_log_probs(
    model: torch.nn.Module, batch: ScoringBatch, *, dropout: Sequence[torch.nn.Module] = (), native: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of the response tokens, in a left-aligned response view.

    Returns ``(token_log_probs, mask)``, both float32 ``[B, T]`` with ``T = batch.response_width``: column ``j`` is
    response token ``j`` (``log p(x_{P+j} | x_{<P+j})``, temperature 1), ``mask`` is 1 where row ``i`` has a
    ``j``-th token and ``token_log_probs`` is exactly 0 elsewhere. Carries gradient when grad is enabled. Runs the
    model in eval mode (no dropout) except for the ``dropout`` modules (the trainer passes its LoRA adapters'
    dropout), and restores every module's previous mode. Memory: a vocabulary above :data:`ONE_PASS_MAX_VOCAB` (every
    real checkpoint) of an architecture :func:`~hacrl_fed.models.lm_head.head_parts` knows never has a
    ``[B, T, V]`` logits tensor, in scoring or in the update: the decoder's final hidden states go through the head
    in chunks of tokens, each chunk checkpointed under gradient (:func:`~hacrl_fed.models.lm_head.chunked_log_probs`).
    The zoo's vocabularies (100-400) keep the whole-tensor path they always took (the same float rounding): logits
    only for the ``T + 1`` last columns when the model supports ``logits_to_keep``, log-softmaxed over token chunks
    above :data:`CHUNK_BYTES` (:func:`gathered_log_probs`).
    ``native``: the hand-written forward of :func:`hacrl_fed.models.native.shared_prompt_logits` instead of the
    model's own, each distinct prompt of the batch run once for all its rows (the caller checks
    :func:`~hacrl_fed.models.native.unsupported_reason`; no dropout there).
    """
    device = _model_device(model)
    b, t = batch.batch_size, batch.response_width
    mask = batch.response_mask[:, batch.prompt_width :].to(device=device, dtype=torch.float32)
    if t == 0 or b == 0:
        return torch.zeros(b, t, device=device), mask
    batch = batch.to(device)
    if native and dropout:
        raise ValueError("the native forward has no dropout: score with the model's own forward")
    targets = batch.input_ids[:, batch.prompt_width :]
    parts = head_parts(model) if _vocab(model) > ONE_PASS_MAX_VOCAB else None
    if parts is not None:  # a real vocabulary: hidden states, then the head in chunks (models/lm_head.py)
        if native:
            hidden = _shared_prompt_logits(model, batch, hidden=True)  # [B, T, H]
        else:
            hidden = _model_outputs(parts.decoder, batch, dropout, model).last_hidden_state[:, -(t + 1) : -1]
        return chunked_log_probs(parts, hidden, targets, mask), mask
    if native:
        logits = _shared_prompt_logits(model, batch).float()  # [B, T, V]
    else:
        logits = _model_outputs(model, batch, dropout, model, keep=t + 1).logits[:, -(t + 1) : -1].float()
    lp = gathered_log_probs(logits, targets)
    return torch.where(mask.bool(), lp, torch.zeros_like(lp)), mask


ONE_PASS_MAX_VOCAB = 4096  # vocabularies up to this (every zoo agent: 100-400) keep the whole-tensor log-softmax


def _vocab(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    return int(getattr(config, "vocab_size", 0) or 0)


CHUNK_BYTES = 256 << 20  # float32 [B, T, V] logits above this are log-softmaxed over token chunks of this size


def gathered_log_probs(logits: Tensor, targets: Tensor, chunk_bytes: int = CHUNK_BYTES) -> Tensor:
    """``log p(target) = logit[target] - logsumexp(logit)`` of ``logits`` ``[B, T, V]`` at ``targets`` ``[B, T]``
    → float32 ``[B, T]`` (differentiable).

    Up to ``chunk_bytes`` of float32 logits (every tiny zoo agent's batch) it is one float32 copy and one
    ``logsumexp`` over the whole tensor. Above it (a real vocabulary: 262,144 × 4 B = 1 MiB per token) the columns
    of ``T`` are taken in chunks of at most ``chunk_bytes`` of float32 logits, so the float32 copy and the
    ``logsumexp`` temporaries exist for one chunk at a time, never ``[B, T, V]``; each token's value is the same
    arithmetic on the same row (tests: bitwise equal to the whole-tensor formula). The threshold keeps the tiny
    agents on the one-pass path they always took."""
    b, t, v = logits.shape
    per_column = max(1, b * v * 4)
    if b * t * v * 4 <= chunk_bytes or t <= 1:
        full = logits.float()
        return full.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(full, dim=-1)
    step = max(1, chunk_bytes // per_column)
    parts = []
    for start in range(0, t, step):
        chunk = logits[:, start : start + step].float()
        picked = chunk.gather(-1, targets[:, start : start + step].unsqueeze(-1)).squeeze(-1)
        parts.append(picked - torch.logsumexp(chunk, dim=-1))
    return torch.cat(parts, dim=1)


def _shared_prompt_logits(model, batch: ScoringBatch, hidden: bool = False) -> Tensor:
    """:func:`~hacrl_fed.models.native.shared_prompt_logits` over a :class:`ScoringBatch`: rows with the same
    (padded) prompt block share one prompt pass. → ``[B, T, V]`` (``hidden``: the final hidden states ``[B, T, H]``)."""
    p = batch.prompt_width
    block = torch.cat((batch.input_ids[:, :p], batch.attention_mask[:, :p]), dim=1)
    _, rows = torch.unique(block, dim=0, return_inverse=True)
    first = torch.full((int(rows.max()) + 1,), batch.batch_size, dtype=torch.long, device=rows.device)
    first = first.scatter_reduce(0, rows, torch.arange(batch.batch_size, device=rows.device), reduce="amin")
    return shared_prompt_logits(
        model, batch.input_ids[first, :p], batch.attention_mask[first, :p], rows, batch.input_ids[:, p:], hidden=hidden
    )


def _model_outputs(
    module: torch.nn.Module, batch: ScoringBatch, dropout: Sequence[torch.nn.Module], model: torch.nn.Module, keep=0
):
    """``module``'s forward (the model, or its decoder: :func:`~hacrl_fed.models.lm_head.head_parts`) with
    ``model`` in eval mode (``dropout`` modules in training mode; every mode restored); ``keep`` > 0: logits of the
    last ``keep`` columns only where the model supports ``logits_to_keep``."""
    extra = {"logits_to_keep": keep} if keep and _accepts_logits_to_keep(model) else {}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    for m in dropout:
        m.train(True)
    try:
        out = module(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
            **extra,
        )
    finally:
        for m, mode in modes:
            m.training = mode
    return out


def _micro_batches(model, batch: ScoringBatch, micro_batch_size: int) -> Iterator[tuple[int, Tensor, Tensor]]:
    """Yield ``(first_row, token_log_probs, mask)`` for consecutive no-grad micro-batches of at most
    ``micro_batch_size`` rows."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    with torch.no_grad():
        for start in range(0, batch.batch_size, micro_batch_size):
            lp, mask = token_log_probs(model, batch.rows(slice(start, start + micro_batch_size)))
            yield start, lp, mask


def sequence_log_probs(model, batch: ScoringBatch, micro_batch_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """No-grad sequence log-probs in micro-batches (memory bounded by ``micro_batch_size`` rows at a time).

    Returns CPU tensors ``(sum [B] float32, count [B] int64, mean [B] float32)`` with
    ``sum = Σ_j log p(response token j)``, ``count`` = scored tokens, ``mean = sum / max(count, 1)``
    (0 for an empty response). Sums accumulate in float64.
    """
    b = batch.batch_size
    total = torch.zeros(b, dtype=torch.float64)
    count = torch.zeros(b, dtype=torch.long)
    for start, lp, mask in _micro_batches(model, batch, micro_batch_size):
        rows = slice(start, start + lp.shape[0])
        total[rows] = lp.double().sum(-1).cpu()
        count[rows] = mask.sum(-1).long().cpu()
    mean = total / count.clamp(min=1)
    return total.float(), count, mean.float()


def per_token_log_probs(model, batch: ScoringBatch, micro_batch_size: int) -> list[list[float]]:
    """No-grad per-token log-probs as Python lists, one per row (length = that row's response length)."""
    result: list[list[float]] = []
    for _, lp, mask in _micro_batches(model, batch, micro_batch_size):
        lengths = mask.sum(-1).long().tolist()
        rows = lp.cpu().tolist()
        result.extend(row[:n] for row, n in zip(rows, lengths))
    return result
