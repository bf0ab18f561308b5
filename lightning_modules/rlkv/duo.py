"""DuoAttention's gate probe (Xiao et al., 2024), the baseline RLKV extends: the same gates and mixed attention, trained
to make the gated model's last-layer hidden states at the supervised positions match the full model's (MSE, averaged
per element) + ``reg_weight`` · mean|α|. The full model is the same frozen weights with the core switched off
(``attention_enabled(model, False)``), so no second copy is held. Gates clamped to [0, 1] after each step
(``clamp: after_step``; the release clamps before each training forward: ``before_forward``).

As the release trains it (RLKV ``base/duo_attn/train.py``, ``scripts/train_duo.sh``), which ``conf/model/duoattn.yaml``
follows by default: AdamW lr 0.02 with :func:`duo_schedule` (x0.1 rising linearly to x1 over the first fifth of the
steps, x1, falling to x0.1 over the last fifth), the streaming part in 128-token blocks (``window: block``, sink 128
+ recent 256), the whole QA span supervised (``data.layout: qa_span``: question + pass key + separator for each of 10
keys, ``lightning_modules/rlkv/data.py``), 2,000 steps of one sequence of 1K-32K tokens. ``scheduler: null``,
``window: token`` and ``data.layout: recite`` are ours before (constant lr, a token window, the recited keys only).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from lightning_modules.common.attention import attention_enabled
from lightning_modules.common.lm import CausalLMModule
from lightning_modules.rlkv.mixed_attention import check_backbone, check_window
from lightning_modules.rlkv.module import GatedModelMixin, check_clamp


def duo_schedule(optimizer, num_steps: int):
    """The release's LambdaLR: factor(step) = min(1, max((step + 1) / (N // 5), 0.1), max((N − step) / (N // 5), 0.1))
    over N = ``num_steps`` optimizer steps (step counted from 0, as Lightning steps the scheduler)."""
    fifth = max(1, num_steps // 5)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, max((step + 1) / fifth, 0.1), max((num_steps - step) / fifth, 0.1)))


class DuoAttentionModule(GatedModelMixin, CausalLMModule):
    def __init__(self, backbone: Mapping[str, Any], optimizer=None, scheduler=None, sink: int = 128,
                 recent: int = 256, window: str = "token", block: int = 128, gate_init: float = 1.0,
                 reg_weight: float = 0.05, clamp: str = "after_step"):
        check_window(sink, recent, window, block)
        check_clamp(clamp)
        super().__init__(backbone, optimizer, scheduler)
        self.clamp = clamp
        self.window = {"sink": sink, "recent": recent, "window": window, "block": block, "init": gate_init}
        self.reg_weight = reg_weight
        self.mixed = None
        self.results: dict = {}

    def setup(self, stage: str) -> None:
        check_backbone(self.backbone_spec)

    def build_model(self):
        return self.install_gates(super().build_model(), self.window)

    def distill_loss(self, batch) -> torch.Tensor:
        kw = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
        with torch.no_grad(), attention_enabled(self.model, False):
            target = self.model(**kw).hidden_states[-1][batch["supervise"]]
        pred = self.model(**kw).hidden_states[-1][batch["supervise"]]
        return F.mse_loss(pred.float(), target.float())

    def training_step(self, batch, batch_idx):
        mse = self.distill_loss(batch)
        reg = self.mixed.gates.abs().mean()
        loss = mse + self.reg_weight * reg
        self.log_dict({"train/loss": loss, "train/distill_mse": mse, "train/gate_mean": reg}, on_step=True,
                      on_epoch=False, batch_size=batch["input_ids"].shape[0])
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.clamp_after_step()

    def on_validation_epoch_start(self):
        self._val_sum = self._val_count = 0.0

    @torch.no_grad()
    def validation_step(self, batch, batch_idx):
        self._val_sum += float(self.distill_loss(batch))
        self._val_count += 1

    def on_validation_epoch_end(self, prefix: str = "val"):
        self.log(f"{prefix}/distill_mse", self._val_sum / max(1.0, self._val_count), prog_bar=True)

    def on_test_epoch_start(self):
        self.on_validation_epoch_start()

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self):
        self.on_validation_epoch_end("test")

    def on_fit_end(self):
        self.results.update(self.gate_results())
