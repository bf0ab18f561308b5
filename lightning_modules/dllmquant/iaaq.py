"""IA-AQ (Interaction-Aware Activation Quantization): the value matrix V quantized per token and head with a
per-layer clip ratio chosen by an importance-weighted search.

Q_α(V): symmetric absmax grid per (token, head) row of V at ``bits`` with range α·max|V_row| (the fake-quant grid of
``callbacks/kernels/fake_quant.py``); α on ``grid`` points in [``min_ratio``, 1]. Importance of key token j: w_j =
Σ_i A_ij, the column mass of the bidirectional softmax, averaged over heads. Objectives:
- ``v`` (default): Σ_j w_j ‖V_j − Q_α(V_j)‖²;
- ``output``: ‖A(V − Q_α(V))‖², the attention output's error.
With uniform importance ``v`` is the plain MSE clip search. The softmax output itself stays unquantized.

Both run inside the bidirectional core (``common/diffusion.py``'s ``_paperlab_value_hook``): ``ValueRecorder``
accumulates each layer's error per α over calibration states (no V is stored), ``ValueQuantizer`` then applies the
chosen α per layer.
"""
from __future__ import annotations

import torch

from callbacks.kernels.fake_quant import fake_quant
from lightning_modules.common.attention import attention_modules

OBJECTIVES = ("v", "output")
HOOK = "_paperlab_value_hook"


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"model.iaaq.objective={objective!r}: choose one of {', '.join(OBJECTIVES)}")
    return objective


def clip_grid(points: int = 40, min_ratio: float = 0.05) -> torch.Tensor:
    return torch.linspace(min_ratio, 1.0, points, dtype=torch.float64)


def quantize_values(v: torch.Tensor, bits: int, ratio: float) -> torch.Tensor:
    """Q_α(V): per (token, head) row of ``v`` (…, head_dim), symmetric, range ``ratio``·absmax."""
    return fake_quant(v, bits, -1, True, float(ratio), "torch")


def attention_probs(attn, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The bidirectional softmax A (B, H, N, N) the core computes (no mask)."""
    return torch.softmax((q.float() @ k.float().transpose(-1, -2)) * attn.scaling, dim=-1)


def importance(a: torch.Tensor) -> torch.Tensor:
    """w_j = Σ_i A_ij, averaged over heads: (B, N)."""
    return a.double().mean(1).sum(1)


@torch.no_grad()
def clip_errors(v: torch.Tensor, grid: torch.Tensor, bits: int, objective: str = "v",
                weight: torch.Tensor | None = None, a: torch.Tensor | None = None) -> torch.Tensor:
    """The objective at every α of ``grid`` for one batch: V (B, H, N, D); ``weight`` (B, N) for ``v`` (None =
    uniform: the plain MSE); A (B, H, N, N) for ``output``."""
    check_objective(objective)
    out = torch.zeros(len(grid), dtype=torch.float64)
    vd = v.double()
    for i, r in enumerate(grid.tolist()):
        e = vd - quantize_values(v, bits, r).double()
        if objective == "v":
            per_tok = (e ** 2).sum(-1).sum(1)  # (B, N): over head_dim and heads
            out[i] = float(per_tok.sum() if weight is None else (weight.double() * per_tok).sum())
        else:
            out[i] = float(((a.double() @ e) ** 2).sum())
    return out


class ValueRecorder:
    """Calibration hook: per layer, the clip objective at every α, summed over the states it sees; V unchanged."""

    def __init__(self, grid: torch.Tensor, bits: int = 4, objective: str = "v", weighted: bool = True):
        self.grid, self.bits, self.objective, self.weighted = grid, bits, check_objective(objective), weighted
        self.errors: dict[int, torch.Tensor] = {}
        self.layer: dict[int, int] = {}

    def __call__(self, attn, q, k, v):
        a = attention_probs(attn, q, k)
        w = importance(a) if self.weighted else None
        key = self.layer[id(attn)]
        err = clip_errors(v, self.grid, self.bits, self.objective, w, a)
        self.errors[key] = self.errors.get(key, 0) + err
        return v

    def ratios(self) -> dict[int, float]:
        return {k: float(self.grid[int(e.argmin())]) for k, e in sorted(self.errors.items())}


class ValueQuantizer:
    """Quantizes V at ``bits`` with each layer's clip ratio (``ratios``: layer index -> α; missing = 1)."""

    def __init__(self, ratios: dict[int, float], bits: int = 4):
        self.ratios, self.bits = dict(ratios), bits
        self.layer: dict[int, int] = {}

    def __call__(self, attn, q, k, v):
        return quantize_values(v, self.bits, self.ratios.get(self.layer[id(attn)], 1.0))


def install(model, hook) -> None:
    """Put ``hook`` (a recorder or quantizer, or None to remove) into every bidirectional attention layer."""
    layers = attention_modules(model)
    if hook is not None:
        hook.layer = {id(m): i for i, m in enumerate(layers)}
    for m in layers:
        if hook is None:
            m.__dict__.pop(HOOK, None)
        else:
            m.__dict__[HOOK] = hook
