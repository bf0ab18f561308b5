"""AWQ (Lin et al., 2024) behind the ``Quantizer`` interface (one user today, dllmquant; it moves to
``common/quantize/`` when a second paper needs it).

Per-input-channel scale s = m^a with m = √diag Σ (the RMS of each input channel; AWQ's release uses mean |x|), a on a
``grid``-point grid in [0, 1], chosen to minimise the output error tr((W−Ŵ)Σ(W−Ŵ)ᵀ) with Ŵ = Q(W·diag s)·diag(1/s),
Q the per-row absmax round-to-nearest grid of ``rtn.py``. a = 0 is RTN. Σ is whatever the driver collected (token-
weighted under CGQ). ``info["input_scale"]`` carries s, so a W4A4 activation quantizer can see x/s
(``fake_quant.set_input_scales``).
"""
from __future__ import annotations

import math

import torch

from lightning_modules.common.quantize.base import LayerStats, QuantResult, Quantizer
from lightning_modules.common.quantize.rtn import (absmax_scale, grid_rate_report, levels_for_rate, round_to_grid,
                                                   symmetric_grid)


def awq_quantize(weight: torch.Tensor, sigma: torch.Tensor, levels: int, a: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Ŵ, codes, s, the per-row step of W·diag s) for one exponent ``a``."""
    w = weight.double()
    m = torch.diagonal(sigma.double()).clamp_min(0).sqrt()
    s = (m.clamp_min(1e-8) ** a) if a else torch.ones_like(m)
    ws = w * s
    step = absmax_scale(ws, levels)
    q, codes = round_to_grid(ws, step, levels)
    return q / s, codes, s, step


class AWQ(Quantizer):
    name = "awq"
    no_grid_reason = None  # reports its AffineGrid

    def __init__(self, grid: int = 20, accounting: str = "cardinality"):
        if grid < 1:
            raise ValueError(f"awq grid={grid}: at least one exponent")
        self.grid, self.accounting = grid, accounting

    def exponents(self) -> list[float]:
        return [0.0] if self.grid == 1 else [i / (self.grid - 1) for i in range(self.grid)]

    def quantize(self, weight: torch.Tensor, stats: LayerStats, rate: float, rate_control: bool = False) -> QuantResult:
        levels = levels_for_rate(rate)
        best = None
        for a in self.exponents():
            w_hat, codes, s, step = awq_quantize(weight, stats.sigma, levels, a)
            d = weight.double() - w_hat
            err = float(((d @ stats.sigma.double()) * d).sum())
            if best is None or err < best[0]:
                best = (err, a, w_hat, codes, s, step)
        _, a, w_hat, codes, s, step = best
        # the grid is W·diag(s)'s: a packed layer applies it to x / s (export.py)
        return QuantResult(w_hat, codes.to(torch.int32), grid_rate_report(codes, levels, self.accounting),
                           {"levels": levels, "nominal_bits": math.log2(levels), "awq_a": a, "input_scale": s,
                            "grid": symmetric_grid(step, levels)})
