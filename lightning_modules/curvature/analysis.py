"""Contextual curvature, token entropy and the correlation statistics (pure tensor functions).

Curvature as in Hosseini & Fedorenko (2023) and the first author's code: v_k = h_{k+1} - h_k, θ_k = arccos(cos(v_k,
v_{k+1})) with the cosine clipped to [-1, 1]. The angle θ at token t is the one of (h_{t-2}, h_{t-1}, h_t).
Contextual curvature κ_t(w) is the mean of the angles whose three points lie in {t-w+1..t}: the w-2 angles at
t-w+3..t ([INF]: the sources name no window; w = 3 is the single angle at t). Tokens t < w-1 have no full window
and get NaN.
"""
from __future__ import annotations

import math

import torch


def _unit_cos(a: torch.Tensor, b: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    num = (a * b).sum(-1)
    if eps:
        return num / ((a.pow(2).sum(-1) + eps).sqrt() * (b.pow(2).sum(-1) + eps).sqrt())
    return num / (a.norm(dim=-1) * b.norm(dim=-1))


def pairwise_angles(h: torch.Tensor) -> torch.Tensor:
    """Angles between successive steps of a trajectory h (..., T, D): (..., T-2), entry j at (h_j, h_{j+1}, h_{j+2}).

    The precursor's measure: exact arccos, cosine clipped to [-1, 1] (a zero step gives NaN, as the cosine does)."""
    v = h[..., 1:, :] - h[..., :-1, :]
    return torch.arccos(_unit_cos(v[..., :-1, :], v[..., 1:, :]).clamp(-1.0, 1.0))


def step_cosines(h: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """cos(v_j, v_{j+1}) of successive steps of h (..., T, D): (..., T-2), aligned as ``pairwise_angles``; ``eps``
    in the norms. 1 - cos is the precursor trainer's straightness penalty."""
    v = h[..., 1:, :] - h[..., :-1, :]
    return _unit_cos(v[..., :-1, :], v[..., 1:, :], eps)


def soft_angles(h: torch.Tensor, eps: float = 1e-8, margin: float = 1e-6) -> torch.Tensor:
    """The differentiable angle of the regulariser: eps in the norms and the cosine kept inside ±(1 - margin), so
    the gradient stays finite at (near-)collinear points, where d arccos(c)/dc = -1/sqrt(1 - c²) diverges."""
    return torch.arccos(step_cosines(h, eps).clamp(-1.0 + margin, 1.0 - margin))


def second_diff(h: torch.Tensor) -> torch.Tensor:
    """The precursor's alternative penalty ‖h_{t+1} - 2h_t + h_{t-1}‖ (..., T-2), aligned as ``pairwise_angles``;
    not scale-invariant."""
    return (h[..., 2:, :] - 2 * h[..., 1:-1, :] + h[..., :-2, :]).norm(dim=-1)


def window_mean(angles: torch.Tensor, window: int) -> torch.Tensor:
    """κ_t(w) from per-triple values (..., T-2) -> (..., T): the mean of the w-2 values ending at t; NaN before t = w-1."""
    if window < 3:
        raise ValueError(f"window={window}: contextual curvature needs at least 3 points (window >= 3)")
    k = window - 2
    T = angles.shape[-1] + 2
    out = angles.new_full((*angles.shape[:-1], T), math.nan)
    if angles.shape[-1] >= k:
        c = torch.nn.functional.pad(angles.cumsum(-1), (1, 0))
        out[..., window - 1:] = (c[..., k:] - c[..., :-k]) / k
    return out


def contextual_curvature(h: torch.Tensor, window: int = 3) -> torch.Tensor:
    """κ_t(w) for a trajectory h (..., T, D): (..., T), NaN where t < w-1."""
    return window_mean(pairwise_angles(h), window)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H_t = -Σ_v p(v|x≤t) log p(v|x≤t) in nats, computed in float32 or wider."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


# --- statistics -------------------------------------------------------------------------------------------------
def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    den = (x.norm() * y.norm()).item()
    return float((x @ y).item() / den) if den > 0 else math.nan


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share their mean rank), as Spearman's rho needs."""
    x = x.double()
    sorted_x, order = torch.sort(x)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(len(x), dtype=x.dtype)
    _, inverse, counts = torch.unique_consecutive(sorted_x, return_inverse=True, return_counts=True)
    start = torch.cumsum(counts, 0) - counts
    mean_rank = (start + (counts - 1) / 2).to(x.dtype)
    ranks[order] = mean_rank[inverse]
    return ranks


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    return pearson(_ranks(x), _ranks(y))


def residualize(y: torch.Tensor, controls: torch.Tensor) -> torch.Tensor:
    """y minus its least-squares fit on [1, controls] (controls (N, C))."""
    X = torch.cat([torch.ones(len(y), 1, dtype=torch.float64), controls.double().reshape(len(y), -1)], 1)
    beta = torch.linalg.lstsq(X, y.double()[:, None]).solution
    return y.double() - (X @ beta)[:, 0]


def partial_corr(x: torch.Tensor, y: torch.Tensor, controls: torch.Tensor) -> float:
    """Pearson r of x and y after regressing both on the controls (with an intercept)."""
    return pearson(residualize(x, controls), residualize(y, controls))


def paired_ci(d: torch.Tensor, z: float = 1.959964) -> tuple[float, float, float]:
    """Mean of paired differences and its normal 95% interval."""
    d = d.double()
    m = d.mean().item()
    half = z * (d.std(unbiased=True).item() / math.sqrt(len(d))) if len(d) > 1 else math.nan
    return m, m - half, m + half
