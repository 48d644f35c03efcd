"""vLLM engine (GPU, optional extra ``hacrl-fed[vllm]``), same interface as the transformers engine.

- ``vllm`` is imported only when an engine is built; without it a clear ``ImportError`` says how to install it.
- Prompts go in as token ids (the HF tokenizer, ``add_special_tokens=False``) and outputs are decoded by the HF
  tokenizer, so text, ids and EOS handling match :class:`hacrl_fed.engines.hf.HFEngine` exactly.
- Log-probs: ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob. vLLM V1 computes these from the
  raw logits (``logprobs_mode="raw_logprobs"``, its default) — the temperature-1 distribution, before penalties,
  temperature and top-k/top-p — which is what docs/ALGORITHM.md asks the source to publish.
- Each (prompt, sample) is its own ``n=1`` request with a seed derived from ``(seed, prompt, sample)``: the same
  seed gives the same outputs and the samples of one prompt are independent.
- :meth:`VLLMEngine.sync_weights` copies the trainer's weights into the running engine with the model's own
  ``load_weights`` (HF checkpoint names; LoRA adapters are merged for the copy) and clears the prefix cache,
  whose KV entries were computed with the old weights. By default the engine core runs in-process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set unless already set) so weights are copied GPU to GPU; otherwise
  they are sent through CPU memory.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hacrl_fed.engines.base import (
    Generation,
    GenerationEngine,
    check_sampling,
    decode_response,
    register_engine,
    split_response,
    stop_token_ids,
)

INSTALL_HINT = (
    "the 'vllm' generation engine needs vLLM (CUDA only): install it in the policy worker's own environment with "
    "`pip install 'hacrl-fed[vllm]'` (its pins clash with flwr), or set generation.engine: hf"
)


def import_vllm():
    """``import vllm`` or raise ``ImportError`` with :data:`INSTALL_HINT`."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    return vllm


def _request_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


@contextmanager
def _hf_weights(model) -> Iterator[list]:
    """``[(hf_name, tensor)]`` of ``model``'s current weights; a PEFT model is merged for the block, then unmerged."""
    if not hasattr(model, "merge_adapter"):
        yield [(k, v.detach()) for k, v in model.state_dict().items()]
        return
    model.merge_adapter()
    try:
        items = []
        for k, v in model.get_base_model().state_dict().items():
            if "modules_to_save" in k or "original_module" in k:
                raise ValueError(f"vllm sync_weights: PEFT modules_to_save is not supported (weight {k!r})")
            if "lora_" not in k:
                items.append((k.replace(".base_layer.", "."), v.detach()))
        yield items
    finally:
        model.unmerge_adapter()


def _load_weights(vllm_model, *, weights) -> None:
    """Runs inside the vLLM worker: load ``weights`` (HF names) into its model."""
    vllm_model.load_weights(weights=iter(weights))


class VLLMEngine(GenerationEngine):
    """``GenerationEngine`` over ``vllm.LLM`` loaded from ``model_path`` (default: the model's ``name_or_path``).

    ``sync_on_init`` copies ``model``'s in-memory weights into the engine right away (they may differ from the
    files at ``model_path``, e.g. after a resume). ``batch_size`` caps concurrent sequences (``max_num_seqs``).
    Extra ``llm_kwargs`` go to ``vllm.LLM``.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        model_path: str | None = None,
        dtype: str | None = None,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        enforce_eager: bool = False,
        sync_on_init: bool = True,
        llm_kwargs: dict | None = None,
    ) -> None:
        vllm = import_vllm()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        path = model_path or getattr(base, "name_or_path", "") or getattr(base.config, "_name_or_path", "")
        if not path:
            raise ValueError("vllm engine: model_path is required (the model has no name_or_path to load from)")
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer, base)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kwargs = dict(
            model=path,
            tokenizer=getattr(tokenizer, "name_or_path", "") or path,
            dtype=dtype or str(base.dtype).removeprefix("torch."),
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            enforce_eager=enforce_eager,
        )
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if batch_size is not None:
            kwargs["max_num_seqs"] = batch_size
        self.llm = vllm.LLM(**kwargs, **(llm_kwargs or {}))
        self._vllm = vllm
        if sync_on_init:
            self.sync_weights(model)

    def _encode(self, prompt_texts: Sequence[str]) -> list[list[int]]:
        if isinstance(prompt_texts, str):
            raise TypeError("prompt_texts must be a list of strings, got a single str")
        ids = self.tokenizer(list(prompt_texts), add_special_tokens=False)["input_ids"] if prompt_texts else []
        for i, row in enumerate(ids):
            if not row:
                raise ValueError(f"prompt_texts[{i}] encodes to no tokens")
        return [list(r) for r in ids]

    def _params(self, **kw):
        return self._vllm.SamplingParams(
            n=1, logprobs=0, skip_special_tokens=True, stop_token_ids=sorted(self.stop_ids), **kw
        )

    def _collect(self, requests: list[dict], params: list) -> list[Generation]:
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        gens = []
        for i, out in enumerate(outputs):
            comp = out.outputs[0]
            if comp.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vllm request {i} finished with {comp.finish_reason!r}")
            ids, reason = split_response(comp.token_ids, self.stop_ids)
            if comp.logprobs is None or len(comp.logprobs) < len(ids):
                raise RuntimeError(f"vllm request {i}: missing sampled-token logprobs")
            lps = [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs)]
            gens.append(Generation(decode_response(self.tokenizer, ids, reason), reason, ids, lps))
        return gens

    def generate(
        self,
        prompt_texts: list[str],
        *,
        num_samples: int,
        temperature: float,
        top_p: float,
        top_k: int,
        max_new_tokens: int,
        seed: int,
    ) -> list[list[Generation]]:
        check_sampling(
            num_samples=num_samples, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens
        )
        prompts = self._encode(prompt_texts)
        requests, params = [], []
        for i, ids in enumerate(prompts):
            for s in range(num_samples):
                requests.append({"prompt_token_ids": ids})
                params.append(
                    self._params(
                        temperature=float(temperature),
                        top_p=float(top_p),
                        top_k=int(top_k) if top_k > 0 else -1,
                        max_tokens=int(max_new_tokens),
                        seed=_request_seed(int(seed), i, s),
                    )
                )
        gens = self._collect(requests, params)
        return [gens[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]

    def greedy(self, prompt_texts: list[str], *, max_new_tokens: int) -> list[Generation]:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompts = self._encode(prompt_texts)
        params = [self._params(temperature=0.0, max_tokens=int(max_new_tokens)) for _ in prompts]
        return self._collect([{"prompt_token_ids": ids} for ids in prompts], params)

    def sync_weights(self, model) -> None:
        """Load ``model``'s current weights into the engine, then drop prefix-cache entries of the old weights."""
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        with _hf_weights(model) as weights:
            if not in_process:
                weights = [(k, v.cpu()) for k, v in weights]
            if hasattr(self.llm, "apply_model"):
                self.llm.apply_model(functools.partial(_load_weights, weights=weights))
            else:  # vLLM V0 engine: the model lives in this process
                runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
                _load_weights(runner.model, weights=weights)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()


register_engine("vllm", VLLMEngine)
