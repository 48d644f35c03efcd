"""Peak memory of the log-probs at a real vocabulary: the whole-tensor path against the chunked head (issue 43).

    python scripts/head_memory.py whole|chunked      # one fresh process per path; prints one line and its JSON

A 2-layer, 64-wide Llama with Gemma 3's 262,144-token vocabulary (its embedding and head are what is big), 8 rows
of 40 prompt + 48 response tokens (a micro-batch of the real pair's plan): the peak RSS above the resident model
of one no-grad scoring pass and of one forward + backward, each measured with the kernel's peak reset first
(``hacrl_fed.perf.reset_peak_rss``, Linux), and their seconds (one torch thread).
"""

from __future__ import annotations

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hacrl_fed import scoring
from hacrl_fed.perf import peak_rss_mb, reset_peak_rss


def main(mode: str) -> dict[str, float | str]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if mode == "whole":
        scoring.ONE_PASS_MAX_VOCAB = 10**9  # the zoo's path at any vocabulary
    cfg = LlamaConfig(vocab_size=262144, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).float()
    prompts = [torch.randint(0, 262144, (40,)).tolist() for _ in range(8)]
    responses = [torch.randint(0, 262144, (48,)).tolist() for _ in range(8)]
    batch = scoring.build_scoring_batch_from_ids(prompts, responses, 0)
    reset_peak_rss()
    base, t0 = peak_rss_mb() or 0.0, time.perf_counter()
    with torch.no_grad():
        scoring.token_log_probs(model, batch)
    score_peak, t1 = peak_rss_mb() or 0.0, time.perf_counter()
    reset_peak_rss()
    lp, mask = scoring.token_log_probs(model, batch)
    (lp * mask).sum().backward()
    train_peak, t2 = peak_rss_mb() or 0.0, time.perf_counter()
    return {"path": mode, "score_mib": score_peak - base, "score_s": t1 - t0, "update_mib": train_peak - base,
            "update_s": t2 - t1}


if __name__ == "__main__":
    out = main(sys.argv[1] if len(sys.argv) > 1 else "chunked")
    print(f"{out['path']:8s} score +{out['score_mib']:.0f} MiB {out['score_s']:.2f} s | "
          f"forward+backward +{out['update_mib']:.0f} MiB {out['update_s']:.2f} s")
    print(json.dumps(out))
