"""GPTQ (Frantar et al., 2023) and Huffman-GPTQ, the WaterSIC paper's entropy-coded GPTQ baseline.

Standard GPTQ: H = Σ + μI with μ = percdamp·mean(diag Σ) (dead inputs, Σ_jj = 0, get H_jj = 1 and zero weights),
the upper Cholesky factor U of H⁻¹, columns in natural order (no act-order by default), blocks of 128 with lazy
batch updates, error feedback w_{>j} −= (w_j − q_j)/U_jj · U_{j,>j}. ``grid`` (``rtn.py``): ``absmax_row`` (ours, the
class default, which the WaterSIC baselines use) is the per-row symmetric absmax grid computed once from the original
rows (no groups); ``minmax_group`` (the IST-DASLab release with ``--groupsize``; dllmquant's default) is the
asymmetric zero-point grid of ``group_size`` columns, each group's step and zero found from the already
error-compensated weights when its first column is reached (the release's ``find_params`` on ``W[:, j:j+groupsize]``
of the block-updated matrix; with blocks of 128 and groups of 128 a group starts with its block).

Variants (switches):
- ``extra_bit=False`` (GPTQ): 2^R levels, rate on the log-cardinality axis (``accounting='cardinality'``).
- ``extra_bit=True`` (Huffman-GPTQ, spec §4.4): maxq = 2^{R+1}−1 levels (odd), rate = pooled code entropy + 16/n.
- ``error_feedback=False``: no feedback (then GPTQ is RTN on the same grid, whatever Σ).
- ``act_order=True``: columns by decreasing diag(H) (off by default, as in the authors' baseline).
- ``target_rate=True`` (entropy-coded variants only): the grid is made continuous, step absmax/h with h = 2^r − 1
  (h = m at integer r: the nominal 2^{R+1}−1 levels) and 2⌈h⌉+1 levels, and the spec's secant loop on r makes the
  reported rate (pooled entropy + 16/n) land within ``tol`` of the target: the fair comparison at the same entropy
  rate (spec §4.4), rather than at the nominal 1-4 bits.
``percdamp`` defaults to 0.01 (GPTQ paper); the WaterSIC README's baseline command uses 0.1 (conf/model/gptq.yaml).
"""
from __future__ import annotations

import math

import torch

from lightning_modules.common.quantize.base import LayerStats, QuantResult, Quantizer
from lightning_modules.common.quantize.rate import secant_search
from lightning_modules.common.quantize.rtn import (absmax_scale, affine_params, affine_result, affine_round, check_grid,
                                                   grid_rate_report, levels_for_rate, round_to_grid, symmetric_grid)


def gptq_scale(weight: torch.Tensor, sigma: torch.Tensor, levels: int) -> torch.Tensor:
    """GPTQ's per-row step: the absmax grid of the rows with the dead inputs (Σ_jj = 0) zeroed."""
    dead = torch.diagonal(sigma) == 0
    return absmax_scale(torch.where(dead, 0.0, weight.double()), levels)


def gptq_quantize(weight: torch.Tensor, sigma: torch.Tensor, levels: int, percdamp: float = 0.01,
                  blocksize: int = 128, error_feedback: bool = True, act_order: bool = False,
                  scale: torch.Tensor | None = None, group_size: int | None = None):
    """(Ŵ, codes) of GPTQ on the ``levels``-point per-row absmax grid (or the given per-row step ``scale``);
    with ``group_size`` (−1 = one group a row) on the ``minmax_group`` grid instead, returning (Ŵ, codes, step,
    zero) with the a × groups steps and zero points. float64 throughout."""
    w = weight.double().clone()
    h = sigma.double().clone()
    a, n = w.shape
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    affine = group_size is not None
    scale = None if affine else gptq_scale(weight, sigma, levels) if scale is None else scale
    maxq, steps, zeros = levels - 1, [], []
    gsize = n if group_size == -1 else group_size
    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    h += percdamp * torch.diagonal(h).mean() * torch.eye(n, dtype=h.dtype, device=h.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q_all = torch.zeros_like(w)
    codes = torch.zeros(a, n, dtype=torch.int32, device=w.device)
    for i1 in range(0, n, blocksize):
        i2 = min(i1 + blocksize, n)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            if affine and (i1 + i) % gsize == 0:  # the release's find_params on the block-updated matrix
                step, zero = affine_params(w[:, i1 + i:i1 + i + gsize], maxq, include_zero=True)
                steps.append(step), zeros.append(zero)
            if affine:
                q, code = affine_round(col.unsqueeze(1), step, zero, maxq)
            else:
                q, code = round_to_grid(col.unsqueeze(1), scale, levels)
            q = q.squeeze(1)
            q_all[:, i1 + i] = q
            codes[:, i1 + i] = code.squeeze(1).to(torch.int32)
            err = (col - q) / hinv1[i, i]
            if error_feedback:
                w1[:, i:] -= err.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        if error_feedback:
            w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    if perm is not None:
        inv = torch.argsort(perm)
        q_all, codes = q_all[:, inv], codes[:, inv]
    if affine:  # with act_order the groups run over the permuted columns (as the release without static_groups)
        return q_all, codes, torch.cat(steps, 1), torch.cat(zeros, 1)
    return q_all, codes


class GPTQ(Quantizer):
    """GPTQ; ``extra_bit=True`` makes it Huffman-GPTQ (2^{R+1}−1 levels, entropy-coded rate)."""

    name = "gptq"
    no_grid_reason = None  # reports its AffineGrid

    def __init__(self, percdamp: float = 0.01, blocksize: int = 128, extra_bit: bool = False,
                 error_feedback: bool = True, act_order: bool = False, accounting: str | None = None,
                 target_rate: bool = False, tol: float = 0.005, max_evals: int = 8, grid: str = "absmax_row",
                 group_size: int = 128):
        check_grid(grid, group_size)
        if grid == "minmax_group" and (extra_bit or target_rate):
            raise ValueError("gptq grid=minmax_group is the fixed 2^R-code grid: it takes no extra_bit / target_rate")
        self.grid, self.group_size = grid, group_size
        self.percdamp, self.blocksize = percdamp, blocksize
        self.extra_bit, self.error_feedback, self.act_order = extra_bit, error_feedback, act_order
        self.accounting = accounting or ("pooled" if extra_bit else "cardinality")
        if target_rate and self.accounting == "cardinality":
            raise ValueError("gptq target_rate=true needs an entropy-coded rate: use huffman_gptq (extra_bit=true)")
        self.target_rate, self.tol, self.max_evals = target_rate, tol, max_evals
        if extra_bit:
            self.name = "huffman_gptq"

    def quantize(self, weight: torch.Tensor, stats: LayerStats, rate: float, rate_control: bool = False) -> QuantResult:
        if self.target_rate:
            return self._rate_targeted(weight, stats, rate)
        levels = levels_for_rate(rate, extra_bit=self.extra_bit)
        if self.grid == "minmax_group":
            out = gptq_quantize(weight, stats.sigma, levels, self.percdamp, self.blocksize, self.error_feedback,
                                self.act_order, group_size=self.group_size)
            return affine_result(*out, levels, self.accounting)
        scale = gptq_scale(weight, stats.sigma, levels)
        w_hat, codes = gptq_quantize(weight, stats.sigma, levels, self.percdamp, self.blocksize,
                                     self.error_feedback, self.act_order, scale=scale)
        return QuantResult(w_hat, codes, grid_rate_report(codes, levels, self.accounting),
                           {"levels": levels, "nominal_bits": math.log2(levels), "grid": symmetric_grid(scale, levels)})

    def _rate_targeted(self, weight, stats, rate):
        absmax = weight.double().abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
        best = []

        def total_rate(r):
            h = max(2.0 ** r - 1, 0.5)
            levels = 2 * math.ceil(h) + 1
            w_hat, codes = gptq_quantize(weight, stats.sigma, levels, self.percdamp, self.blocksize,
                                         self.error_feedback, self.act_order, scale=absmax / h)
            res = QuantResult(w_hat, codes, grid_rate_report(codes, levels, self.accounting),
                              {"levels": levels, "half_width": h, "r": r, "grid": symmetric_grid(absmax / h, levels)})
            if not best or abs(res.rate.bits - rate) < abs(best[0].rate.bits - rate):
                best[:] = [res]
            return res.rate.bits

        _, _, evals = secant_search(total_rate, rate, self.tol, self.max_evals, start=rate - 0.5)
        best[0].info["secant"] = evals
        return best[0]


def HuffmanGPTQ(**kw) -> GPTQ:  # noqa: N802 - a named variant, used as a Hydra _target_
    """GPTQ with the spec's 2^{R+1}−1 levels and its rate reported as pooled code entropy + 16/n."""
    return GPTQ(extra_bit=True, **kw)
