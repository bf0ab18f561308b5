"""Per-latent boost threshold by stochastic probabilistic bisection (Waeber, Frazier & Henderson), as released.

A density over a grid of ``grid`` boosts in [lo, hi] starts as a Gaussian (prior_mu, prior_sd). Each trial queries
the density's median m, steers with boost m and judges one response: s = its first attempt's score / 100. The
sign confidence p = P(score at m > target) = 1 − BetaCDF(target; 0.5 + 5s, 0.5 + 5(1 − s)); a score above the
target says the threshold lies above m. The density is multiplied by p above m and by 1 − p below it; the queried
grid point itself by √(p(1 − p)) (``query_weight: geometric``, the release's ``update_density``: then this finder
is the release's, trial for trial) or by 1 − p with the points below (``below``, our first reading: the queried
boost counted as "not above"). After ``trials`` trials the estimate is the median. Everything is vectorised over
latents (one column each).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from scipy.stats import beta as beta_dist

QUERY_WEIGHTS = ("geometric", "below")


def sign_confidence(s, target: float) -> np.ndarray:
    s = np.clip(np.asarray(s, dtype=float), 0.0, 1.0)
    return beta_dist.sf(target, 0.5 + 5 * s, 0.5 + 5 * (1 - s))


def bisect(score: Callable[[np.ndarray], np.ndarray], n: int = 1, lo: float = 0.0, hi: float = 5.0,
           grid: int = 10_000, prior_mu: float = 1.0, prior_sd: float = 0.34, trials: int = 20,
           target: float = 0.3, query_weight: str = "geometric") -> np.ndarray:
    """Threshold estimates for ``n`` latents; ``score(boosts (n,)) -> normalised scores (n,)`` runs one trial each."""
    if not lo < hi:
        raise ValueError(f"threshold.lo={lo} must be below threshold.hi={hi}")
    if trials < 1 or grid < 2:
        raise ValueError("threshold.trials must be >= 1 and threshold.grid >= 2")
    if query_weight not in QUERY_WEIGHTS:
        raise ValueError(f"threshold.query_weight={query_weight!r}: choose one of {', '.join(QUERY_WEIGHTS)}")
    x = np.linspace(lo, hi, grid)
    dens = np.tile(np.exp(-0.5 * ((x - prior_mu) / prior_sd) ** 2)[None, :], (n, 1))
    dens /= dens.sum(1, keepdims=True)
    for _ in range(trials):
        m = _median(x, dens)
        p = sign_confidence(score(m), target)
        above = x[None, :] > m[:, None]
        weight = np.where(above, p[:, None], 1 - p[:, None])
        if query_weight == "geometric":
            weight = np.where(x[None, :] == m[:, None], np.sqrt(p * (1 - p))[:, None], weight)
        dens *= weight
        dens = np.maximum(dens, 1e-300)
        dens /= dens.sum(1, keepdims=True)
    return _median(x, dens)


def _median(x: np.ndarray, dens: np.ndarray) -> np.ndarray:
    return x[np.argmax(np.cumsum(dens, axis=1) >= 0.5, axis=1)]
