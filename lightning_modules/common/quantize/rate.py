"""Rate accounting, in one place and identical for every quantizer.

Bits per quantized weight = code entropy + side information, over the a×n weights of one matrix
(embeddings and the LM head are never quantized and never counted).

- Code entropy, two ways (WaterSIC spec §4.2 step 5 and §4.7.3):
  * ``pooled``: the empirical entropy of all a·n integer codes in one histogram (one entropy-code table per
    matrix). This is what the authors' code reports, and the default here.
  * ``column``: the mean over columns of each column's own empirical entropy (one table per column). The
    0.255-bit guarantee assumes this; on a spread Σ it is ~0.25 bit below the pooled figure.
- Side information: 16 bits per fp16 scale. WaterSIC: one row scale t_i and one column scale (Γα)_j, i.e.
  16/a + 16/n; with dead columns (reinserted as zeros) the live columns pay their scale and each dead column
  is charged 16 bits as well: rate = (H·a·n_live + 16a + 16n_live + 16n_dead)/(a·n).
  GPTQ / RTN: one fp16 scale per row, 16/n (16·groups/n with groups).
- Log-cardinality (RTN, plain GPTQ): log2(#levels) + side information, the x-axis of methods without an
  entropy coder.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


def entropy_bits(codes: torch.Tensor) -> float:
    """Empirical (plug-in) entropy of a set of integer codes, in bits per code."""
    codes = codes.reshape(-1)
    if codes.numel() == 0:
        return 0.0
    _, counts = torch.unique(codes.to(torch.int64), return_counts=True)
    p = counts.double() / codes.numel()
    return float(-(p * torch.log2(p)).sum())


def column_entropy_bits(codes: torch.Tensor) -> float:
    """Mean over columns of the per-column empirical entropy (codes: a×n, columns = input features)."""
    a, n = codes.shape
    if n == 0:
        return 0.0
    codes = codes.to(torch.int64)
    # Per-column histograms in one pass: offset each column's codes into its own range.
    lo = codes.min()
    span = int(codes.max() - lo) + 1
    keys = (codes - lo) + torch.arange(n, device=codes.device).unsqueeze(0) * span
    counts = torch.bincount(keys.reshape(-1), minlength=n * span).reshape(n, span).double()
    p = counts / a
    ent = -(p * torch.log2(p.clamp_min(1e-300))).sum(1)
    return float(ent.mean())


@dataclass
class RateReport:
    """Rates of one quantized a×n matrix, bits per weight. ``bits`` is the figure a method is plotted at."""

    rows: int
    cols: int
    live_cols: int
    entropy_pooled: float          # bits per live code
    entropy_column: float          # bits per live code
    side_bits: float               # total side-information bits of the matrix
    levels: int | None = None      # alphabet size for fixed-grid methods (None: unbounded integers)
    accounting: str = "pooled"     # pooled | column | cardinality: which one ``bits`` is

    @property
    def n_weights(self) -> int:
        return self.rows * self.cols

    def _total(self, per_code: float) -> float:
        return (per_code * self.rows * self.live_cols + self.side_bits) / self.n_weights

    @property
    def bits_pooled(self) -> float:
        return self._total(self.entropy_pooled)

    @property
    def bits_column(self) -> float:
        return self._total(self.entropy_column)

    @property
    def bits_cardinality(self) -> float | None:
        return None if self.levels is None else self._total(math.log2(self.levels))

    @property
    def bits(self) -> float:
        return {"pooled": self.bits_pooled, "column": self.bits_column,
                "cardinality": self.bits_cardinality}[self.accounting]

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(bits=self.bits, bits_pooled=self.bits_pooled, bits_column=self.bits_column,
                 bits_cardinality=self.bits_cardinality)
        return d


def row_and_column_side_bits(rows: int, live_cols: int, dead_cols: int = 0) -> float:
    """fp16 row scales (a of them), fp16 column scales for live columns, 16 bits per dead column (WaterSIC)."""
    return 16.0 * (rows + live_cols + dead_cols)


def row_scale_side_bits(rows: int, groups: int = 1) -> float:
    """One fp16 scale per row and group (GPTQ, RTN): 16·groups/n bits per weight."""
    return 16.0 * rows * groups


def secant_search(entropy_at, target: float, tol: float = 0.005, max_evals: int = 6, clamp: float = 10.0,
                  start: float | None = None):
    """The WaterSIC spec's rate targeting (§4.2 step 7; rate-targeted Huffman-GPTQ uses it too): r0 = ``start``
    (default H*), r1 = r0 − (H(r0) − H*), then secant steps clamped to [−clamp, clamp], at most ``max_evals``
    evaluations, stopping when |H − H*| < tol.
    Returns (best r, its H, evaluations)."""
    r0 = target if start is None else start
    rs, hs = [r0], [entropy_at(r0)]
    if abs(hs[0] - target) >= tol and max_evals > 1:
        r1 = max(-clamp, min(clamp, r0 - (hs[0] - target)))
        rs.append(r1)
        hs.append(entropy_at(r1))
    while abs(hs[-1] - target) >= tol and len(rs) < max_evals:
        dh = hs[-1] - hs[-2]
        if dh == 0:
            break
        r = rs[-1] - (hs[-1] - target) * (rs[-1] - rs[-2]) / dh
        r = max(-clamp, min(clamp, r))
        rs.append(r)
        hs.append(entropy_at(r))
    best = min(range(len(rs)), key=lambda i: abs(hs[i] - target))
    return rs[best], hs[best], list(zip(rs, hs))
