"""Generation engines: ``build_engine("hf" | "fast" | "vllm", model, tokenizer, options)`` → :class:`GenerationEngine`.

Importing this package registers all three engines; the vLLM one imports ``vllm`` only when it is built.
"""

from hacrl_fed.engines import fast as _fast  # noqa: F401  (registers "fast")
from hacrl_fed.engines import hf as _hf  # noqa: F401  (registers "hf")
from hacrl_fed.engines import vllm as _vllm  # noqa: F401  (registers "vllm")
from hacrl_fed.engines.base import (
    EngineOptions,
    Generation,
    GenerationEngine,
    build_engine,
    decode_response,
    register_engine,
    split_response,
    stop_token_ids,
)
from hacrl_fed.engines.fast import FastEngine
from hacrl_fed.engines.hf import HFEngine

__all__ = [
    "EngineOptions",
    "FastEngine",
    "Generation",
    "GenerationEngine",
    "HFEngine",
    "build_engine",
    "decode_response",
    "register_engine",
    "split_response",
    "stop_token_ids",
]
