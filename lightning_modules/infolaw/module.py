"""A causal LM on a data mixture that records what the mixture consumed, for the InfoLaw fits.

Standard next-token training (``CausalLMModule``); the data module (``lightning_modules.infolaw.data.MixtureDataModule``)
decides what each step reads. The module logs the realised per-bucket tokens D_k and epochs e_k = D_k / U_k
(``data/D_<k>``, ``data/e_<k>``) and leaves one row for the law in ``results.infolaw``: N (non-embedding
parameters), D (training tokens), w_k, U_k, s_k, D_k, e_k and the clean held-out test loss.
"""
from __future__ import annotations

from lightning_modules.common.lm import CausalLMModule


class InfoLawModule(CausalLMModule):
    def _mixture(self) -> dict | None:
        trainer = self._trainer
        dm = getattr(trainer, "datamodule", None) if trainer is not None else None
        if dm is None or not hasattr(dm, "mixture_stats"):
            return None
        sequences = trainer.global_step * trainer.accumulate_grad_batches * dm.batch_size * trainer.world_size
        return dm.mixture_stats(sequences)

    def on_train_end(self):
        stats = self._mixture()
        if stats is None:
            return
        for logger in self.loggers:  # outside a loop hook: log through the loggers directly
            logger.log_metrics({f"data/{k}": float(v) for k, v in stats.items() if k[:2] in ("D_", "e_")},
                               step=self.trainer.global_step)

    def on_test_epoch_end(self):
        super().on_test_epoch_end()
        stats = self._mixture()
        if stats is None:
            return
        for k, v in stats.items():
            if k[:2] in ("D_", "e_"):
                self.log(f"data/{k}", float(v))
        loss = float(self.trainer.callback_metrics["test/loss"])
        self.results = {"infolaw": {"N": self.parameter_counts().get("params/non_embedding"), **stats, "loss": loss}}
