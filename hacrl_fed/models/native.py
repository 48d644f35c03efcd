"""A hand-written forward of the zoo's decoder architectures (Qwen3, Llama, GPT-2) over a model's own parameters.

transformers' modules spend much of a small model's forward in per-op Python (rotary tables rebuilt per call,
RMSNorm in several ops, mask construction). :class:`NativeDecoder` runs the same arithmetic with ``torch.nn.functional``
over the model's own parameter tensors (read at each call: the trainer's in-place updates are seen, nothing is
copied), with the model's rotary-embedding module for the cos/sin tables. Two users:

- the ``fast`` generation engine (:mod:`hacrl_fed.engines.fast`): a preallocated KV cache, one column a step;
- the trainer's scoring forward (:func:`shared_prompt_logits`, wherever it applies): each distinct prompt
  runs once, then every row's response attends to its prompt's keys and values; differentiable (autograd runs
  through the functional ops), logits of the response columns only.

:func:`unsupported_reason` says when a model needs its own ``forward`` (another architecture, PEFT/LoRA layers,
hooks, sliding-window attention, a length-dependent RoPE). In float32 the two forwards agree to round-off
(tests: log-probs and gradients).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ROPE_ARCHS = ("Qwen3ForCausalLM", "LlamaForCausalLM")
_GPT2_ARCHS = ("GPT2LMHeadModel",)
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # cos/sin of a position do not depend on the length


def unsupported_reason(model) -> str | None:
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


class NativeDecoder:
    """Hand-written forward of a Qwen3/Llama or GPT-2 model with a preallocated ``[N, kv, L, D]`` cache."""

    def __init__(self, model, n: int, length: int, device: torch.device, *, cache: bool = True) -> None:
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
        # cache=False (:func:`shared_prompt_logits`): attention reads this call's keys and values, after the
        # ``prefix`` ones (per layer [U, kv, P, D], row r reads prefix row ``prefix_rows[r]``) when set, and
        # ``record`` (when a list) collects each layer's keys and values
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in self.layers] if cache else []
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in self.layers] if cache else []
        self.prefix: list[tuple[Tensor, Tensor]] | None = None
        self.prefix_rows: Tensor | None = None
        self.record: list[tuple[Tensor, Tensor]] | None = None
        self.head = True  # False: return the final normed hidden states [N, keep, H] instead of logits

    def __call__(self, ids: Tensor, pos: Tensor, bias: Tensor, start: int, keep: int = 0) -> Tensor:
        """Logits ``[N, V]`` of the last column of ``ids`` ``[N, S]`` at positions ``pos`` (``keep`` > 0: of the
        last ``keep`` columns, ``[N, keep, V]``), written into the cache at columns ``start .. start + S - 1``;
        ``bias`` ``[N, 1, S, start + S]`` is 0 where attention is allowed."""
        x = (
            self._gpt2(ids, pos, bias, start, max(keep, 1))
            if self.gpt2
            else self._rope(ids, pos, bias, start, max(keep, 1))
        )
        return x if keep else x[:, -1]

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
        if self.k:
            self.k[i][:rows, :, start:end] = k
            self.v[i][:rows, :, start:end] = v
            k, v = self.k[i][:rows, :, :end], self.v[i][:rows, :, :end]
        elif self.record is not None:
            self.record.append((k, v))
        elif self.prefix is not None and self.prefix_rows is not None:
            pk, pv = self.prefix[i]
            k = torch.cat((pk[self.prefix_rows], k), dim=2)  # the row's prompt keys, then its own
            v = torch.cat((pv[self.prefix_rows], v), dim=2)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=bias,
            scale=scale,
            enable_gqa=self.kv != self.heads,
        )
        n, _, s, _ = q.shape
        return out.transpose(1, 2).reshape(n, s, self.heads * self.dim)

    def _rope(self, ids: Tensor, pos: Tensor, bias: Tensor, start: int, keep: int) -> Tensor:
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
        head, h = self.model.lm_head, _rms(x[:, -keep:], base.norm)
        return F.linear(h, head.weight, head.bias) if self.head else h

    def _gpt2(self, ids: Tensor, pos: Tensor, bias: Tensor, start: int, keep: int) -> Tensor:
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
        h = F.layer_norm(x[:, -keep:], (e,), ln.weight, ln.bias, ln.eps)
        return F.linear(h, head.weight, head.bias) if self.head else h


def shared_prompt_logits(
    model, prompt_ids: Tensor, prompt_mask: Tensor, prompt_rows: Tensor, response_ids: Tensor, *, hidden: bool = False
) -> Tensor:
    """Logits ``[N, T, V]`` predicting each response token, with each distinct prompt run once (``hidden``: the
    final normed hidden states ``[N, T, H]`` the ``lm_head`` would read instead, for a chunked head).

    ``prompt_ids`` / ``prompt_mask`` ``[U, P]``: the distinct prompts, left-padded (mask 0/1); ``prompt_rows``
    ``[N]``: row ``r``'s prompt; ``response_ids`` ``[N, T]``, right-padded. Column ``j`` of the result is the
    prediction of response token ``j``: from the prompt's last column for ``j = 0``, else from response column
    ``j - 1``. The prompts run first (causal, pad keys masked, left-padding-aware positions); then every row's
    response attends to its prompt's keys and values and causally to its own, at positions ``prompt length + j``.
    That is the full causal pass over prompt + response, exactly (a prompt's activations do not depend on what
    follows it), with the prompt computed once for all its rows. Differentiable: gradients from every row flow
    into its prompt's shared activations. The caller checks :func:`unsupported_reason` first.
    """
    u, p = prompt_ids.shape
    n, t = response_ids.shape
    device = prompt_ids.device
    dtype = next(model.parameters()).dtype
    decoder = NativeDecoder(model, n, p + t, device, cache=False)
    decoder.head = not hidden
    allowed = torch.ones(p, p, dtype=torch.bool, device=device).tril()[None] & prompt_mask[:, None].bool()
    allowed |= torch.eye(p, dtype=torch.bool, device=device)  # a pad query attends to itself: no empty softmax row
    prompt_bias = torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill(~allowed, -math.inf)[:, None]
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    decoder.record = []
    first = decoder(prompt_ids, prompt_pos, prompt_bias, 0, keep=1)  # [U, 1, V]: predicts response token 0
    if t == 1:
        return first[prompt_rows]
    decoder.prefix, decoder.record, decoder.prefix_rows = decoder.record, None, prompt_rows
    keys = torch.cat(
        (prompt_mask[prompt_rows].bool(), torch.ones(n, t - 1, dtype=torch.bool, device=device)), dim=1
    )  # [N, P + T - 1]
    causal = torch.ones(t - 1, t - 1, dtype=torch.bool, device=device).tril()
    allowed = keys[:, None, :].repeat(1, t - 1, 1)
    allowed[:, :, p:] &= causal
    bias = torch.zeros(allowed.shape, device=device, dtype=dtype).masked_fill(~allowed, -math.inf)[:, None]
    pos = prompt_mask.sum(-1)[prompt_rows][:, None] + torch.arange(t - 1, device=device)[None]
    rest = decoder(response_ids[:, : t - 1], pos, bias, 0, keep=t - 1)  # [N, T - 1, V]
    return torch.cat((first[prompt_rows], rest), dim=1)
