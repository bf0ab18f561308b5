"""Calibration statistics: input second moments of linear layers, collected with forward hooks.

``MomentCollector`` streams Σ = E[xxᵀ] for a set of ``nn.Linear`` modules in float64 accumulators (memory O(n²)
per layer, whatever the number of calibration tokens); with per-token weights c_j (``weight``, e.g. dllmquant's CGQ)
Σ = Σ_j c_j x_j x_jᵀ / Σ_j c_j. ``capture_inputs`` grabs one module's input on one batch
and stops the forward there (sequential mode needs the full-precision and the quantized inputs of the same tokens,
to accumulate Σ_X̂, Σ_{XX̂} = E[x x̂ᵀ] and Σ_X).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


class _Stop(Exception):
    """Raised by a hook to end a forward pass early, once the needed input has been seen."""


def _flat(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    if mask is not None:
        x = x[mask.reshape(-1).to(x.device).bool()]
    return x.double()


def _flat_weight(weight: torch.Tensor, mask: torch.Tensor | None, device) -> torch.Tensor:
    """Per-token weights (B×S) flattened like ``_flat`` flattens the tokens."""
    w = weight.reshape(-1).to(device=device, dtype=torch.float64)
    if mask is not None:
        w = w[mask.reshape(-1).to(device).bool()]
    if (w < 0).any():
        raise ValueError("token weights must be non-negative")
    return w


class MomentCollector:
    """Accumulates E[xxᵀ] of each module's input over calibration batches. Modules that see the same input
    tensor (q/k/v; gate/up) can share one accumulator by passing the same key. Set ``weight`` (B×S, like ``mask``)
    before a batch to weight its tokens: Σ = Σ_j c_j x_j x_jᵀ / Σ_j c_j (None: every c_j = 1, the plain mean);
    ``counts`` stays the number of tokens."""

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device | str | None = None):
        self.modules = modules
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.mask: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self.totals: dict[str, float] = {}  # Σ_j c_j per key (the token count when unweighted)
        self._handles = []

    def _hook(self, key):
        def hook(mod, args):
            x = _flat(args[0].detach(), self.mask)
            dev = self.device or x.device
            if self.weight is None:
                xtx, total = (x.T @ x).to(dev), x.shape[0]
            else:
                c = _flat_weight(self.weight, self.mask, x.device)
                xtx, total = ((x * c.unsqueeze(1)).T @ x).to(dev), float(c.sum())
            if key in self.sums:
                self.sums[key] += xtx
            else:
                self.sums[key] = xtx
            self.counts[key] = self.counts.get(key, 0) + x.shape[0]
            self.totals[key] = self.totals.get(key, 0) + total
        return hook

    def __enter__(self):
        for key, mod in self.modules.items():
            self._handles.append(mod.register_forward_pre_hook(self._hook(key)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        return False

    def moments(self) -> dict[str, torch.Tensor]:
        return {k: self.sums[k] / (self.totals[k] if self.totals[k] > 0 else 1) for k in self.sums}


@torch.no_grad()
def capture_inputs(model, module: torch.nn.Module, batch: dict) -> torch.Tensor:
    """The input of ``module`` when ``model`` runs on ``batch`` (the forward stops right there)."""
    return stop_at(module, lambda: run_batch(model, batch))


def stop_at(module: torch.nn.Module, run, output_index: int | None = None) -> torch.Tensor:
    """Call ``run()`` (a forward that passes through ``module``) and stop it at ``module``: its input, or with
    ``output_index`` that element of its output (e.g. 1: an eager attention's probabilities)."""
    box = {}

    def before(mod, args):
        box["x"] = args[0].detach()
        raise _Stop

    def after(mod, args, out):
        box["x"] = out[output_index].detach() if out[output_index] is not None else None
        raise _Stop

    handle = (module.register_forward_pre_hook(before) if output_index is None
              else module.register_forward_hook(after))
    try:
        run()
    except _Stop:
        pass
    finally:
        handle.remove()
    if box.get("x") is None:
        raise RuntimeError(f"the forward pass never produced what it should capture at {type(module).__name__} "
                           f"({'its input' if output_index is None else f'output {output_index}'})")
    return box["x"]


@torch.no_grad()
def run_batch(model, batch: dict):
    dev = next(model.parameters()).device
    kwargs = {"input_ids": batch["input_ids"].to(dev)}
    if batch.get("attention_mask") is not None:
        kwargs["attention_mask"] = batch["attention_mask"].to(dev)
    return model(**kwargs, use_cache=False) if _takes_cache(model) else model(**kwargs)


def _takes_cache(model) -> bool:
    return hasattr(model, "generation_config") or hasattr(getattr(model, "config", None), "use_cache")


@contextmanager
def eval_mode(*models):
    states = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, s in zip(models, states):
            m.train(s)
