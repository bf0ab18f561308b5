"""Stop a run at the first non-finite loss, keeping the last good checkpoint instead of overwriting it.

Two checks, both before ``ModelCheckpoint`` gets to save (Lightning runs checkpoint callbacks last):
the training loss after every batch, and the validation losses after every validation (weights that still
train on a finite loss can already give NaN on held-out data: such weights must not become ``last.ckpt``).
With several processes the decision is reduced across ranks (any rank non-finite stops all), so no rank is
left waiting in a collective.
"""
from __future__ import annotations

import math

import lightning as L
import torch


class NonFiniteLossError(RuntimeError):
    pass


def _message(what: str, value, step: int) -> str:
    return (f"{what} is {value} at step {step}: stopping; the last good checkpoint is kept. "
            "Lower the learning rate, add gradient clipping (trainer.gradient_clip_val) or check the data.")


class NaNGuard(L.Callback):
    def _any_rank(self, trainer, bad: bool) -> bool:
        if trainer.world_size > 1:
            return bool(trainer.strategy.reduce_boolean_decision(bad, all=False))
        return bad

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        bad = isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all())
        if self._any_rank(trainer, bad):
            # Raising here, before ModelCheckpoint's own batch-end hook runs, means no checkpoint of the
            # diverged weights is written; last.ckpt still holds the last good state.
            value = loss.item() if bad else "non-finite on another rank"
            raise NonFiniteLossError(_message("loss", value, trainer.global_step))

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking or trainer.state.fn != "fit":  # a standalone validate/test only reports
            return
        bad = {k: float(v) for k, v in trainer.callback_metrics.items()
               if "loss" in k and isinstance(v, torch.Tensor) and v.numel() == 1 and not math.isfinite(float(v))}
        if self._any_rank(trainer, bool(bad)):
            what = ", ".join(f"{k}={v}" for k, v in bad.items()) or "a validation loss on another rank"
            raise NonFiniteLossError(_message(f"validation ({what})", "non-finite", trainer.global_step))
