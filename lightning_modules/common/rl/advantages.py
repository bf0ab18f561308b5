"""Critic-free advantage estimators over groups of G rollouts per prompt.

Rewards are laid out group-major: rows ``g*G .. g*G+G-1`` are the G samples of prompt ``g``.

- ``grpo``: (R - mean_G R) / (std_G R + eps) (DeepSeekMath's GRPO; std is the unbiased sample std as in TRL).
- ``dr_grpo``: R - mean_G R (Dr. GRPO drops the std scaling; verl's ``norm_adv_by_std_in_grpo=False``).
- ``rloo``: R - mean of the other G-1 samples (REINFORCE leave-one-out; equals G/(G-1) (R - mean_G R)).
"""
from __future__ import annotations

import torch


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of G={group_size}")
    return rewards.float().view(-1, group_size)


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-4) -> torch.Tensor:
    r = _groups(rewards, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        adv = adv / (std + eps)
    return adv.reshape(-1)


def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    return grpo_advantages(rewards, group_size, scale_by_std=False)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 2:
        raise ValueError("RLOO needs G >= 2 samples per prompt (set model.group_size)")
    r = _groups(rewards, group_size)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - others).reshape(-1)


ADVANTAGES = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}


def batch_normalize(adv: torch.Tensor, weights: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """(A - mean) / (std + eps) over the whole batch, each row weighted by ``weights`` (its response tokens: the
    token-level normalisation AReaL applies after the group one; population std)."""
    w = torch.ones_like(adv, dtype=torch.float32) if weights is None else weights.float()
    w = w / w.sum().clamp_min(1e-12)
    mean = (w * adv).sum()
    std = (w * (adv - mean) ** 2).sum().sqrt()
    return (adv - mean) / (std + eps)


def compute_advantages(name: str, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if name not in ADVANTAGES:
        raise ValueError(f"model.advantage={name!r}: choose one of {', '.join(ADVANTAGES)}")
    return ADVANTAGES[name](rewards, group_size)
