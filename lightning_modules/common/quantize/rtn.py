"""Round-to-nearest on a symmetric per-row absmax grid: the shared round-to-grid helper and the RTN baseline.

Grid with ``levels`` points per row, scale from the row's absmax:
- odd ``levels`` = 2m+1: points s·{−m, …, m} with s = absmax/m (zero is a level; Huffman-GPTQ's 2^{R+1}−1);
- even ``levels`` = 2m: mid-rise points s·{−m+½, …, m−½} with s = absmax/(m−½) (all 2^R levels used, so R = 1
  is the sign quantizer ±absmax).
Codes are the integer level indices (−m..m, or −m..m−1 for even grids). RTN's rate axis is log-cardinality
(log2 levels) + 16/n for the fp16 row scale; its entropy-coded rates are reported too.
"""
from __future__ import annotations

import math

import torch

from lightning_modules.common.quantize.base import AffineGrid, LayerStats, QuantResult, Quantizer
from lightning_modules.common.quantize.rate import RateReport, column_entropy_bits, entropy_bits, row_scale_side_bits


def absmax_scale(weight: torch.Tensor, levels: int) -> torch.Tensor:
    """Per-row step s (a×1) of the symmetric absmax grid with ``levels`` points."""
    if levels < 2:
        raise ValueError(f"a grid needs at least 2 levels, got {levels}: raise the rate")
    absmax = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    m = levels // 2
    return absmax / m if levels % 2 else absmax / (m - 0.5)


def round_to_grid(x: torch.Tensor, scale: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x̂, codes): nearest point of the symmetric ``levels``-point grid with step ``scale`` (broadcast), clipped."""
    m = levels // 2
    if levels % 2:
        q = torch.clamp(torch.round(x / scale), -m, m)
        return q * scale, q
    q = torch.clamp(torch.floor(x / scale), -m, m - 1)
    return (q + 0.5) * scale, q


def symmetric_grid(scale: torch.Tensor, levels: int) -> AffineGrid:
    """The ``round_to_grid`` grid as an affine one (``export.py`` packs it): code c = q + m ∈ 0..levels−1, the per-row
    step as the scale (one group per row) and zero m (odd levels: Ŵ = q·s) or m − ½ (even, mid-rise: Ŵ = (q + ½)·s)."""
    m = levels // 2
    zero = m if levels % 2 else m - 0.5
    step = scale.detach().double().cpu().reshape(-1, 1)
    return AffineGrid(step, torch.full_like(step, zero), levels)


def levels_for_rate(rate: float, extra_bit: bool = False) -> int:
    """2^R levels (log-cardinality R), or 2^{R+1}−1 (odd) with ``extra_bit`` (Huffman-GPTQ, spec §4.4)."""
    if extra_bit:
        n = int(round(2 ** (rate + 1))) - 1
        return max(3, n if n % 2 else n + 1)
    return max(2, int(round(2 ** rate)))


def grid_rate_report(codes: torch.Tensor, levels: int, accounting: str) -> RateReport:
    a, n = codes.shape
    return RateReport(rows=a, cols=n, live_cols=n, entropy_pooled=entropy_bits(codes),
                      entropy_column=column_entropy_bits(codes), side_bits=row_scale_side_bits(a),
                      levels=levels, accounting=accounting)


class RTN(Quantizer):
    """Per-row absmax round-to-nearest with 2^R levels; rate on the log-cardinality axis by default."""

    name = "rtn"
    no_grid_reason = None  # reports its AffineGrid

    def __init__(self, accounting: str = "cardinality"):
        self.accounting = accounting

    def quantize(self, weight: torch.Tensor, stats: LayerStats | None, rate: float, rate_control: bool = False) -> QuantResult:
        w = weight.double()
        levels = levels_for_rate(rate)
        scale = absmax_scale(w, levels)
        w_hat, codes = round_to_grid(w, scale, levels)
        return QuantResult(w_hat, codes.to(torch.int32), grid_rate_report(codes, levels, self.accounting),
                           {"levels": levels, "nominal_bits": math.log2(levels), "grid": symmetric_grid(scale, levels)})
