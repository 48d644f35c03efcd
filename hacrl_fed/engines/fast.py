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
  to float round-off (tests: within the 1e-4 the ``hf`` engine's tests use, ~1e-6 in float32).
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
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hacrl_fed.engines.base import Generation, decode_response, register_engine, split_response
from hacrl_fed.engines.hf import HFEngine
from hacrl_fed.scoring import build_scoring_batch_from_ids, per_token_log_probs

_ROPE_ARCHS = ("Qwen3ForCausalLM", "LlamaForCausalLM")
_GPT2_ARCHS = ("GPT2LMHeadModel",)
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # cos/sin of a position do not depend on the length


def _unsupported_reason(model) -> str | None:
    """Why the hand-written decoder cannot run ``model`` (None: it can)."""
    name = type(model).__name__
    if name not in _ROPE_ARCHS + _GPT2_ARCHS:
        return f"architecture {name} (hand-written: {', '.join(_ROPE_ARCHS + _GPT2_ARCHS)})"
    for m in model.modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return f"forward hooks on {type(m).__name__}"
        if isinstance(m, nn.Linear) and type(m) is not nn.Linear:
            return f"a non-plain linear layer {type(m).__name__}"
    cfg = model.config
    layers = model.transformer.h if name in _GPT2_ARCHS else model.model.layers
    attn = [layer.attn if name in _GPT2_ARCHS else layer.self_attn for layer in layers]
    if not all(hasattr(a, "scaling") and (name in _GPT2_ARCHS or hasattr(a, "head_dim")) for a in attn):
        return "attention modules without scaling / head_dim (another transformers version)"
    if name in _ROPE_ARCHS:
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            return "pretraining_tp > 1"
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            return "sliding-window layers"
        rope = getattr(model.model.rotary_emb, "rope_type", "default")
        if rope not in _STATIC_ROPE:
            return f"RoPE type {rope!r} (length-dependent)"
    elif getattr(cfg, "add_cross_attention", False):
        return "cross-attention layers"
    return None


def decoder_kind(model) -> str:
    """``"native"`` (the hand-written forward) or ``"model"`` (the model's own forward with its cache)."""
    return "native" if _unsupported_reason(model) is None else "model"


def _rms(x: Tensor, norm: nn.Module) -> Tensor:
    """transformers' RMSNorm: float32 statistics, ``weight * normed.to(dtype)`` (one fused op in float32)."""
    weight: Tensor = norm.weight  # type: ignore[assignment]
    eps = float(norm.variance_epsilon)  # type: ignore[arg-type]
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Native:
    """Hand-written forward of a Qwen3/Llama or GPT-2 model with a preallocated ``[N, kv, L, D]`` cache."""

    def __init__(self, model, n: int, length: int, device: torch.device) -> None:
        self.model, self.gpt2 = model, type(model).__name__ in _GPT2_ARCHS
        cfg = model.config
        dtype = next(model.parameters()).dtype
        if self.gpt2:
            self.layers = list(model.transformer.h)
            heads = kv = cfg.n_head
            dim = cfg.n_embd // heads
        else:
            self.layers = list(model.model.layers)
            heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
            dim = self.layers[0].self_attn.head_dim
            probe = torch.zeros(1, device=device, dtype=dtype)
            cos, sin = model.model.rotary_emb(probe, torch.arange(length, device=device)[None])
            self.cos, self.sin = cos[0], sin[0]  # [L, D]
        self.heads, self.kv, self.dim = heads, kv, dim
        shape = (n, kv, length, dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in self.layers]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in self.layers]

    def __call__(self, ids: Tensor, pos: Tensor, bias: Tensor, start: int) -> Tensor:
        """Logits ``[N, V]`` of the last column of ``ids`` ``[N, S]`` at positions ``pos``, written into the cache
        at columns ``start .. start + S - 1``; ``bias`` ``[N, 1, S, start + S]`` is 0 where attention is allowed."""
        return self._gpt2(ids, pos, bias, start) if self.gpt2 else self._rope(ids, pos, bias, start)

    def select(self, rows: Tensor) -> None:
        """Keep only cache rows ``rows`` (the rows still decoding), in that order."""
        self.k = [c[rows] for c in self.k]
        self.v = [c[rows] for c in self.v]

    def expand(self, rows: Tensor, width: int) -> None:
        """Copy the first ``width`` cache columns of row ``rows[j]`` into row ``j`` (a prompt prefilled once
        serves each of its samples)."""
        for cache in (*self.k, *self.v):
            cache[:, :, :width] = cache[rows, :, :width]

    def _attend(self, i: int, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, start: int, scale: float) -> Tensor:
        rows, end = q.shape[0], start + q.shape[2]  # the prefill may fill only the first rows (see expand)
        self.k[i][:rows, :, start:end] = k
        self.v[i][:rows, :, start:end] = v
        out = F.scaled_dot_product_attention(
            q,
            self.k[i][:rows, :, :end],
            self.v[i][:rows, :, :end],
            attn_mask=bias,
            scale=scale,
            enable_gqa=self.kv != self.heads,
        )
        n, _, s, _ = q.shape
        return out.transpose(1, 2).reshape(n, s, self.heads * self.dim)

    def _rope(self, ids: Tensor, pos: Tensor, bias: Tensor, start: int) -> Tensor:
        base = self.model.model
        n, s = ids.shape
        x = F.embedding(ids, base.embed_tokens.weight)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # [N, 1, S, D]
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            h = _rms(x, layer.input_layernorm)
            q = F.linear(h, att.q_proj.weight, att.q_proj.bias).view(n, s, self.heads, self.dim)
            k = F.linear(h, att.k_proj.weight, att.k_proj.bias).view(n, s, self.kv, self.dim)
            v = F.linear(h, att.v_proj.weight, att.v_proj.bias).view(n, s, self.kv, self.dim)
            if hasattr(att, "q_norm"):  # Qwen3: RMSNorm over each head before RoPE
                q, k = _rms(q, att.q_norm), _rms(k, att.k_norm)
            q = _rotate(q.transpose(1, 2), cos, sin)
            k = _rotate(k.transpose(1, 2), cos, sin)
            o = self._attend(i, q, k, v.transpose(1, 2), bias, start, att.scaling)
            x = x + F.linear(o, att.o_proj.weight, att.o_proj.bias)
            h = _rms(x, layer.post_attention_layernorm)
            mlp = layer.mlp
            gate = mlp.act_fn(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias))
            up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
            x = x + F.linear(gate * up, mlp.down_proj.weight, mlp.down_proj.bias)
        head = self.model.lm_head
        return F.linear(_rms(x[:, -1], base.norm), head.weight, head.bias)

    def _gpt2(self, ids: Tensor, pos: Tensor, bias: Tensor, start: int) -> Tensor:
        base = self.model.transformer
        n, s = ids.shape
        e = self.heads * self.dim
        x = F.embedding(ids, base.wte.weight) + F.embedding(pos, base.wpe.weight)
        for i, block in enumerate(self.layers):
            att, mlp = block.attn, block.mlp
            h = F.layer_norm(x, (e,), block.ln_1.weight, block.ln_1.bias, block.ln_1.eps)
            qkv = torch.addmm(att.c_attn.bias, h.reshape(n * s, e), att.c_attn.weight)
            q, k, v = (t.view(n, s, self.heads, self.dim).transpose(1, 2) for t in qkv.split(e, dim=-1))
            o = self._attend(i, q, k, v, bias, start, att.scaling)
            x = x + torch.addmm(att.c_proj.bias, o.reshape(n * s, e), att.c_proj.weight).view(n, s, e)
            h = F.layer_norm(x, (e,), block.ln_2.weight, block.ln_2.bias, block.ln_2.eps)
            h = mlp.act(torch.addmm(mlp.c_fc.bias, h.reshape(n * s, e), mlp.c_fc.weight))
            x = x + torch.addmm(mlp.c_proj.bias, h, mlp.c_proj.weight).view(n, s, e)
        ln, head = base.ln_f, self.model.lm_head
        return F.linear(F.layer_norm(x[:, -1], (e,), ln.weight, ln.bias, ln.eps), head.weight, head.bias)


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
    not float32 has its published log-probs recomputed by the scoring pass (in half precision KV-cache decoding
    and a full forward differ by more than the tolerance the published values promise).
    """

    def __init__(self, model, tokenizer, *, batch_size: int = 64) -> None:
        super().__init__(model, tokenizer, batch_size=batch_size)
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
        if dtype != torch.float32:
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
