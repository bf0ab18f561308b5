"""Round-to-nearest grids: the shared round-to-grid helpers and the RTN baseline.

Two grids (``grid`` of ``RTN`` and ``GPTQ``):

``absmax_row`` (ours, the default of the classes: the WaterSIC paper's baselines use it) has ``levels`` points per
row, scale from the row's absmax:
- odd ``levels`` = 2m+1: points s·{−m, …, m} with s = absmax/m (zero is a level; Huffman-GPTQ's 2^{R+1}−1);
- even ``levels`` = 2m: mid-rise points s·{−m+½, …, m−½} with s = absmax/(m−½) (all 2^R levels used, so R = 1
  is the sign quantizer ±absmax).
Codes are the integer level indices (−m..m, or −m..m−1 for even grids). RTN's rate axis is log-cardinality
(log2 levels) + 16/n for the fp16 row scale; its entropy-coded rates are reported too.

``minmax_group`` (the standard asymmetric grid of the GPTQ and AWQ releases, issue 40): per row and group of
``group_size`` input columns (128 by default; the last group may be shorter), 2^R codes 0..maxq (maxq = 2^R − 1),
step s = (hi − lo)/maxq and integer zero point z, ŵ = s·(clamp(round(w/s) + z, 0, maxq) − z). ``include_zero``
picks the range: True is GPTQ's quantizer (lo = min(min w, 0), hi = max(max w, 0), an all-zero group gets [−1, 1],
z = round(−lo/s)); False is AWQ's ``pseudo_quantize_tensor`` (lo, hi = the group's min and max, s floored at 1e-5/maxq,
z = clamp(−round(lo/s), 0, maxq)). The rate adds an fp16 step and an R-bit zero per group: R + (16 + R)/group_size.
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


GRIDS = ("absmax_row", "minmax_group")


def check_grid(grid: str, group_size: int) -> None:
    if grid not in GRIDS:
        raise ValueError(f"quantizer grid={grid!r}: choose absmax_row (per-row symmetric, ours) or minmax_group "
                         "(asymmetric zero-point groups, the GPTQ / AWQ releases')")
    if grid == "minmax_group" and not (group_size == -1 or group_size >= 1):
        raise ValueError(f"quantizer group_size={group_size}: a positive number of input columns, or -1 (one group a row)")


def affine_params(x: torch.Tensor, maxq: int, include_zero: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(step, zero) per row (a×1 each) of the asymmetric min-max grid of ``x`` (a×g) with codes 0..maxq: GPTQ's
    quantizer (``include_zero``: the range holds 0) or AWQ's (the group's own min and max)."""
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    if include_zero:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        both = (lo == 0) & (hi == 0)
        lo, hi = torch.where(both, -1.0, lo), torch.where(both, 1.0, hi)
        step = (hi - lo) / maxq
        return step, torch.round(-lo / step)
    step = (hi - lo).clamp_min(1e-5) / maxq
    return step, (-torch.round(lo / step)).clamp(0, maxq)


def affine_round(x: torch.Tensor, step: torch.Tensor, zero: torch.Tensor, maxq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x̂, codes 0..maxq) on the affine grid (step, zero), broadcast over x."""
    q = torch.clamp(torch.round(x / step) + zero, 0, maxq)
    return step * (q - zero), q


def group_bounds(n: int, group_size: int) -> list[tuple[int, int]]:
    g = n if group_size == -1 else group_size
    return [(i, min(i + g, n)) for i in range(0, n, g)]


def affine_rtn(w: torch.Tensor, levels: int, group_size: int = 128, include_zero: bool = True):
    """(Ŵ, codes, step, zero) of round-to-nearest on the ``minmax_group`` grid (step, zero: a × groups)."""
    maxq, parts, codes, steps, zeros = levels - 1, [], [], [], []
    for i, j in group_bounds(w.shape[1], group_size):
        st, z = affine_params(w[:, i:j], maxq, include_zero)
        q, c = affine_round(w[:, i:j], st, z, maxq)
        parts.append(q), codes.append(c), steps.append(st), zeros.append(z)
    return torch.cat(parts, 1), torch.cat(codes, 1), torch.cat(steps, 1), torch.cat(zeros, 1)


def levels_for_rate(rate: float, extra_bit: bool = False) -> int:
    """2^R levels (log-cardinality R), or 2^{R+1}−1 (odd) with ``extra_bit`` (Huffman-GPTQ, spec §4.4)."""
    if extra_bit:
        n = int(round(2 ** (rate + 1))) - 1
        return max(3, n if n % 2 else n + 1)
    return max(2, int(round(2 ** rate)))


def grid_rate_report(codes: torch.Tensor, levels: int, accounting: str, groups: int = 1,
                     zero_bits: float = 0.0) -> RateReport:
    """Codes' rates + side information: an fp16 step per row and group, and ``zero_bits`` per group (an affine grid's
    zero point)."""
    a, n = codes.shape
    return RateReport(rows=a, cols=n, live_cols=n, entropy_pooled=entropy_bits(codes),
                      entropy_column=column_entropy_bits(codes),
                      side_bits=row_scale_side_bits(a, groups) + zero_bits * a * groups, levels=levels,
                      accounting=accounting)


def affine_result(w_hat, codes, step, zero, levels: int, accounting: str, **info) -> QuantResult:
    """The ``QuantResult`` of a ``minmax_group`` grid: its rate (step + zero per group) and ``info["grid"]``, the
    a × groups steps and zero points as an ``AffineGrid`` (what ``export.py`` packs)."""
    groups = step.shape[1]
    grid = AffineGrid(step.detach().double().cpu(), zero.detach().double().cpu(), levels)
    return QuantResult(w_hat, codes.to(torch.int32),
                       grid_rate_report(codes, levels, accounting, groups, zero_bits=math.log2(levels)),
                       {"levels": levels, "nominal_bits": math.log2(levels), "grid": grid, **info})


class RTN(Quantizer):
    """Round-to-nearest with 2^R levels on ``grid`` (absmax_row: per-row absmax, ours | minmax_group: asymmetric
    zero-point groups of ``group_size``, GPTQ's quantizer's range rule); rate on the log-cardinality axis by default."""

    name = "rtn"
    no_grid_reason = None  # reports its AffineGrid

    def __init__(self, accounting: str = "cardinality", grid: str = "absmax_row", group_size: int = 128):
        check_grid(grid, group_size)
        self.accounting, self.grid, self.group_size = accounting, grid, group_size

    def quantize(self, weight: torch.Tensor, stats: LayerStats | None, rate: float, rate_control: bool = False) -> QuantResult:
        w = weight.double()
        levels = levels_for_rate(rate)
        if self.grid == "minmax_group":
            return affine_result(*affine_rtn(w, levels, self.group_size), levels, self.accounting)
        scale = absmax_scale(w, levels)
        w_hat, codes = round_to_grid(w, scale, levels)
        return QuantResult(w_hat, codes.to(torch.int32), grid_rate_report(codes, levels, self.accounting),
                           {"levels": levels, "nominal_bits": math.log2(levels), "grid": symmetric_grid(scale, levels)})
