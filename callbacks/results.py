"""Results are files: ``metrics.json`` in the run dir with final and best metrics, step, wall time, sizes."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import lightning as L
import torch


def _number(v):
    if isinstance(v, torch.Tensor):
        v = v.detach().float().item() if v.numel() == 1 else None
    if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
        return v
    return None


class ResultsWriter(L.Callback):
    """Keeps the best value of each logged metric and writes ``metrics.json`` after fit, test and on crash.

    Papers with extra results (tables, per-task accuracy) put plain dicts in ``module.results``; they are
    written beside the metrics under ``results``.
    """

    def __init__(self, dirpath: str, filename: str = "metrics.json"):
        self.path = Path(dirpath) / filename
        self.best: dict[str, float] = {}
        self.final: dict[str, float] = {}
        self.t0 = time.time()
        self.status = "running"

    def _collect(self, trainer):
        for k, v in trainer.callback_metrics.items():
            x = _number(v)
            if x is None:
                continue
            self.final[k] = x
            better = min if ("loss" in k or "ppl" in k or "error" in k or k.endswith("kl")) else max
            self.best[k] = better(self.best.get(k, x), x)

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self._collect(trainer)

    def on_train_end(self, trainer, pl_module):
        self._collect(trainer)
        self.write(trainer, pl_module)

    def on_test_end(self, trainer, pl_module):
        self._collect(trainer)
        self.write(trainer, pl_module)

    def on_exception(self, trainer, pl_module, exception):
        self.status = f"failed: {type(exception).__name__}: {exception}"
        self.write(trainer, pl_module)

    def write(self, trainer, pl_module):
        if trainer.global_rank != 0:
            return
        counts = pl_module.parameter_counts() if hasattr(pl_module, "parameter_counts") else {}
        payload = {
            "status": self.status if self.status != "running" else "ok",
            "final": self.final,
            "best": self.best,
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "wall_time_s": round(time.time() - self.t0, 2),
            "parameters": counts,
            "results": getattr(pl_module, "results", None) or {},
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=2, default=float))
        tmp.replace(self.path)
