"""LoRA adapters on a loaded model (``trainer.lora``; needs peft)."""

from __future__ import annotations


def wrap_lora(model, trainer_cfg):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:  # pragma: no cover - peft is optional
        raise ImportError("trainer.lora.enabled needs peft: pip install 'hacrl-fed[lora]'") from err
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
