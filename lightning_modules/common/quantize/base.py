"""The one interface every weight quantizer implements, and the layer statistics it sees.

A quantizer turns one a×n weight (rows = out-features, columns = in-features) and its calibration
statistics into a reconstruction Ŵ, the integer codes and a ``RateReport``. The driver
(``driver.py``) decides which layers, in what order, from which activations, and at what target rate.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_modules.common.quantize.rate import RateReport


@dataclass
class LayerStats:
    """Second moments of one layer's inputs (float64, n×n).

    Plain mode: only ``sigma`` = Σ = E[xxᵀ] (x from the full-precision model).
    Sequential (Qronos) mode: ``sigma`` = Σ_X̂ (inputs from the already-quantized model), ``cross`` = Σ_{XX̂} =
    E[x x̂ᵀ] and ``sigma_x`` = Σ_X (full-precision inputs), so the objective is E‖Wx − Ŵx̂‖².
    ``residual_cross`` (a×n, WaterSIC's residual compensation) = Σ_{ΔR,X̂} = E[(R − R̂) x̂ᵀ]: the objective becomes
    E‖Wx + R − Ŵx̂ − R̂‖² (quantizers that ignore it, the baselines, minimise the layer's own error).
    """

    sigma: torch.Tensor
    cross: torch.Tensor | None = None
    sigma_x: torch.Tensor | None = None
    tokens: int = 0
    residual_cross: torch.Tensor | None = None

    @property
    def sequential(self) -> bool:
        return self.cross is not None

    def output_error(self, weight: torch.Tensor, weight_hat: torch.Tensor) -> float:
        """E‖Wx − Ŵx̂‖² / (a·n); in plain mode tr((W−Ŵ)Σ(W−Ŵ)ᵀ)/(a·n)."""
        w, wh = weight.double(), weight_hat.double()
        a, n = w.shape
        if not self.sequential:
            d = w - wh
            return float(((d @ self.sigma) * d).sum() / (a * n))
        sx = self.sigma_x if self.sigma_x is not None else self.sigma
        val = ((w @ sx) * w).sum() - 2 * ((w @ self.cross) * wh).sum() + ((wh @ self.sigma) * wh).sum()
        return float(val / (a * n))

    def signal_power(self, weight: torch.Tensor) -> float:
        """E‖Wx‖² / (a·n), for relative errors."""
        w = weight.double()
        sx = self.sigma_x if self.sigma_x is not None else self.sigma
        return float(((w @ sx) * w).sum() / w.numel())


@dataclass
class QuantResult:
    weight: torch.Tensor          # Ŵ, float64, a×n
    codes: torch.Tensor           # integer codes, a×n (zeros in dead columns)
    rate: RateReport
    info: dict = field(default_factory=dict)  # "grid": an AffineGrid, when Ŵ lies on one (export.py packs it)


@dataclass
class AffineGrid:
    """The uniform grid Ŵ lies on: Ŵ[i, j] = (c[i, j] − zero[i, j // G]) · scale[i, j // G] with integer codes
    c ∈ {0, …, levels − 1}, G = n / scale.shape[1] (one column of scales: one group per row). A quantizer that
    reports it in ``QuantResult.info["grid"]`` can be exported in the packed 4-bit format when levels ≤ 16
    (``export.py``). With an ``info["input_scale"]`` s (AWQ) it is the grid of Ŵ·diag(s)."""

    scale: torch.Tensor           # a × groups
    zero: torch.Tensor            # a × groups (a float: half-integer for a mid-rise grid)
    levels: int


class Quantizer:
    """Base class: ``quantize(weight, stats, rate, rate_control=False) -> QuantResult``.

    ``fractional_rate``: True when the method can target any real rate (WaterSIC); False for fixed grids
    whose nominal rate is rounded to a level count (RTN, GPTQ), for which global rate control is a no-op.
    ``rate_control``: the driver passes True when ``rate`` is this layer's share of one global budget (its actual
    rate is charged back), so a method need not spend bits it saves here (e.g. on dead columns) within the layer.
    Each method is a class chosen by ``_target_`` in ``conf/model/quantizer/``; ``name`` labels its results.
    """

    name = "base"
    fractional_rate = False
    # None when the method reports an ``AffineGrid`` (its result can be packed, export.py); else why not, for the
    # one-line error of ``model.export_packed``
    no_grid_reason: str | None = "it reports no affine grid (QuantResult.info['grid'])"

    def quantize(self, weight: torch.Tensor, stats: LayerStats, rate: float,
                 rate_control: bool = False) -> QuantResult:  # pragma: no cover
        raise NotImplementedError


def dead_columns(sigma: torch.Tensor, rel: float = 1e-3) -> torch.Tensor:
    """Input features that carry (almost) no energy: Σ_jj ≤ 0 or Σ_jj < rel·median(diag Σ) (spec §4.2 step 8)."""
    d = torch.diagonal(sigma)
    return (d <= 0) | (d < rel * d.median())
