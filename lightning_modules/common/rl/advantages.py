"""Critic-free advantage estimators over groups of G rollouts per prompt.

Rewards are laid out group-major: rows ``g*G .. g*G+G-1`` are the G samples of prompt ``g``.

- ``grpo``: (R - mean_G R) / (std_G R + eps) (DeepSeekMath's GRPO; std is the unbiased sample std as in TRL).
- ``dr_grpo``: R - mean_G R (Dr. GRPO drops the std scaling; verl's ``norm_adv_by_std_in_grpo=False``).
- ``rloo``: R - mean of the other G-1 samples (REINFORCE leave-one-out; equals G/(G-1) (R - mean_G R)).
- ``reward``: the reward itself, no group baseline (AReaL with ``reward_norm: null``, RLKV's recipe); with the core's
  ``advantage_batch_norm`` it is normalised over the whole batch only (:func:`batch_normalize`).
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


def reward_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    return _groups(rewards, group_size).reshape(-1)


ADVANTAGES = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages,
              "reward": reward_advantages}


def batch_normalize(adv: torch.Tensor, weights: torch.Tensor | None = None, eps: float = 1e-5,
                    unbiased: bool = True) -> torch.Tensor:
    """(A - mean) / (std + eps) over the whole batch of every rank (AReaL's ``adv_norm`` at batch level, whose
    moments are all-reduced), each row counted ``weights`` times (its response tokens: AReaL normalises per token).
    ``unbiased``: the variance divides by the token count - 1 (AReaL's ``std_unbiased``, its default since v0.3.4)."""
    from lightning_modules.common.rl.ranks import all_sum

    w = torch.ones_like(adv, dtype=torch.float64) if weights is None else weights.double()
    a = adv.double()
    n, total = all_sum(torch.stack([w.sum(), (w * a).sum()]))
    mean = total / n.clamp_min(1e-12)
    sq = all_sum((w * (a - mean) ** 2).sum())
    std = (sq / (n - 1 if unbiased else n).clamp_min(1e-12)).sqrt()
    return ((a - mean) / (std + eps)).to(adv.dtype)


def compute_advantages(name: str, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if name not in ADVANTAGES:
        raise ValueError(f"model.advantage={name!r}: choose one of {', '.join(ADVANTAGES)}")
    return ADVANTAGES[name](rewards, group_size)


SCALE_REWARDS = ("group", "none")


def scale_rewards(adv: torch.Tensor, rewards: torch.Tensor, group_size: int, mode: str = "group",
                  eps: float = 1e-4) -> torch.Tensor:
    """Advantages (N,) or (N, T) divided by their group's reward std + ``eps`` (``group``, TRL's default
    ``scale_rewards``; unbiased std as :func:`grpo_advantages`) or left as they are (``none``)."""
    if mode not in SCALE_REWARDS:
        raise ValueError(f"model.scale_rewards={mode!r}: choose one of {', '.join(SCALE_REWARDS)}")
    if mode == "none":
        return adv
    r = _groups(rewards, group_size)
    std = (r.std(dim=1) if group_size > 1 else torch.zeros(len(r), dtype=r.dtype, device=r.device)).repeat_interleave(group_size)
    return adv / (std.view(-1, *[1] * (adv.ndim - 1)).to(adv.device) + eps)


def segment_gae(values, boundaries, T: int, lam: float = 1.0) -> torch.Tensor:
    """Token advantages (T,) from a chain of state values (γ = 1).

    ``values`` = [V_0, …, V_m] (V_m is the return R) and ``boundaries`` = [p_0, …, p_m] token positions (p_0 the
    response start, p_m its end): segment i = tokens [p_{i-1}, p_i) gets A_i = Σ_{l≥0} λ^l δ_{i+l} with
    δ_i = V_i − V_{i−1}. So λ = 1 gives R − V_{i−1} (the value at the segment's start), λ = 0 gives δ_i. Tokens
    before p_0 or from p_m on (padding) get 0; an empty segment passes its δ on through the λ-sum only."""
    v = torch.as_tensor(values, dtype=torch.float32)
    b = torch.as_tensor(boundaries, dtype=torch.long)
    if v.ndim != 1 or b.shape != v.shape or len(v) < 2:
        raise ValueError(f"segment_gae needs m+1 >= 2 values and as many boundaries, got {tuple(v.shape)}, {tuple(b.shape)}")
    delta = v[1:] - v[:-1]
    adv = torch.zeros_like(delta)
    acc = 0.0
    for i in range(len(delta) - 1, -1, -1):
        acc = float(delta[i]) + lam * acc
        adv[i] = acc
    t = torch.arange(T)
    seg = torch.searchsorted(b[1:].contiguous(), t, right=True)  # segment index of token t (its first p_i > t)
    inside = (t >= b[0]) & (t < b[-1])
    return torch.where(inside, adv[seg.clamp_max(len(adv) - 1)], torch.zeros((), dtype=adv.dtype))
