"""Export the trained backbone in transformers format (``save_pretrained``), with its tokenizer."""
from __future__ import annotations

from pathlib import Path

import lightning as L


class ExportPretrained(L.Callback):
    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank != 0:
            return
        model = getattr(pl_module, "export_model", lambda: pl_module.model)()
        self.dirpath.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(self.dirpath))
        dm = trainer.datamodule
        if dm is not None and getattr(dm, "tokenizer", None) is not None:
            dm.tokenizer.save_pretrained(str(self.dirpath))
