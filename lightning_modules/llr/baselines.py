"""The baseline arms of LLR's main table (spec 2.6: LARS, LAMB, Sharpness), as the released code trains them.

The released ``olmo/optim.py::build_optimizer_LLR`` (github.com/hed-ucas/Layer-wise-Learning-Rate) accepts
``lars``, ``lamb`` and ``sharpnessadamw`` besides AdamW; all three run with one uniform schedule (no LLR rates).
Each class below is written from the update rule the release uses, with the release's defaults:

- ``LARS`` (You, Gitman, Ginsburg 2017, arXiv 1708.03888; the release's ``olmo/lars.py``): per tensor, velocity
  v ← μ·v + (1 − μ)·(g + β·w), then w ← w − η·‖w‖/(ε + ‖v‖)·v, with μ 0.9, ε 1e-6 (L2 decay β inside the
  velocity; the released 1B script passes β = 1e-6 and η = 1e-3).
- ``Lamb`` (You et al. 2019, arXiv 1904.00962; the release calls ``torch_optimizer.Lamb`` with only the weight
  decay, so its defaults apply): m ← β₁m + (1 − β₁)g, v ← β₂v + (1 − β₂)g², no bias correction,
  u = m/(√v + ε) + λ·w, w ← w − η·min(‖w‖, 10)/‖u‖·u (ratio 1 when either norm is 0); ε 1e-6. Released 1B: η 1e-2.
  Written here rather than installed: torch_optimizer is unmaintained since 2021.
- Sharpness (Wang et al. 2025, arXiv 2502.19002; the release's ``create_sharpness_grouped_optimizer``): plain
  AdamW with fixed per-block multipliers of the base rate (``SHARPNESS_RATIOS``): norms 1, Q/K 8, V/O 4,
  MLP 6, embed/head 10, anything else 1. Released 1B: η 1e-4.
"""
from __future__ import annotations

import torch

# Multipliers of the base rate by block, in the release's matching order (first match wins).
SHARPNESS_RATIOS: dict[str, float] = {"norm": 1.0, "qk": 8.0, "vo": 4.0, "mlp": 6.0, "edge": 10.0, "other": 1.0}
_BLOCKS = (("norm", ("norm",)), ("qk", ("q_proj", "k_proj")), ("vo", ("v_proj", "o_proj")),
           ("mlp", ("gate_proj", "down_proj", "up_proj")), ("edge", ("embed", "head")))


def sharpness_block(name: str) -> str:
    """The Sharpness block of a parameter or module name (``norm``, ``qk``, ``vo``, ``mlp``, ``edge``, ``other``)."""
    for block, keys in _BLOCKS:
        if any(k in name for k in keys):
            return block
    return "other"


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling over SGD with momentum (see the module docstring for the update)."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, weight_decay: float = 5e-4, eps: float = 1e-6):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or eps <= 0:
            raise ValueError(f"LARS(lr={lr}, momentum={momentum}, weight_decay={weight_decay}, eps={eps}): "
                             "need lr >= 0, 0 <= momentum < 1, weight_decay >= 0, eps > 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            mu, wd = group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad.add(p, alpha=wd) if wd else p.grad
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.mul_(mu).add_(d, alpha=1 - mu)
                trust = p.norm() / (group["eps"] + buf.norm())
                p.sub_(group["lr"] * trust * buf)
        return loss


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive moments (LAMB) with ``torch_optimizer.Lamb``'s defaults (see the module docstring)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, clamp_value: float = 10.0):
        if lr < 0 or not all(0 <= b < 1 for b in betas) or eps <= 0 or weight_decay < 0 or clamp_value <= 0:
            raise ValueError(f"Lamb(lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}, "
                             f"clamp_value={clamp_value}): need lr >= 0, betas in [0, 1), eps > 0, "
                             "weight_decay >= 0, clamp_value > 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      clamp_value=clamp_value))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (b1, b2), wd = group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                u = m / (v.sqrt() + group["eps"])
                if wd:
                    u.add_(p, alpha=wd)
                w_norm, u_norm = p.norm().clamp(max=group["clamp_value"]), u.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(u_norm))
                p.sub_(group["lr"] * trust * u)
        return loss
