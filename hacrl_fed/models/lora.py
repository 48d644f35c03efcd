"""LoRA adapters on a loaded model (``trainer.lora``; needs peft)."""

from __future__ import annotations

from hacrl_fed.refusals import require_peft


def wrap_lora(model, trainer_cfg):
    require_peft()  # hacrl_fed.refusals: the preflight checks it before any worker starts
    from peft import LoraConfig, get_peft_model

    lc = trainer_cfg.lora
    return get_peft_model(
        model,
        LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            target_modules=lc.target_modules,
            task_type="CAUSAL_LM",
        ),
    )
