"""The SPAG safety phase: a conditional projection step on the safe-set gradient (spec §1.3).

After the safe micro-batches' gradient g of L_s has been accumulated into ``p.grad``:

- ``trigger = L_s > tau + delta``; without a trigger nothing changes (gradients are dropped).
- ``code_faithful`` (the release): clip the global norm to ``max_grad_norm``, then per tensor
  g_p <- min((L_s - tau) / (||g_p|| + 1e-8), alpha_max) · g_p and step ``optimizer`` (the utility phase's, its
  moments shared).
- ``polyak`` (the paper's reading): the projection onto the linearised constraint L_s + gᵀΔθ <= tau with trust
  radius ``eta_safe``: Δθ = -min((L_s - tau) / ||g||, eta_safe) · g / ||g|| on the unclipped global g, applied to
  the parameters directly (no optimizer; its moments untouched).

Counting (one scheduler step and one step per update, triggered or not) is the caller's.
"""
from __future__ import annotations

from typing import Iterable

import torch

PROJECTIONS = ("code_faithful", "polyak")


def safety_step(params: Iterable[torch.nn.Parameter], loss: float, optimizer: torch.optim.Optimizer | None, *,
                tau: float = 0.2, delta: float = 0.1, projection: str = "code_faithful", alpha_max: float = 1.0,
                eta_safe: float = 5e-5, max_grad_norm: float | None = 1.0) -> dict:
    """One safety decision and (if triggered) update; gradients are cleared either way. Returns ``trigger`` (0/1),
    ``grad_norm`` (global, before clipping) and ``scale`` (code_faithful: the mean per-tensor factor; polyak: the
    step length)."""
    if projection not in PROJECTIONS:
        raise ValueError(f"model.projection={projection!r}: choose one of {', '.join(PROJECTIONS)}")
    params = [p for p in params if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([p.grad.detach().float().norm() for p in params]))) if params else 0.0
    out = {"trigger": 0, "grad_norm": norm, "scale": 0.0}
    if loss > tau + delta and params:
        out["trigger"] = 1
        excess = loss - tau
        if projection == "code_faithful":
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            scales = []
            with torch.no_grad():
                for p in params:
                    a = min(excess / (float(p.grad.norm()) + 1e-8), alpha_max)
                    p.grad.mul_(a)
                    scales.append(a)
            out["scale"] = sum(scales) / len(scales)
            optimizer.step()
        else:
            step = min(excess / max(norm, 1e-12), eta_safe)
            with torch.no_grad():
                for p in params:
                    p.add_(p.grad, alpha=-step / max(norm, 1e-12))
            out["scale"] = step
    for p in params:
        p.grad = None
    return out
