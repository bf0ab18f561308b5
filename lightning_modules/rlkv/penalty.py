"""RLKV's reward-gated L1 on the gates (spec Method 3, the release's ``areal/mixed_attn/loss.py`` and
``FSDPEngine.train_batch``): its gate 1[r̄ > τ](e^{r̄} − 1) and the release's per-micro-batch weighting (AReaL's
first-fit-decreasing token packing). Plain torch, so ranks can be tested without the training stack.
"""
from __future__ import annotations

import math

import torch


def sparsity_penalty(gates: torch.Tensor, mean_reward: float, scale: float, tau: float) -> torch.Tensor:
    """λ · 1[r̄ > τ] · (e^{r̄} − 1) · mean|α|: off while the model is failing (r̄ ≤ τ)."""
    return scale * penalty_gate(mean_reward, tau) * gates.abs().mean()


def penalty_gate(mean_reward: float, tau: float) -> float:
    """1[r̄ > τ] · (e^{r̄} − 1)."""
    return (math.exp(mean_reward) - 1.0) if mean_reward > tau else 0.0


def ffd_micro_batches(lengths: list[int], capacity: int, min_groups: int = 1) -> list[list[int]]:
    """AReaL's micro-batch allocation (``datapack.ffd_allocate``): sequences longest first (ties by index), each into
    the open micro-batch with the fewest sequences among those it fits in (total <= ``capacity``), a new one when it
    fits in none or fewer than ``min_groups`` are open. A sequence longer than ``capacity`` gets its own (AReaL
    refuses it; its SGLang context length keeps it from happening there)."""
    groups: list[list[int]] = []
    totals: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        v = lengths[i]
        fits = [g for g in sorted(range(len(groups)), key=lambda g: (totals[g], g)) if totals[g] + v <= capacity]
        if len(groups) < min_groups or not fits:
            groups.append([i])
            totals.append(v)
            continue
        g = min(fits, key=lambda g: len(groups[g]))  # fewest sequences; ties: the smallest total (AReaL's order)
        groups[g].append(i)
        totals[g] += v
    return [sorted(g) for g in groups]


def microbatch_penalty_weight(raw: torch.Tensor, seq_lengths: torch.Tensor, response_lengths: torch.Tensor, tau: float,
                              capacity: int) -> float:
    """Σ_m (response tokens of m / response tokens of the step on all ranks) · world size · 1[r̄_m > τ](e^{r̄_m} − 1) over
    this rank's AReaL micro-batches m (the world-size factor undoes DDP's gradient averaging, as AReaL's
    ``loss_scale *= dp_size`` does under FSDP)."""
    from lightning_modules.common.rl import ranks

    lens = [int(x) for x in seq_lengths.tolist()]
    groups = ffd_micro_batches(lens, capacity)
    if ranks.distributed():  # every rank runs as many micro-batches as the busiest (allocate_balanced_mbs_synced)
        n = int(ranks.all_max(torch.tensor(len(groups), device=raw.device)))
        groups = groups if n == len(groups) else ffd_micro_batches(lens, capacity, n)
    total = float(ranks.all_sum(response_lengths.double().sum()))
    resp, r = response_lengths.double().cpu(), raw.double().cpu()
    return sum(float(resp[g].sum()) / max(total, 1.0) * penalty_gate(float(r[g].mean()), tau)
               for g in map(torch.tensor, groups)) * ranks.world_size()
