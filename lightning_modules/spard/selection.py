"""Subset selection by a determinantal point process: greedy MAP and the relevance-diversity kernel (RD-DPP).

Shared by every paper that picks a small, diverse, relevant subset of a pool (spard's safe data; instemb, esr and
real_vqa next). Everything works on plain tensors; embeddings come from ``lightning_modules.common.embedding``.

- :func:`greedy_dpp` ``(L, k, eps) -> (indices, logdet)``: greedy MAP of log det(L_S) with an incremental
  Cholesky factor. First pick argmax_i L_ii; each later pick maximises the gain L_xx − ‖C⁻¹ L[x, S]ᵀ‖² (the
  Schur complement, clamped below at ``eps``); log det(L_S) is the sum of the log gains.
- :func:`relevance` ``(pool, ref, beta) -> r``: r_i = (max_j cos(e_i, f_j))^β, an integer β keeping the sign of a
  negative maximum (odd powers), as released.
- :func:`rd_dpp_kernel` ``(pool, ref, beta, eps) -> L``: L = diag(r)·C·diag(r) + eps·I with C the pool's cosine
  similarities: quality r_i × cosine diversity.
- :func:`greedy_dpp_factor` ``(B, k, eps)`` / :func:`rd_dpp_factor` ``(pool, ref, beta) -> B``: the same greedy on
  L = B·Bᵀ + eps·I without the (n, n) kernel (what :func:`select` runs: large pools fit in memory).
- :func:`budget` ``(n_ref, ratio, n_pool) -> k``: floor(ratio · n_ref), capped at the pool.
- :func:`select` ``(pool, ref, k, selector, beta, eps, seed) -> indices``: ``rd_dpp`` or ``random`` (k uniform
  draws with ``random.Random(seed)``, as released).
- :func:`mean_pairwise_cosine` ``(emb) -> float``: redundancy of a chosen set (off-diagonal mean).
"""
from __future__ import annotations

import math
import random

import torch

SELECTORS = ("rd_dpp", "random")


def greedy_dpp(L: torch.Tensor, k: int, eps: float = 1e-6) -> tuple[list[int], float]:
    """Greedy MAP of a DPP with L-ensemble ``L`` (n, n, symmetric PSD): ``k`` indices in selection order and the
    log det of L restricted to them (Σ log gains). Ties go to the lowest index (``argmax``)."""
    if L.ndim != 2 or L.shape[0] != L.shape[1]:
        raise ValueError(f"greedy_dpp needs a square kernel, got shape {tuple(L.shape)}")
    L = L.double()
    return _greedy(L.diagonal(), lambda j: L[:, j], k, eps)


def greedy_dpp_factor(B: torch.Tensor, k: int, eps: float = 1e-6) -> tuple[list[int], float]:
    """:func:`greedy_dpp` on L = B·Bᵀ + eps·I without forming the (n, n) kernel: O(n·(d + k)) memory, for large
    pools (the RD-DPP kernel is this with B = diag(r)·unit(pool), :func:`rd_dpp_factor`)."""
    B = B.double()

    def column(j: int) -> torch.Tensor:
        col = B @ B[j]
        col[j] += eps
        return col

    return _greedy((B * B).sum(-1) + eps, column, k, eps)


def _greedy(diag: torch.Tensor, column, k: int, eps: float) -> tuple[list[int], float]:
    n = diag.shape[0]
    if not 0 <= k <= n:
        raise ValueError(f"greedy_dpp: k={k} must be in [0, {n}] (the pool size)")
    # rows of C⁻¹ L[:, S]ᵀ for every item, grown one column per pick: w_x = C⁻¹ L[x, S]ᵀ
    W = torch.zeros(n, k, dtype=diag.dtype, device=diag.device)
    chosen: list[int] = []
    taken = torch.zeros(n, dtype=torch.bool, device=diag.device)
    logdet = 0.0
    gains = diag.clone()
    for step in range(k):
        scores = gains.clamp_min(eps).masked_fill(taken, -math.inf)
        j = int(torch.argmax(scores))
        g = float(scores[j])
        chosen.append(j)
        taken[j] = True
        logdet += math.log(g)
        if step + 1 == k:
            break
        # new Cholesky row of the pick is [w_jᵀ, sqrt(g)]; for every x: w_x gets (L_xj − w_x·w_j) / sqrt(g)
        W[:, step] = (column(j) - W[:, :step] @ W[j, :step]) / math.sqrt(g)
        gains = diag - (W[:, :step + 1] ** 2).sum(-1)
    return chosen, logdet


def _unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x.double(), dim=-1)


def relevance(pool: torch.Tensor, ref: torch.Tensor, beta: float = 4) -> torch.Tensor:
    """r_i = (max_j cos(pool_i, ref_j))^β; an integer β is an integer power (a negative max keeps its sign for odd
    β), a fractional one needs a non-negative max."""
    u, v = _unit(pool), _unit(ref)
    # the max over reference chunks: never the full (n, m) cosine matrix
    m = torch.stack([(u @ c.T).max(dim=1).values for c in v.split(4096)]).max(dim=0).values
    if float(beta).is_integer():
        return m ** int(beta)
    if (m < 0).any():
        raise ValueError(f"dpp.beta={beta} is fractional but some max cosine is negative: use an integer beta")
    return m ** beta


def rd_dpp_kernel(pool: torch.Tensor, ref: torch.Tensor, beta: float = 4, eps: float = 1e-6) -> torch.Tensor:
    """The RD-DPP L-ensemble of pool embeddings (n, d) against reference embeddings (m, d):
    diag(r)·C·diag(r) + eps·I, C_ij = cos(pool_i, pool_j), r = :func:`relevance`."""
    r = relevance(pool, ref, beta)
    u = _unit(pool)
    C = u @ u.T
    return r[:, None] * C * r[None, :] + eps * torch.eye(len(r), dtype=C.dtype, device=C.device)


def rd_dpp_factor(pool: torch.Tensor, ref: torch.Tensor, beta: float = 4) -> torch.Tensor:
    """B with :func:`rd_dpp_kernel` = B·Bᵀ + eps·I: the pool's unit vectors scaled by their relevance."""
    return relevance(pool, ref, beta)[:, None] * _unit(pool)


def budget(n_ref: int, ratio: float, n_pool: int) -> int:
    """k = floor(ratio · |R|), capped at |P|."""
    if not 0 < ratio <= 1:
        raise ValueError(f"dpp.ratio={ratio} must be in (0, 1]")
    return min(int(math.floor(ratio * n_ref)), n_pool)


def select(pool: torch.Tensor, ref: torch.Tensor, k: int, selector: str = "rd_dpp", beta: float = 4,
           eps: float = 1e-6, seed: int = 42) -> list[int]:
    """``k`` pool indices: greedy RD-DPP MAP (selection order), or ``random`` (``random.Random(seed).sample``)."""
    if selector not in SELECTORS:
        raise ValueError(f"dpp.selector={selector!r}: choose one of {', '.join(SELECTORS)}")
    if selector == "random":
        return random.Random(seed).sample(range(len(pool)), k)
    return greedy_dpp_factor(rd_dpp_factor(pool, ref, beta), k, eps)[0]


def mean_pairwise_cosine(emb: torch.Tensor) -> float:
    """Mean cosine over distinct pairs of rows (0 for fewer than two rows)."""
    n = len(emb)
    if n < 2:
        return 0.0
    u = _unit(emb)
    C = u @ u.T
    return float((C.sum() - C.diagonal().sum()) / (n * (n - 1)))
