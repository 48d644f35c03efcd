"""The ``fast`` engine: a lean decoding loop for small causal LMs that records log-probs as it samples.

Why: at the zoo's sizes (< 1 M parameters) transformers' ``generate()`` spends most of a decoding step in per-step
Python (logits processors, cache bookkeeping, mask building) rather than in arithmetic, and the ``hf`` engine then
runs a second forward pass over prompt + response for the published log-probs. This engine does neither:

- **One loop, preallocated KV cache.** Prompts are left-padded into one ``[N, P]`` block; per layer a key and a
  value cache of ``[N, kv_heads, P + max_new_tokens, head_dim]`` is allocated once, the prompt is prefilled in one
  pass and every step appends one column. Positions are left-padding-aware, ``position_ids =
  (attention_mask.cumsum(-1) - 1).clamp(min=0)`` (the layout and positions of :mod:`hacrl_fed.scoring`), and pad
  keys are masked, so every row decodes as it would unpadded. Whenever a quarter of the rows still decoding have
  stopped, they leave the batch (the cache keeps only the live rows); the others go on until they stop or reach
  ``max_new_tokens``.
- **Log-probs as it goes.** At each step the raw logits (float32) give ``log_softmax`` once: the sampled token's
  entry is recorded — the temperature-1 log-prob the scoring pass computes, whatever ``temperature`` / ``top_k`` /
  ``top_p`` shaped the sampling — and no second forward pass is made. KV-cache decoding and a full forward agree
  to float round-off (tests: within the 1e-4 the ``hf`` engine's tests use, ~1e-6 in float32 at the zoo's
  sizes; above :data:`RECORD_MAX_PARAMETERS` parameters the scoring pass gives the published values).
- **Only the asked-for sampling.** ``logits / temperature``, then top-k, then top-p (the smallest set of tokens,
  most likely first, whose probability reaches ``top_p``), then one draw by the Gumbel-max trick
  (``argmax(logits - log(E))``, ``E ~ Exp(1)``: an exact sample of the softmax). Nothing from the model's own
  ``generation_config`` applies. Greedy decoding is the argmax of the raw logits (first index on ties, as
  ``generate()``). Stops on the id set :func:`~hacrl_fed.engines.base.stop_token_ids`.

Two decoders share the loop. Qwen3-, Llama- and GPT-2-architecture models (``Qwen3ForCausalLM``,
``LlamaForCausalLM``, ``GPT2LMHeadModel``: the zoo) run a hand-written forward over the model's own parameter
tensors (read at each call, so in-place updates by the trainer are seen; nothing is copied), with the model's own
rotary-embedding module for the cos/sin tables. Any other causal LM — another architecture, a PEFT/LoRA-wrapped
model, a model with forward hooks, sliding-window attention or a length-dependent RoPE — falls back to the same
loop over the model's own ``forward`` with its ``past_key_values`` cache (still one pass, log-probs as it goes; only
the per-step overhead stays transformers'). :func:`decoder_kind` says which applies.

Seeding: the inherited :meth:`~hacrl_fed.engines.hf.HFEngine.generate` forks the torch RNG and seeds it with the
call's ``seed``, so the same seed and ``batch_size`` give the same samples and the caller's RNG is untouched.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from hacrl_fed.engines.base import Generation, decode_response, register_engine, split_response
from hacrl_fed.engines.hf import HFEngine
from hacrl_fed.models.native import NativeDecoder, unsupported_reason
from hacrl_fed.scoring import build_scoring_batch_from_ids, per_token_log_probs

_unsupported_reason = unsupported_reason  # module-level name: the tests force the fallback by patching it
_Native = NativeDecoder


RECORD_MAX_PARAMETERS = 50_000_000  # above: published log-probs from the scoring pass, not the decoding loop


def _parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def decoder_kind(model) -> str:
    """``"native"`` (the hand-written forward) or ``"model"`` (the model's own forward with its cache)."""
    return "native" if _unsupported_reason(model) is None else "model"


class _ModelForward:
    """Any causal LM: its own ``forward`` with ``past_key_values`` (the fallback of :class:`FastEngine`)."""

    def __init__(self, model, attention_mask: Tensor) -> None:
        self.model, self.attention_mask, self.cache = model, attention_mask, None  # mask: [N, L] 0/1
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = inspect.signature(type(base).forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x: cache
        self.keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def __call__(self, ids: Tensor, pos: Tensor, bias: Tensor, start: int) -> Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=self.attention_mask[:, : start + ids.shape[1]],
            position_ids=pos,
            use_cache=True,
            **{self.cache_arg: self.cache},
            **self.keep,
        )
        self.cache = out.cache if "cache" in out else out.past_key_values
        return out.logits[:, -1]


@contextmanager
def _eval_mode(model) -> Iterator[None]:
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def sample_tokens(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """One token per row of ``logits`` ``[N, V]`` (float32) from ``softmax(logits / temperature)`` restricted to
    the ``top_k`` most likely (0: all) and then to the smallest most-likely-first set of probability ``>= top_p``.
    Gumbel-max draw with the torch RNG. → ``[N]`` long."""
    x = logits / temperature if temperature != 1.0 else logits
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = sorted_x.softmax(-1)
        drop = (p.cumsum(-1) - p) >= top_p  # the mass before a token already reaches top_p (never the first)
        x = x.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    log_e = torch.rand_like(x).clamp_(min=1e-30).log_().neg_().log_()  # log E, E = -log U ~ Exp(1)
    return (x - log_e).argmax(-1)


def _layout(prompt_ids: list[list[int]], width: int, pad_id: int, device: torch.device, dtype: torch.dtype):
    """Left-padded ``ids`` ``[N, P]``, the 0/1 ``mask`` ``[N, P + width]`` (response columns all 1), the prompt's
    left-padding-aware ``positions`` ``[N, P]``, each row's first response position ``first`` ``[N]``, and the
    additive attention biases of the prefill ``[N, 1, P, P]`` (causal, pad keys masked; a pad query attends to
    itself so that no row of the softmax is empty) and of the decoding steps ``[N, P + width]`` (pad keys)."""
    n, p = len(prompt_ids), max(len(r) for r in prompt_ids)
    ids = torch.full((n, p), pad_id, dtype=torch.long)
    mask = torch.ones((n, p + width), dtype=torch.long)
    for i, row in enumerate(prompt_ids):
        ids[i, p - len(row) :] = torch.as_tensor(row, dtype=torch.long)
        mask[i, : p - len(row)] = 0
    ids, mask = ids.to(device), mask.to(device)
    allowed = torch.ones(p, p, dtype=torch.bool, device=device).tril()[None] & mask[:, None, :p].bool()
    allowed |= torch.eye(p, dtype=torch.bool, device=device)
    prefill_bias = torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill(~allowed, -math.inf)
    step_bias = torch.zeros(mask.shape, device=device, dtype=dtype).masked_fill(mask == 0, -math.inf)
    positions = (mask[:, :p].cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions, mask[:, :p].sum(-1), prefill_bias[:, None], step_bias


def _prefill(decoder, prompt_ids: list[list[int]], ids: Tensor, positions: Tensor, bias: Tensor) -> Tensor:
    """Last-column logits ``[N, V]`` of the prompts. The native decoder runs each distinct prompt once (a prompt
    repeated for its samples) and copies its cache to the copies."""
    if not isinstance(decoder, _Native):
        return decoder(ids, positions, bias, 0)
    keys = [tuple(r) for r in prompt_ids]
    slot: dict[tuple[int, ...], int] = {}  # prompt -> its row in the prefill
    uniq: list[int] = []  # the first row of each distinct prompt
    for i, k in enumerate(keys):
        if k not in slot:
            slot[k] = len(uniq)
            uniq.append(i)
    u = torch.tensor(uniq, device=ids.device)
    logits = decoder(ids[u], positions[u], bias[u], 0)
    rows = torch.tensor([slot[k] for k in keys], device=ids.device)
    decoder.expand(rows, ids.shape[1])
    return logits[rows]


class FastEngine(HFEngine):
    """``GenerationEngine`` running the lean loop (module doc) over the trainer's own model object.

    ``batch_size``: sequences decoded together (as the ``hf`` engine's ``generate()`` calls). Prompt encoding,
    batching, seeding and :meth:`sync_weights` are :class:`~hacrl_fed.engines.hf.HFEngine`'s. A model that is
    not float32, or that has more than :data:`RECORD_MAX_PARAMETERS` parameters, has its published log-probs
    recomputed by the scoring pass: KV-cache decoding and a full forward differ by more than the 1e-4 per token the
    published values promise in half precision, and at real size in float32 too (measured on Gemma 3 270M with
    its own forward: up to 1.2e-4, mean 3e-5; SmolLM2-135M, hand-written: up to 3.6e-5). The tiny agents (< 1 M
    parameters) keep the values recorded while decoding.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        batch_size: int = 64,
        seed_per_batch: bool = False,
        extra_stop_ids: Sequence[int] = (),
    ) -> None:
        super().__init__(
            model, tokenizer, batch_size=batch_size, seed_per_batch=seed_per_batch, extra_stop_ids=extra_stop_ids
        )
        self.steps = 0  # decoder forward calls made (prefill + one per further token), for tests and profiling

    def _run(self, prompt_ids: list[list[int]], max_new_tokens: int, sampling: dict) -> list[Generation]:
        """Decode ``prompt_ids`` (one sequence each) together → one Generation per row."""
        device, dtype = self._device(), next(self.model.parameters()).dtype
        t = int(max_new_tokens)
        ids, mask, positions, first, prefill_bias, step_bias = _layout(prompt_ids, t, self.pad_id, device, dtype)
        with _eval_mode(self.model), torch.inference_mode():
            if _unsupported_reason(self.model) is None:
                decoder: _Native | _ModelForward = _Native(self.model, len(prompt_ids), mask.shape[1], device)
            else:
                decoder = _ModelForward(self.model, mask)
            logits = _prefill(decoder, prompt_ids, ids, positions, prefill_bias)
            self.steps += 1
            tokens, log_probs = self._decode(decoder, logits, ids.shape[1], first, step_bias, t, sampling)
        cut = [split_response(row, self.stop_ids) for row in tokens]
        if dtype != torch.float32 or _parameters(self.model) > RECORD_MAX_PARAMETERS:
            scoring = build_scoring_batch_from_ids(prompt_ids, [r for r, _ in cut], self.pad_id)
            log_probs = per_token_log_probs(self.model, scoring, self.batch_size)
        return [
            Generation(decode_response(self.tokenizer, r, why), why, r, lp[: len(r)])
            for (r, why), lp in zip(cut, log_probs)
        ]

    def _decode(
        self, decoder, logits: Tensor, p: int, first: Tensor, bias: Tensor, t: int, sampling: dict
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The sampling loop from the prompts' logits ``[N, V]``: per row the ``t`` (or fewer, when every row has
        stopped) tokens, padding after a stop token, and each token's raw log-softmax value."""
        n, device = logits.shape[0], logits.device
        stop = torch.tensor(sorted(self.stop_ids), device=device)
        tokens = torch.full((n, t), self.pad_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((n, t), device=device)
        done = torch.zeros(n, dtype=torch.bool, device=device)
        used, live = t, None  # live: the global rows still in the decoder (None: all of them, in order)
        for step in range(t):
            logits = logits.float()
            if sampling.get("do_sample"):
                tok = sample_tokens(logits, sampling["temperature"], sampling["top_k"], sampling["top_p"])
            else:
                tok = logits.argmax(-1)
            tok = tok.masked_fill(done, self.pad_id)
            where = slice(None) if live is None else live
            tokens[where, step] = tok
            log_probs[where, step] = logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0]
            done |= torch.isin(tok, stop)
            n_done = int(done.sum())
            if step == t - 1 or n_done == len(done):
                used = step + 1
                break
            if isinstance(decoder, _Native) and 4 * n_done >= len(done):  # finished rows leave the batch
                keep = (~done).nonzero()[:, 0]
                decoder.select(keep)
                live = keep if live is None else live[keep]
                tok, first, bias, done = tok[keep], first[keep], bias[keep], done[keep]
            col = p + step
            logits = decoder(tok[:, None], (first + step)[:, None], bias[:, None, None, : col + 1], col)
            self.steps += 1
        return tokens[:, :used].tolist(), log_probs[:, :used].tolist()


register_engine("fast", FastEngine)
