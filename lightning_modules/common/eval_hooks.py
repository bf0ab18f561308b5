"""Modules whose test loop is their validation loop (one ``validation_step``, one report ``_eval_end(prefix)``)."""
from __future__ import annotations


class TestIsValidation:
    """Mix in before ``CausalLMModule``: the test epoch runs the validation hooks and reports under ``test/``."""

    def on_validation_epoch_end(self):
        self._eval_end("val")

    def on_test_epoch_start(self):
        self.on_validation_epoch_start()

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self):
        self._eval_end("test")
