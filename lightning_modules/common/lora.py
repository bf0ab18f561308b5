"""LoRA adapters through peft, shared by every paper that adapts a frozen backbone (hici; spard, mdlm_masks, esr and
real_vqa next).

``apply_lora`` wraps a transformers model with LoRA on the ``targets`` linear layers, freezes everything else, then
unfreezes whatever the recipe trains in full (``trainable``: parameter-name substrings, e.g. LongLoRA's
``["embed", "norm"]``). ``merge_lora`` folds the adapters into the base weights and returns the plain model.
"""
from __future__ import annotations

from typing import Sequence

import torch

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def apply_lora(model: torch.nn.Module, r: int = 8, alpha: float = 16, dropout: float = 0.0,
               targets: Sequence[str] = DEFAULT_TARGETS, trainable: Sequence[str] = (),
               task_type: str = "CAUSAL_LM", within: str | None = None) -> torch.nn.Module:
    """The peft-wrapped model: LoRA(r, alpha, dropout) on ``targets``, and parameters whose name contains any of
    ``trainable`` trained in full; every other parameter frozen. ``within``: the name of a submodule (a VLM's
    language model, e.g. ``model.language_model``) whose ``targets`` alone get adapters (a CLIP tower has q_proj too)."""
    from peft import LoraConfig, get_peft_model

    if r <= 0:
        raise ValueError(f"lora.r={r} must be a positive rank")
    names = [n for n, _ in model.named_modules() if within is None or n.startswith(within + ".")]
    missing = [t for t in targets if not any(n.split(".")[-1] == t for n in names)]
    if missing:
        raise ValueError(f"lora.targets {missing} match no module of {type(model).__name__}"
                         f"{'' if within is None else ' under ' + within}; name its linear layers (e.g. q_proj, v_proj)")
    # full names match exactly in peft, so ``within`` keeps same-named layers elsewhere (the vision tower) untouched
    chosen = list(targets) if within is None else [n for n in names if n.split(".")[-1] in targets]
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=chosen, bias="none",
                     task_type=task_type)
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from callbacks.deepspeed_hf import unpartitioned

    # Built inside ZeRO-3's zero.Init (Lightning's configure_model), the adapters were partitioned at creation and peft's
    # cast to the base layer's dtype left them empty (a `vec (0)` matmul at hici_qwen3_8b's first step): they are built
    # whole, as peft + ZeRO-3 elsewhere do, and the engine partitions them with every other plain parameter. ZeRO-3
    # wants one dtype over the trainable weights (it keeps their fp32 masters itself): the adapters stay at the base
    # layer's, instead of peft's fp32 upcast.
    zero3 = is_deepspeed_zero3_enabled()
    with unpartitioned():
        model = get_peft_model(model, cfg, autocast_adapter_dtype=not zero3)
    for name, p in model.named_parameters():
        if any(t in name for t in trainable):
            p.requires_grad_(True)
    return model


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model with the adapters folded into its weights (in place; copy first to keep both)."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
