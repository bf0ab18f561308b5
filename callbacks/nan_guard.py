"""Stop a run at the first non-finite loss, keeping the last good checkpoint instead of overwriting it."""
from __future__ import annotations

import lightning as L
import torch


class NonFiniteLossError(RuntimeError):
    pass


class NaNGuard(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
            # Raising here, before ModelCheckpoint's own batch-end hook runs, means no checkpoint of the
            # diverged weights is written; last.ckpt still holds the last good state.
            raise NonFiniteLossError(
                f"loss is {loss.item()} at step {trainer.global_step}: stopping; the last good checkpoint is kept. "
                "Lower the learning rate, add gradient clipping (trainer.gradient_clip_val) or check the data.")
