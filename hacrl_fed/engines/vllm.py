"""vLLM engine (GPU, optional extra ``hacrl-fed[vllm]``), same interface as the transformers engine.

- ``vllm`` is imported only when an engine is built; without it (or with a release outside
  :data:`SUPPORTED_VLLM`, the range of the ``vllm`` extra) a clear ``ImportError`` says what to install.
- Every option of the org's ``generation`` section reaches ``vllm.LLM`` (via
  :class:`~hacrl_fed.engines.base.EngineOptions`): the org's seed, ``gpu_memory_utilization``, ``max_model_len``,
  ``dtype``, ``batch_size`` (as ``max_num_seqs``), sleep mode, and any extra ``vllm_kwargs`` (e.g.
  ``enforce_eager``).
- Log-probs: ``SamplingParams(logprobs=0)`` returns the sampled token's log-prob, and the engine is built with
  ``logprobs_mode="raw_logprobs"`` (explicitly, not relying on a default): the temperature-1 distribution of the
  raw logits, before penalties, temperature and top-k/top-p — what the algorithm asks the source to publish. The
  engine's weights are bfloat16 or float16 (the attention back-ends need a half type; float32 is refused).
- Stops: exactly the worker's stop set, the same ids the ``hf`` engine stops on
  (:func:`~hacrl_fed.engines.base.stop_token_ids`). vLLM would also stop on every ``eos_token_id`` of the model
  folder's ``generation_config.json``; so requests set ``ignore_eos=True`` with explicit ``stop_token_ids`` and the
  engine is built with ``generation_config="vllm"`` (no defaults read from that file). A response that vLLM
  reports stopped on anything else is an error, never a silent relabel.
- Prompts go in as token ids (the worker's tokenizer, ``add_special_tokens=False``) and outputs come back as ids
  only (``detokenize=False``): the published text is decoded by the worker's tokenizer, exactly as in the ``hf``
  engine.
- Each (prompt, sample) is its own ``n=1`` request with a seed derived from ``(seed, prompt, sample)``: the same
  seed gives the same outputs and the samples of one prompt are independent.
- :meth:`VLLMEngine.sync_weights` copies the trainer's weights into the running engine in-process with the model's
  own ``load_weights`` (HF checkpoint names; LoRA adapters are merged for the copy), checks that the names it
  reports loaded cover every engine parameter (a partial sync — renamed weights, a resized embedding — raises),
  then clears the prefix cache, whose KV entries were computed with the old weights. The engine core must run in
  this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set unless already set; any other value is refused).
- ``sleep_level=1`` (``generation.sleep_during_train``): :meth:`VLLMEngine.released` puts the engine to sleep
  (weights offloaded to CPU, KV cache dropped) while the trainer updates, and wakes it afterwards. Level 2 is not
  offered (it has a known garbage-after-wake bug).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hacrl_fed.engines.base import (
    Generation,
    GenerationEngine,
    decode_response,
    greedy_prompts,
    register_engine,
    sampling_prompts,
    split_response,
    stop_token_ids,
)
from hacrl_fed.types import FINISH_STOP

log = logging.getLogger(__name__)

# The extra's range (pyproject.toml; tests/test_engines.py checks both agree). Lower bound: ``logprobs_mode``
# appeared in 0.10. Upper bound: each vLLM release pins one exact torch and 0.33 needs torch 2.14.0, outside this
# project's torch range (<=2.13.0).
SUPPORTED_VLLM = ">=0.10,<0.33"

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

INSTALL_HINT = (
    "the 'vllm' generation engine needs vLLM (CUDA only): install it in the policy worker's own environment with "
    f"`pip install 'hacrl-fed[vllm]'` (vllm{SUPPORTED_VLLM}; its pins clash with flwr), or set generation.engine: hf"
)

_HALF_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


def version_supported(version: str) -> bool:
    """True when ``version`` (e.g. ``"0.11.2"``, ``"0.20.1.dev3+gabc"``) lies in :data:`SUPPORTED_VLLM`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    # compare the release numbers only: a local/dev build of 0.20 is 0.20 here
    return SpecifierSet(SUPPORTED_VLLM).contains(Version(parsed.base_version), prereleases=True)


def import_vllm():
    """``import vllm`` or raise ``ImportError`` with :data:`INSTALL_HINT` (also for a release out of range)."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    version = str(getattr(vllm, "__version__", "unknown"))
    if not version_supported(version):
        raise ImportError(
            f"vllm {version} is installed but this engine supports vllm{SUPPORTED_VLLM} only. {INSTALL_HINT}"
        )
    return vllm


def require_in_process() -> None:
    """Raise unless the vLLM engine core runs in this process (weight sync copies tensors in place)."""
    value = os.environ.get(MULTIPROCESSING_ENV, "0")
    if value != "0":
        raise RuntimeError(
            f"vllm engine: {MULTIPROCESSING_ENV}={value!r} runs the engine core in a separate process, where "
            "the trainer's weights cannot be loaded in place (it would need collective_rpc and insecure "
            f"pickling). Unset it or set {MULTIPROCESSING_ENV}=0 in the policy worker's environment."
        )


def engine_dtype(requested: str | None, model_dtype) -> str:
    """The engine's dtype: ``requested`` (bfloat16/float16) or the model's; float32 weights map to bfloat16."""
    if requested is not None:
        key = str(requested).strip().lower().removeprefix("torch.")
        if key not in _HALF_DTYPES:
            raise ValueError(
                f"generation.dtype={requested!r}: the vllm engine runs bfloat16 or float16 (attention "
                "back-ends reject float32, and raw log-probs need the V1 engine)"
            )
        return _HALF_DTYPES[key]
    name = str(model_dtype).removeprefix("torch.")
    return _HALF_DTYPES.get(name, "bfloat16")


def llm_arguments(
    *,
    model: str,
    tokenizer: str,
    dtype: str,
    gpu_memory_utilization: float,
    seed: int,
    max_model_len: int | None,
    batch_size: int | None,
    sleep_level: int,
    extra: dict | None = None,
    extra_field: str = "generation.vllm_kwargs",
) -> dict:
    """The engine's ``vllm.LLM`` arguments, then ``extra`` (``generation.vllm_kwargs``), which may not repeat any of
    them (:func:`hacrl_fed.refusals.check_vllm_kwargs`, naming ``extra_field``; the preflight calls this with the org's
    settings)."""
    from hacrl_fed.refusals import check_vllm_kwargs

    kwargs: dict = dict(
        model=str(model),
        tokenizer=str(tokenizer),
        dtype=dtype,
        gpu_memory_utilization=float(gpu_memory_utilization),
        seed=int(seed),
        logprobs_mode="raw_logprobs",  # sampled-token log-probs of the raw temperature-1 distribution
        generation_config="vllm",  # no sampling defaults or extra EOS ids from the folder's generation_config
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    if batch_size is not None:
        kwargs["max_num_seqs"] = int(batch_size)
    if sleep_level:
        kwargs["enable_sleep_mode"] = True
    check_vllm_kwargs(extra or {}, kwargs, extra_field)
    return {**kwargs, **(extra or {})}


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


def _load_weights(vllm_model, *, weights) -> tuple[set[str] | None, set[str]]:
    """Runs on the vLLM model (in this process): load ``weights`` (HF names) → ``(loaded names, all names)``.

    ``load_weights`` returns the engine-side names it loaded (fused names such as ``qkv_proj`` included);
    parameters shared between modules (tied embeddings) are listed once, as in ``named_parameters()``.
    """
    loaded = vllm_model.load_weights(iter(weights))
    expected = {name for name, _ in vllm_model.named_parameters()}
    return (None if loaded is None else set(loaded)), expected


class VLLMEngine(GenerationEngine):
    """``GenerationEngine`` over ``vllm.LLM`` loaded from ``model_path`` (default: the model's ``name_or_path``).

    ``sync_on_init`` copies ``model``'s in-memory weights into the engine right away (they may differ from the
    files at ``model_path``, e.g. after a resume). ``batch_size`` caps concurrent sequences (``max_num_seqs``).
    ``sleep_level`` 1 sleeps the engine inside :meth:`released`. Extra ``llm_kwargs`` go to ``vllm.LLM`` and may
    not repeat an argument the engine sets itself.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        model_path: str | None = None,
        tokenizer_path: str | None = None,
        dtype: str | None = None,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        sleep_level: int = 0,
        sync_on_init: bool = True,
        llm_kwargs: dict | None = None,
        extra_stop_ids: Sequence[int] = (),
    ) -> None:
        if sleep_level not in (0, 1):
            raise ValueError(
                f"vllm engine: sleep_level must be 0 (off) or 1, got {sleep_level} (level 2 has a "
                "known garbage-after-wake bug)"
            )
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        os.environ.setdefault(MULTIPROCESSING_ENV, "0")
        require_in_process()
        vllm = import_vllm()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        path = model_path or getattr(base, "name_or_path", "") or getattr(base.config, "_name_or_path", "")
        if not path:
            raise ValueError("vllm engine: model_path is required (the model has no name_or_path to load from)")
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer, base, extra_stop_ids)
        self.sleep_level = sleep_level
        self.dtype = engine_dtype(dtype, getattr(base, "dtype", None))
        self.llm_kwargs = llm_arguments(
            model=str(path),
            tokenizer=str(tokenizer_path or getattr(tokenizer, "name_or_path", "") or path),
            dtype=self.dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            max_model_len=max_model_len,
            batch_size=batch_size,
            sleep_level=sleep_level,
            extra=llm_kwargs,
        )
        self.llm = vllm.LLM(**self.llm_kwargs)
        self._vllm = vllm
        if sync_on_init:
            self.sync_weights(model)

    def _params(self, **kw):
        return self._vllm.SamplingParams(
            n=1, logprobs=0, ignore_eos=True, stop_token_ids=sorted(self.stop_ids), detokenize=False, **kw
        )

    def _collect(self, requests: list[dict], params: list) -> list[Generation]:
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        if len(outputs) != len(requests):
            raise RuntimeError(f"vllm returned {len(outputs)} outputs for {len(requests)} requests")
        gens = []
        for i, out in enumerate(outputs):
            comp = out.outputs[0]
            if comp.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vllm request {i} finished with {comp.finish_reason!r}")
            raw = list(comp.token_ids)
            ids, reason = split_response(raw, self.stop_ids)
            if comp.finish_reason == "stop" and reason != FINISH_STOP:
                raise RuntimeError(
                    f"vllm request {i} stopped (stop_reason={getattr(comp, 'stop_reason', None)!r}) on a token "
                    f"outside the worker's stop set {sorted(self.stop_ids)}"
                )
            if len(ids) != len(raw):
                raise RuntimeError(f"vllm request {i} generated {len(raw) - len(ids)} tokens after a stop token")
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
        prompts = sampling_prompts(
            self.tokenizer,
            prompt_texts,
            num_samples=num_samples,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
        )
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
        gens = self._collect(requests, params) if requests else []
        return [gens[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]

    def greedy(self, prompt_texts: list[str], *, max_new_tokens: int) -> list[Generation]:
        prompts = greedy_prompts(self.tokenizer, prompt_texts, max_new_tokens=max_new_tokens)
        if not prompts:
            return []
        params = [self._params(temperature=0.0, max_tokens=int(max_new_tokens)) for _ in prompts]
        return self._collect([{"prompt_token_ids": ids} for ids in prompts], params)

    def sync_weights(self, model) -> None:
        """Load ``model``'s current weights into the engine (in-process), check every engine parameter was
        loaded, then drop the prefix-cache entries computed with the old weights."""
        require_in_process()
        with _hf_weights(model) as weights:
            results = self.llm.apply_model(functools.partial(_load_weights, weights=weights))
        for loaded, expected in results:
            if loaded is None:
                raise RuntimeError(
                    "vllm sync_weights: the engine model's load_weights did not report which weights "
                    "it loaded, so a partial sync cannot be ruled out (vllm"
                    f"{SUPPORTED_VLLM} models report them)"
                )
            missing = expected - loaded
            if missing:
                raise RuntimeError(
                    f"vllm sync_weights: {len(missing)} of {len(expected)} engine parameters were not loaded from "
                    f"the trainer's weights (e.g. {sorted(missing)[:5]}); the engine would sample with stale "
                    "weights. Renamed weights, a resized embedding or an unsupported adapter layout cause this."
                )
        self.llm.reset_prefix_cache()

    @contextmanager
    def released(self) -> Iterator[None]:
        """With ``sleep_level=1``: sleep (weights to CPU, KV cache freed) for the block, wake up afterwards."""
        if not self.sleep_level:
            yield
            return
        self.llm.sleep(level=self.sleep_level)
        try:
            yield
        finally:
            self.llm.wake_up()


register_engine("vllm", VLLMEngine)
