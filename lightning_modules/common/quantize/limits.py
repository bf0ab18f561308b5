"""The information-theoretic limit: Gaussian rate-distortion of a linear layer, by reverse waterfilling.

Derivation. Model each row w ∈ Rⁿ of W as an independent Gaussian vector N(0, S_w) (S_w = E[wᵀw]: I for iid
N(0,1) weights; for real layers ``weight_covariance``, by default diag of the column powers), and the distortion as the output error
D = E‖(w − ŵ)x‖² / n = tr((w − ŵ) Σ (w − ŵ)ᵀ)/n, Σ = E[xxᵀ]. With v = w Σ^{1/2}, the distortion is the plain
squared error of v, whose covariance Σ^{1/2} S_w Σ^{1/2} has eigenvalues λ_1..λ_n (the eigenvalues of S_w Σ).
In the eigenbasis the components are independent Gaussians, and the rate-distortion function of independent
Gaussians under a sum-of-squares distortion is the reverse-waterfilling solution (Cover & Thomas, Thm 10.3.3):

    D_k(θ) = min(θ, λ_k),  D(θ) = (1/n) Σ_k D_k(θ),  R(θ) = (1/n) Σ_k ½·log₂(λ_k / D_k(θ))   bits per weight,

for a water level θ > 0. Given D we solve D(θ) = D for θ (D(θ) is continuous and increasing) and read R.
At Σ = I and S_w = σ²I every λ_k = σ² and R(D) = ½·log₂(σ²/D) for D < σ² (0 beyond), the closed form the
tests check. An entropy-coded scalar quantizer with error feedback pays ½·log₂(πe/6) ≈ 0.2546 bit over this
at high rate (the space-filling loss of the integer lattice), WaterSIC's headline gap.
"""
from __future__ import annotations

import math

import torch

SPACE_FILLING_GAP = 0.5 * math.log2(math.pi * math.e / 6)  # 0.2546 bit


def whitened_eigenvalues(sigma: torch.Tensor, weight_cov: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Eigenvalues of Σ^{1/2} S_w Σ^{1/2} (float64). ``weight_cov`` is S_w (n×n) or a scalar σ² (S_w = σ²I)."""
    sigma = sigma.double()
    if not torch.is_tensor(weight_cov) or weight_cov.ndim == 0:
        lam = torch.linalg.eigvalsh(sigma) * float(weight_cov)
    elif torch.count_nonzero(weight_cov - torch.diag(torch.diagonal(weight_cov))) == 0:
        d = torch.diagonal(weight_cov).double().clamp_min(0).sqrt()  # same spectrum as S^{1/2} Σ S^{1/2}
        lam = torch.linalg.eigvalsh(d.unsqueeze(1) * sigma * d.unsqueeze(0))
    else:
        evals, evecs = torch.linalg.eigh(sigma)
        root = (evecs * evals.clamp_min(0).sqrt()) @ evecs.T
        lam = torch.linalg.eigvalsh(root @ weight_cov.double() @ root)
    return lam.clamp_min(0)


def _rd_at(lam: torch.Tensor, theta: float) -> tuple[float, float]:
    d = torch.minimum(lam, torch.full_like(lam, theta))
    pos = lam > 0
    rate = 0.5 * torch.log2(lam[pos] / d[pos]).sum() / lam.numel()
    return float(rate), float(d.mean())


def water_level(lam: torch.Tensor, distortion: float) -> float:
    """The reverse-waterfilling level θ with D(θ) = ``distortion`` (directions with λ_k < θ get zero rate)."""
    lam = lam.double()
    lo, hi = 0.0, float(lam.max())
    for _ in range(80):  # bisection on the water level; D(θ) is increasing in θ
        mid = 0.5 * (lo + hi)
        if _rd_at(lam, mid)[1] < distortion:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def rate_distortion(lam: torch.Tensor, distortion: float) -> float:
    """R(D) in bits per weight for whitened eigenvalues ``lam`` at per-weight distortion ``distortion``."""
    lam = lam.double()
    if distortion >= float(lam.mean()):
        return 0.0
    if distortion <= 0:
        return math.inf
    return _rd_at(lam, water_level(lam, distortion))[0]


def distortion_rate(lam: torch.Tensor, rate: float) -> float:
    """D(R): the smallest per-weight distortion reachable at ``rate`` bits per weight."""
    lam = lam.double()
    lo, hi = 0.0, float(lam.max())
    for _ in range(80):  # R(θ) is decreasing in θ
        mid = 0.5 * (lo + hi)
        if _rd_at(lam, mid)[0] > rate:
            lo = mid
        else:
            hi = mid
    return _rd_at(lam, 0.5 * (lo + hi))[1]


def weight_covariance(weight: torch.Tensor, model: str = "diag") -> torch.Tensor | float:
    """S_w for a layer's rows: ``diag`` = diag(s_j), s_j = mean_i W_ij² (independent columns with their own powers,
    the model behind WaterSIC's step sizes; the default), ``iid`` = mean power · I, ``sample`` = WᵀW/a (rank ≤ a, so
    for a < n it puts zero variance on n − a directions and understates the limit)."""
    w = weight.double()
    if model == "diag":
        return torch.diag((w ** 2).mean(0))
    if model == "iid":
        return float((w ** 2).mean())
    if model == "sample":
        return w.T @ w / w.shape[0]
    raise ValueError(f"weight model {model!r}: use diag, iid or sample")


def layer_limit(weight: torch.Tensor, sigma: torch.Tensor, distortion: float, weight_model: str = "diag") -> float:
    """R(D) for one layer at its achieved per-weight output distortion, with S_w from ``weight_covariance``."""
    return rate_distortion(whitened_eigenvalues(sigma, weight_covariance(weight, weight_model)), distortion)
