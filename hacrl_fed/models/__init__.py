"""Model and tokenizer loading, chat rendering, and the tiny heterogeneous agent zoo.

model, tokenizer = load_model_and_tokenizer(ModelConfig(zoo="qwen-char"))
text = render_prompt(tokenizer, prompt.messages)
"""

from hacrl_fed.models.catalog import ZOO, ZooEntry, get_entry, resolve_zoo
from hacrl_fed.models.chat import eos_token_id, fallback_render, render_prompt
from hacrl_fed.models.loading import (
    ensure_pad_token,
    load_model_and_tokenizer,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from hacrl_fed.models.sft import SFTRecipe, greedy_accuracy, run_sft
from hacrl_fed.models.tokenizers import build_bpe_tokenizer, build_char_tokenizer, build_tokenizer
from hacrl_fed.models.zoo import build_agent

__all__ = [
    "ZOO",
    "SFTRecipe",
    "ZooEntry",
    "build_agent",
    "build_bpe_tokenizer",
    "build_char_tokenizer",
    "build_tokenizer",
    "ensure_pad_token",
    "eos_token_id",
    "fallback_render",
    "get_entry",
    "greedy_accuracy",
    "load_model_and_tokenizer",
    "load_tokenizer",
    "render_prompt",
    "resolve_device",
    "resolve_dtype",
    "resolve_zoo",
    "run_sft",
]
