"""The mask-agnostic fine-tune of "Masks Can Be Distracting" (arXiv 2511.21338): ``MDLMModule``'s studies on a
masked diffusion LM trained with ``loss.py``'s L = alpha L_CE + beta L_TV, LoRA (``common/lora.py``) and the max_masks
curriculum (``mask_budget``: linear from min_masks to max_masks over curriculum_steps optimizer steps). Each batch is a
list of (question ids, answer ids) pairs; both branches run in one forward pass.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from lightning_modules.mdlm_masks.loss import STOPGRAD, build_ma_batch, mask_agnostic_loss, mask_budget
from lightning_modules.mdlm_masks.module import MDLMModule


class MaskAgnosticModule(MDLMModule):
    """The mask-agnostic fine-tune (``loss.py``) of a masked diffusion LM, with LoRA and the max_masks curriculum.

    Args (beyond ``MDLMModule``'s):
        alpha, beta: weights of L_CE and L_TV (0.1; 1 Base / 10 Instruct / 0 CE-only).
        p_low, p_high: the answer masking probability's range (0.2, 0.8).
        max_masks, curriculum_steps, min_masks: the bound on appended masks grows min → max over the steps (600, 5000).
        context: N, the length the masks must fit in (1024).
        tv_stopgrad: ``none`` (both branches) or ``second``.
        lora: ``{r, alpha, dropout, targets}`` (paper r 64, alpha 128, dropout 0) or null to train every weight.
    """

    def __init__(self, backbone: Mapping[str, Any], optimizer: Callable | None = None,
                 scheduler: Callable | None = None, weight_decay: float = 0.0, ks: Sequence[int] = (0,),
                 filler: str = "mask", eval_steps: int = 1, grad_share: bool = False, eps: float = 1e-3,
                 alpha: float = 0.1, beta: float = 1.0, p_low: float = 0.2, p_high: float = 0.8,
                 max_masks: int = 600, curriculum_steps: int = 5000, min_masks: int = 0, context: int = 1024,
                 tv_stopgrad: str = "none", lora: Mapping[str, Any] | None = None):
        # its own loss (loss.py) on question/answer pairs: like LLaDA's SFT, nothing is cut to a random length
        super().__init__(backbone, optimizer, scheduler, weight_decay, ks, filler, eval_steps, grad_share, eps,
                         random_length_prob=0.0)
        if not 0 <= p_low < p_high <= 1:
            raise ValueError(f"model.p_low={p_low} must be < model.p_high={p_high}, both in [0, 1] (paper: 0.2, 0.8)")
        if not 0 <= max_masks < context:
            raise ValueError(f"model.max_masks={max_masks} must lie in 0..model.context-1={context - 1}: the masks are "
                             "appended inside the context")
        if tv_stopgrad not in STOPGRAD:
            raise ValueError(f"model.tv_stopgrad={tv_stopgrad!r}: choose none (both branches) or second")
        self.alpha, self.beta, self.p_low, self.p_high = alpha, beta, p_low, p_high
        self.max_masks, self.curriculum_steps, self.min_masks = max_masks, curriculum_steps, min_masks
        self.context, self.tv_stopgrad, self.lora = context, tv_stopgrad, dict(lora) if lora else None

    def build_model(self):
        model = super().build_model()
        if self.lora and not self.causal:
            from lightning_modules.common.lora import apply_lora

            model.model = apply_lora(model.model, **self.lora)
        return model

    def compute_loss(self, batch) -> torch.Tensor:
        tok = self._tokenizer()
        budget = mask_budget(self.global_step, self.max_masks, self.curriculum_steps, self.min_masks)
        b = build_ma_batch([(r["prompt_ids"], r["answer_ids"]) for r in batch], self.model.mask_token_id,
                           tok.eos_token_id, self.p_low, self.p_high, budget, self.context)
        n = b.x1.shape[0]
        logits = self.model.logits(torch.cat([b.x1, b.x2]).to(self.device))  # both branches in one pass
        out = mask_agnostic_loss(logits[:n], logits[n:], b.targets.to(self.device), b.masked.to(self.device),
                                 b.p.to(self.device), self.alpha, self.beta, self.tv_stopgrad)
        self.log_dict({"train/ce": out["ce"], "train/tv": out["tv"], "train/max_masks": float(budget)},
                      on_step=True, on_epoch=False, batch_size=n)
        return out["loss"]

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=len(batch))
        return loss
