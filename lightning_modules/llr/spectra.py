"""Empirical spectral densities of the weights and their heavy-tail exponent α (spec 2.1)."""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Mapping

import torch
from torch import nn

EDGE_ALPHA = ("kept", "all")


def esd(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Eigenvalues of WᵀW (squared singular values, ascending), computed where the weight lives."""
    if weight.ndim != 2:
        raise ValueError(f"esd needs a 2-D weight, got shape {tuple(weight.shape)}")
    return torch.linalg.svdvals(weight.detach().to(dtype)).square().sort().values


def hill_alpha(eigs) -> float:
    """Median-xmin Hill estimate: α̂ = 1 + n / Σ_{k≥i} ln(λ_k/λ_i), i = ⌊N/2⌋, n = N − i (λ ascending).

    Returns nan when the tail is degenerate (xmin = 0, or all tail eigenvalues equal)."""
    lam = torch.as_tensor(eigs).detach().to(torch.float64).flatten().sort().values
    if lam.numel() < 2:
        raise ValueError(f"hill_alpha needs at least 2 eigenvalues, got {lam.numel()}")
    i = lam.numel() // 2
    tail = lam[i:]
    denom = float(torch.log(tail / lam[i]).sum())
    if not math.isfinite(denom) or denom <= 0:
        return float("nan")
    return 1.0 + tail.numel() / denom


def is_edge(name: str, module: nn.Module | None = None) -> bool:
    """Embedding or LM head: the released code matches 'embed' / 'head' in the module's name."""
    leaf = name.rsplit(".", 1)[-1]
    return "embed" in leaf or "head" in leaf or isinstance(module, nn.Embedding)


@contextmanager
def full_weight(weight: torch.Tensor):
    """The whole matrix of a (possibly sharded) weight: DeepSpeed ZeRO-3 gathers it, FSDP2 DTensors are
    gathered with ``full_tensor()``; both are collectives, so every rank must enter."""
    if hasattr(weight, "ds_id"):  # DeepSpeed ZeRO-3 partitioned parameter
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            yield weight.data
        return
    if hasattr(weight, "full_tensor"):  # torch.distributed DTensor (FSDP2)
        yield weight.full_tensor()
        return
    yield weight


@contextmanager
def cpu_threads(n: int | None):
    """Run the CPU SVDs on ``n`` threads: LAPACK's SVD gains little from threads at these sizes, and on a
    busy machine its OpenMP spin-waits make a 2-thread SVD 100-400x slower than a 1-thread one."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def module_alphas(weights: Mapping[str, tuple[torch.Tensor, bool]], min_eigs: int = 50,
                  esd_dtype: torch.dtype = torch.float32, svd_threads: int | None = 1,
                  edge_alpha: str = "kept") -> dict[str, float]:
    """α per module from ``{name: (weight, is_edge)}``. Modules with fewer than ``min_eigs`` eigenvalues are
    dropped (nan: they join the untuned group). Edges (embedding, head) get the largest α of the others:

    - ``edge_alpha="kept"`` (ours, default): the largest over the layers that are kept, so a dropped layer has no
      say in anyone's rate.
    - ``edge_alpha="all"`` (the release's order): the largest over all layers *before* the small ones are dropped,
      so a dropped layer can set the maximum and squeeze every kept layer's rate (see tests/test_llr.py's toy).

    Edge spectra are not needed, so not computed. ``svd_threads`` caps the CPU threads during the SVDs."""
    if edge_alpha not in EDGE_ALPHA:
        raise ValueError(f"edge_alpha={edge_alpha!r}: choose kept (ours) or all (the release's order)")
    alphas: dict[str, float] = {}
    small: set[str] = set()
    for name, (weight, edge) in weights.items():
        if edge:
            continue
        with full_weight(weight) as w:
            if min(w.shape) < min_eigs:
                small.add(name)
                if edge_alpha == "kept" or min(w.shape) < 2:
                    alphas[name] = float("nan")
                    continue
            with cpu_threads(svd_threads if w.device.type == "cpu" else None):
                alphas[name] = hill_alpha(esd(w, esd_dtype))
    finite = [a for a in alphas.values() if math.isfinite(a)]
    top = max(finite) if finite else float("nan")
    for name, (_, edge) in weights.items():
        if edge:
            alphas[name] = top
        elif name in small:
            alphas[name] = float("nan")
    return {name: alphas[name] for name in weights}
