"""The LLR callback: recomputes the layer-wise rates during training (lightning_modules/llr/, spec 2.4).

Every rank computes the spectra from the full weight (FSDP2 ``DTensor.full_tensor()``, DeepSpeed ZeRO-3
``GatheredParameters``; collective, so all ranks take part) on the device the weight lives on, then rank 0's α
are broadcast so every rank uses identical rates. The state (ramp, α, rates) is checkpointed; with the
optimizer's and scheduler's own state, a resumed run continues with exactly the same per-group rates. α and the
rate multipliers are logged (``llr/alpha/<module>``, ``llr/lr_ratio/<module>`` and their range).
"""
from __future__ import annotations

import math
from functools import partial

import lightning as L
import torch

from lightning_modules.llr import BASELINES, RateSchedule, module_alphas
from lightning_modules.llr.spectra import EDGE_ALPHA


class LLR(L.Callback):
    """Layer-wise rates from heavy-tailed self-regularization (the procedure: ``lightning_modules/llr/module.py``).

    Args:
        every: recompute interval in optimizer steps (released: 100); also recomputed at step 1.
        ramp_steps: L, the linear ramp to the new rate (released: 50).
        ratio: recompute only while step ≤ ratio·total_steps (released LLR_ratio: 0.2); then rates are frozen.
        r_min, r_max: the rate range as multiples of the base rate (released: 1 and 5; variants 3 and 4).
        total_steps: the schedule's length (stop_at); default ``trainer.max_steps``.
        min_eigs: modules with fewer eigenvalues are dropped (they join the untuned group).
        edge_alpha: the embedding's and head's α is the largest of the kept layers (``kept``, ours) or of all
            layers before the small ones are dropped (``all``, the release's order).
        esd_dtype: float32 (released) or float64 for the SVD.
        svd_threads: CPU threads for the SVDs (1; None leaves torch's setting); GPU weights are unaffected.
    """

    def __init__(self, every: int = 100, ramp_steps: int = 50, ratio: float = 0.2, r_min: float = 1.0,
                 r_max: float = 5.0, total_steps: int | None = None, min_eigs: int = 50, edge_alpha: str = "kept",
                 esd_dtype: str = "float32", svd_threads: int | None = 1):
        if esd_dtype not in ("float32", "float64"):
            raise ValueError(f"LLR(esd_dtype={esd_dtype!r}): choose float32 or float64")
        if edge_alpha not in EDGE_ALPHA:
            raise ValueError(f"LLR(edge_alpha={edge_alpha!r}): choose kept (ours) or all (the release's order)")
        alphas = partial(module_alphas, min_eigs=int(min_eigs), esd_dtype=getattr(torch, esd_dtype),
                         svd_threads=svd_threads, edge_alpha=edge_alpha)
        self.rates = RateSchedule(every, ramp_steps, ratio, r_min, r_max, alphas=alphas)
        self.total_steps = total_steps
        self._history: list[tuple[int, dict, dict]] = []  # (step, alphas, ratios) for the dashboard at fit end

    def _total(self, trainer) -> int:
        total = self.total_steps or trainer.max_steps
        if not total or total <= 0:
            raise ValueError("LLR needs the schedule's length: set trainer.max_steps or lightning_modules.llr.callback.total_steps")
        return int(total)

    def on_fit_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) != 1 or not all("llr_base_lr" in g for g in trainer.optimizers[0].param_groups):
            raise ValueError("the LLR callback needs the LLR module and optimizer: use model=llr "
                             "(lightning_modules.llr.LLRModule with lightning_modules.llr.llr_optimizer)")
        arm = trainer.optimizers[0].param_groups[0].get("llr_arm")
        if arm in BASELINES:
            raise ValueError(f"the LLR callback does not combine with model.optimizer.optimizer={arm}: the baseline "
                             "arms train at uniform rates as released; use callbacks=default (or optimizer=adamw|muon)")
        self._total(trainer)
        _scheduler(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        optimizer, k = trainer.optimizers[0], trainer.global_step
        if self.rates.due(k, self._total(trainer)):
            weights = {}
            for g in optimizer.param_groups:
                name = g["llr_module"]
                if name and name not in weights:
                    weights[name] = (pl_module.get_submodule(name).weight, bool(g["llr_edge"]))
            self.rates.recompute(k, optimizer, _scheduler(trainer), weights,
                                 broadcast=lambda obj: trainer.strategy.broadcast(obj, src=0))
            self._log(pl_module)
            self._history.append((k, dict(self.rates.alphas), dict(self.rates.ratios)))
        self.rates.apply_ramp(k, optimizer)

    def _log(self, pl_module) -> None:
        alphas = {k: a for k, a in self.rates.alphas.items() if math.isfinite(a)}
        logs = {f"llr/alpha/{k}": a for k, a in alphas.items()}
        logs.update({f"llr/lr_ratio/{k}": r for k, r in self.rates.ratios.items() if k in alphas})
        if alphas:
            logs.update({"llr/alpha_min": min(alphas.values()), "llr/alpha_max": max(alphas.values()),
                         "llr/alpha_mean": sum(alphas.values()) / len(alphas)})
        pl_module.log_dict(logs, on_step=True, on_epoch=False)

    def on_fit_end(self, trainer, pl_module) -> None:
        """Per-layer α and LR multiplier over the recompute steps (of this process: not kept across a resume)."""
        from lightning_modules.common.dashboard import heatmap, log_table

        if not self._history:
            return
        log_table("llr/recomputes", [{"step": k, "module": m, "alpha": a[m], "lr_ratio": r.get(m)}
                                     for k, a, r in self._history for m in a], trainer.loggers)
        modules, steps = list(self._history[-1][1]), [k for k, _, _ in self._history]
        for key, idx in (("alpha", 1), ("lr_ratio", 2)):
            values = [[h[idx].get(m, float("nan")) for h in self._history] for m in modules]
            heatmap(f"llr/{key}", values, trainer.loggers, xlabel="recompute step", ylabel="module",
                    xticks=steps, yticks=modules)

    def state_dict(self) -> dict:
        return self.rates.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.rates.load_state_dict(state_dict)


def _scheduler(trainer):
    configs = trainer.lr_scheduler_configs
    if not configs:
        return None
    sched = configs[0].scheduler
    if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        raise ValueError(f"the LLR callback needs a LambdaLR schedule (e.g. lightning_modules.common.lm.warmup_cosine) "
                         f"or none, got {type(sched).__name__}")
    return sched
