"""A fake ``vllm`` module for CPU tests of the vLLM engine (installed into ``sys.modules`` by a fixture).

It mirrors the parts of vLLM's offline API the engine uses, with the behaviour the engine must cope with:

- ``LLM(**kwargs)`` accepts only arguments real releases accept (others raise ``TypeError``), records them, and
  loads the model folder with transformers (float32, CPU). ``generate`` samples token by token with a
  ``torch.Generator`` seeded by the request's seed (temperature, top-k, top-p; temperature 0 = greedy).
- Log-probs follow ``logprobs_mode``: ``"raw_logprobs"`` gives the temperature-1 log-prob of the sampled token;
  without the argument the fake returns the *processed* ones (after temperature/top-k/top-p), as old releases and
  the V0 fallback did — so an engine that does not ask for raw log-probs publishes wrong values.
- Stops: like vLLM, it stops on the tokenizer's EOS and on every ``eos_token_id`` of the folder's
  ``generation_config.json`` unless ``ignore_eos=True`` (or ``generation_config="vllm"`` for the folder's ids),
  and always on ``stop_token_ids``; the stop token is part of ``token_ids``. ``finish_reason`` is ``"stop"`` or
  ``"length"``; ``stop_reason`` is the stop id when a ``stop_token_ids`` entry ended it.
- ``detokenize=False`` leaves ``text`` empty.
- ``apply_model(fn)`` returns ``[fn(model)]``; the model's ``load_weights(weights)`` copies by HF name and returns
  the set of names loaded, minus ``LLM.drop_names`` (to fake a partial sync); ``LLM.load_returns_none`` fakes a
  model that reports nothing.
- ``sleep(level)`` / ``wake_up()`` need ``enable_sleep_mode=True``; generating while asleep raises. Every call is
  appended to ``LLM.calls``.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

FAKE_VERSION = "0.20.0"

LLM_ARGS = {
    "model", "tokenizer", "dtype", "gpu_memory_utilization", "seed", "max_model_len", "max_num_seqs",
    "enforce_eager", "logprobs_mode", "generation_config", "enable_sleep_mode", "swap_space",
    "tensor_parallel_size", "enable_prefix_caching", "skip_tokenizer_init", "trust_remote_code",
}
SAMPLING_DEFAULTS = dict(
    n=1, temperature=1.0, top_p=1.0, top_k=0, seed=None, max_tokens=16, logprobs=None, stop_token_ids=None,
    ignore_eos=False, detokenize=True, skip_special_tokens=True,
)


class SamplingParams:
    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise TypeError(f"SamplingParams got unexpected arguments {sorted(unknown)}")
        if kwargs.get("top_k", 0) < -1:
            raise ValueError("top_k must be -1 (disable), or at least 1")
        self.kwargs = dict(kwargs)
        for k, v in {**SAMPLING_DEFAULTS, **kwargs}.items():
            setattr(self, k, v)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: int | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


def _folder_eos_ids(path: Path) -> set[int]:
    file = path / "generation_config.json"
    if not file.is_file():
        return set()
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list) else [eos])}


class LLM:
    instances: list["LLM"] = []

    def __init__(self, **kwargs):
        unknown = set(kwargs) - LLM_ARGS
        if unknown:
            raise TypeError(f"LLM got unexpected arguments {sorted(unknown)}")
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.asleep = False
        self.drop_names: set[str] = set()
        self.load_returns_none = False
        self.honor_ignore_eos = True
        path = Path(kwargs["model"])
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.model.requires_grad_(False)
        self.model.load_weights = self._load_weights
        tokenizer = AutoTokenizer.from_pretrained(kwargs.get("tokenizer") or path)
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.folder_eos = set() if kwargs.get("generation_config") == "vllm" else _folder_eos_ids(path)
        LLM.instances.append(self)

    # -- weights ----------------------------------------------------------------------------------------------
    def _load_weights(self, weights):
        params = dict(self.model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name in self.drop_names or name not in params:
                    continue
                params[name].copy_(tensor)
                loaded.add(name)
        return None if self.load_returns_none else loaded

    def apply_model(self, func):
        self.calls.append(("apply_model",))
        return [func(self.model)]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True

    def sleep(self, level: int = 1):
        if not self.kwargs.get("enable_sleep_mode"):
            raise ValueError("Sleep mode is not enabled: LLM(enable_sleep_mode=True)")
        self.calls.append(("sleep", level))
        self.asleep = True

    def wake_up(self, tags=None):
        self.calls.append(("wake_up",))
        self.asleep = False

    # -- generation -------------------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params, use_tqdm=True):
        if self.asleep:
            raise RuntimeError("generate() while the engine sleeps")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        self.calls.append(("generate", len(prompts)))
        return [self._one(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params)]

    def _one(self, prompt: list[int], sp: SamplingParams) -> RequestOutput:
        seed = sp.seed if sp.seed is not None else self.kwargs.get("seed", 0)
        gen = torch.Generator().manual_seed(int(seed))
        stops = set(sp.stop_token_ids or [])
        eos = set() if (sp.ignore_eos and self.honor_ignore_eos) else ({self.eos_token_id} | self.folder_eos)
        max_len = self.kwargs.get("max_model_len") or 10**9
        raw_mode = self.kwargs.get("logprobs_mode") == "raw_logprobs"
        ids, out, lps = list(prompt), [], []
        finish, stop_reason = "length", None
        for _ in range(sp.max_tokens):
            if len(ids) >= max_len:
                break
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0, -1].float()
            raw = logits.log_softmax(-1)
            if sp.temperature == 0:
                tok = int(logits.argmax())
                processed = raw
            else:
                scaled = logits / sp.temperature
                if sp.top_k and sp.top_k > 0:
                    kth = scaled.topk(min(sp.top_k, scaled.numel())).values[-1]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                if sp.top_p < 1.0:
                    probs_sorted, order = scaled.softmax(-1).sort(descending=True)
                    drop = probs_sorted.cumsum(-1) - probs_sorted >= sp.top_p
                    scaled[order[drop]] = float("-inf")
                processed = scaled.log_softmax(-1)
                tok = int(torch.multinomial(processed.exp(), 1, generator=gen))
            out.append(tok)
            ids.append(tok)
            if sp.logprobs is not None:
                lps.append({tok: Logprob(float(raw[tok] if raw_mode else processed[tok]), 1)})
            if tok in stops:
                finish, stop_reason = "stop", tok
                break
            if tok in eos:
                finish = "stop"
                break
        text = self.tokenizer.decode(out, skip_special_tokens=sp.skip_special_tokens) if sp.detokenize else ""
        comp = CompletionOutput(0, text, out, lps if sp.logprobs is not None else None, finish, stop_reason)
        return RequestOutput(list(prompt), [comp])


def make_module(version: str = FAKE_VERSION) -> types.ModuleType:
    """A fresh fake ``vllm`` module (``LLM.instances`` emptied)."""
    LLM.instances = []
    mod = types.ModuleType("vllm")
    mod.__version__ = version
    mod.LLM = LLM
    mod.SamplingParams = SamplingParams
    return mod


def install(monkeypatch, version: str = FAKE_VERSION) -> types.ModuleType:
    """Put a fake ``vllm`` into ``sys.modules`` for the test, with in-process mode restored afterwards."""
    mod = make_module(version)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    # setenv first so the engine's os.environ.setdefault is undone at teardown too
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    return mod
