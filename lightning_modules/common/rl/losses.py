"""Policy losses for critic-free RL: per-token PPO-clip terms, k3 KL, and loss aggregation.

Every function takes per-token tensors of shape (N, T) over response positions plus a per-token weight
``weights`` (1 on real tokens for full-trajectory methods; PS-PPO's 1/S(t) on kept tokens and 0 beyond the
cutoff). The aggregation divides by a per-sequence divisor that counts *full, untruncated* tokens, so a
truncated estimator is unbiased for the full objective (PS-PPO spec 1.4):

- ``seq_mean``  : (1/N) Σ_i (1/T_i) Σ_t w ℓ   (TRL ``grpo`` / verl ``seq-mean-token-mean``; T_i = full length)
- ``token_mean``: Σ_i Σ_t w ℓ / Σ_i T_i        (TRL ``dapo``/``bnpo`` / verl ``token-mean``, full token count);
  with ``scope="global"`` (the core's default ``token_mean_scope``) Σ_i T_i runs over every rank's minibatch and is
  divided by the world size, as TRL's ``dapo`` / ``cispo`` do (``num_items_in_batch / num_processes``): after DDP
  averages the gradients the loss is one mean over all tokens of the step, not the mean of per-rank means
- ``dr_grpo``   : Σ_i Σ_t w ℓ / (N · L_max)    (Dr. GRPO: constant max-completion-length divisor)

Per-token terms (``policy_loss(loss_type=...)``): ``ppo`` (PPO-clip; TRL's ``dapo`` is this with ``token_mean``
and ``eps_high`` 0.28) or ``cispo`` (MiniMax-M1's clipped-IS-weight policy gradient, as TRL computes it).
"""
from __future__ import annotations

import torch

AGGREGATIONS = ("seq_mean", "token_mean", "dr_grpo")


SCOPES = ("global", "local")


def divisors(mode: str, full_lengths: torch.Tensor, max_len: int, scope: str = "local") -> torch.Tensor:
    """Per-sequence divisor d_i so that the loss is Σ_i Σ_t w ℓ_it / d_i (fixed for a whole minibatch). ``scope``
    (``token_mean`` only): ``local`` counts this rank's tokens, ``global`` every rank's / the world size."""
    n = full_lengths.numel()
    t = full_lengths.float()
    if mode == "seq_mean":
        return n * t.clamp_min(1)
    if mode == "token_mean":
        if scope not in SCOPES:
            raise ValueError(f"model.token_mean_scope={scope!r}: choose global (TRL, AReaL) or local")
        if scope == "global":
            from lightning_modules.common.rl.ranks import all_sum, world_size

            return (all_sum(t.sum()) / world_size()).clamp_min(1).expand(n).clone()
        return t.sum().clamp_min(1).expand(n).clone()
    if mode == "dr_grpo":
        return torch.full_like(t, float(n * max_len))
    raise ValueError(f"model.aggregation={mode!r}: choose one of {', '.join(AGGREGATIONS)}")


def ppo_clip_terms(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor,
                   eps_low: float = 0.2, eps_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss  -min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A)  and whether the clip was active."""
    ratio = torch.exp(logp - logp_old)
    a = adv.unsqueeze(-1) if adv.ndim == 1 else adv
    unclipped = ratio * a
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * a
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped)


def cispo_terms(logp: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor,
                eps_high: float = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CISPO loss  -sg(min(ρ, ε_high)) A log π  and whether the clip was active. As in TRL,
    ``eps_high`` is the IS weight's upper bound itself (5.0), not 1 + ε; every token keeps its gradient."""
    ratio = torch.exp(logp - logp_old)
    a = adv.unsqueeze(-1) if adv.ndim == 1 else adv
    weight = ratio.clamp(max=eps_high).detach()
    return -weight * a * logp, (ratio > eps_high)


LOSS_TYPES = ("ppo", "cispo")


def k3_kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π_θ‖π_ref) per token: exp(Δ) - Δ - 1 with Δ = log π_ref - log π_θ."""
    delta = logp_ref - logp
    return torch.exp(delta) - delta - 1.0


def policy_loss(logp, logp_old, adv, weights, divisor, logp_ref=None, beta: float = 0.0,
                eps_low: float = 0.2, eps_high: float = 0.2, loss_type: str = "ppo"):
    """Σ_i Σ_t w_it (ℓ_it + β KL_it) / d_i, plus statistics (sums, for the caller to normalise).

    ``weights`` is zero on padding and on truncated positions; ``divisor`` comes from :func:`divisors`.
    """
    if loss_type == "cispo":
        terms, clipped = cispo_terms(logp, logp_old, adv, eps_high)
    else:
        terms, clipped = ppo_clip_terms(logp, logp_old, adv, eps_low, eps_high)
    kl = None
    if beta and logp_ref is not None:
        kl = k3_kl(logp, logp_ref)
        terms = terms + beta * kl
    loss = ((terms * weights).sum(-1) / divisor).sum()
    kept = (weights > 0).float()
    stats = {"clipped": (clipped.float() * kept).sum().detach(), "kept": kept.sum().detach()}
    if kl is not None:
        stats["kl"] = (kl.detach() * kept).sum()
    return loss, stats
