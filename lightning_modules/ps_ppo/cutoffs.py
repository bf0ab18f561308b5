"""Cutoff distributions q(C | x, T) for PS-PPO and their survival functions S(t) = P(C >= t).

The paper (Hwang & Kim, arXiv 2606.29758) says only that the cutoff distribution is *prompt-conditioned*;
every family below is the spec's inference ([INF], ../shared/papers/ps_ppo.md 1.3). Each family is a small
class with one method, ``sample(lengths, generator, rewards, group_size) -> (C, S)``: C (N,) cutoffs in
{0..T_i} (0 = skip the trajectory) and S (N, T_max) with S[i, t-1] = P(C_i >= t) for t <= T_i (0 beyond).
Unbiasedness needs S(T_i) > 0 for every trajectory that is not skipped.

- ``uniform``       : C ~ U{c_min..T};            S(t) = 1 (t <= c_min), (T-t+1)/(T-c_min+1) after.
- ``mixture_full``  : C = T w.p. p_full, else U{1..T}; S(t) = p_full + (1-p_full)(T-t+1)/T; weights <= 1/p_full.
                      The spec's recommended default.
- ``beta``          : C = ceil(u·T), u ~ Beta(a, b), plus a full-length atom p_full;
                      S(t) = p_full + (1-p_full)(1 - I_{(t-1)/T}(a, b)).
- ``group``         : prompt-conditioned through the group's pass rate π (free in GRPO/RLOO): a mixture_full
                      with p_full(x) = p_min + (p_max - p_min)·4π(1-π), so prompts whose rewards vary (where
                      the advantage signal is) keep more of their trajectories; with ``skip_zero_adv`` a group
                      whose rewards are all equal (A = 0) gets C = 0, which is unbiased only when the KL weight
                      beta = 0 (then its every term is exactly 0).
"""
from __future__ import annotations

import torch


def _table(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    T = lengths.long()
    t = torch.arange(1, int(T.max().clamp_min(1)) + 1, device=T.device).unsqueeze(0).expand(len(T), -1)
    return t, T.unsqueeze(1)


def prefix_weights(cutoffs: torch.Tensor, survival: torch.Tensor) -> torch.Tensor:
    """The PS-PPO per-token weight: 1/S(t) for t <= C, 0 beyond (and 0 for skipped rows)."""
    t = torch.arange(1, survival.shape[1] + 1, device=survival.device).unsqueeze(0)
    keep = (t <= cutoffs.unsqueeze(1)) & (survival > 0)
    return torch.where(keep, 1.0 / survival.clamp_min(1e-12), torch.zeros_like(survival))


class Uniform:
    def __init__(self, c_min: int = 1):
        if c_min < 1:
            raise ValueError("model.c_min must be >= 1")
        self.c_min = c_min

    def survival(self, lengths):
        t, T = _table(lengths)
        lo = torch.minimum(torch.full_like(T, self.c_min), T)
        s = (T - t + 1).float() / (T - lo + 1).clamp_min(1).float()
        s = torch.where(t <= lo, torch.ones_like(s), s)
        return torch.where(t <= T, s, torch.zeros_like(s))

    def sample(self, lengths, generator=None, rewards=None, group_size=None):
        T = lengths.long()
        lo = torch.minimum(torch.full_like(T, self.c_min), T)
        u = torch.rand(len(T), generator=generator).to(T.device)
        C = lo + torch.floor(u * (T - lo + 1).float()).long()
        return torch.minimum(C, T), self.survival(lengths)


class MixtureFull:
    def __init__(self, p_full: float = 0.2):
        if not 0.0 < p_full <= 1.0:
            raise ValueError(f"model.p_full={p_full}: must be in (0, 1] (S(T) = p_full must stay positive)")
        self.p_full = p_full

    def survival(self, lengths, p_full=None):
        t, T = _table(lengths)
        p = torch.as_tensor(self.p_full if p_full is None else p_full, dtype=torch.float32, device=T.device)
        p = p.view(-1, 1) if p.ndim else p
        s = p + (1 - p) * (T - t + 1).float() / T.clamp_min(1).float()
        return torch.where(t <= T, s, torch.zeros_like(s))

    def sample(self, lengths, generator=None, rewards=None, group_size=None, p_full=None):
        T = lengths.long()
        p = torch.as_tensor(self.p_full if p_full is None else p_full, dtype=torch.float32)
        full = torch.rand(len(T), generator=generator) < p
        u = torch.rand(len(T), generator=generator)
        unif = 1 + torch.floor(u * T.cpu().float()).long()
        C = torch.where(full, T.cpu(), torch.minimum(unif, T.cpu()))
        return C.to(T.device), self.survival(lengths, p_full)


class BetaFraction:
    def __init__(self, beta_a: float = 1.0, beta_b: float = 2.0, p_full: float = 0.2):
        if beta_a <= 0 or beta_b <= 0 or not 0.0 < p_full <= 1.0:
            raise ValueError("model.beta_a, model.beta_b must be > 0 and model.p_full in (0, 1]")
        self.a, self.b, self.p_full = beta_a, beta_b, p_full

    def survival(self, lengths):
        from scipy.special import betainc

        t, T = _table(lengths)
        x = ((t - 1).float() / T.clamp_min(1).float()).clamp(0, 1)
        cdf = torch.from_numpy(betainc(self.a, self.b, x.cpu().double().numpy())).float().to(T.device)
        s = self.p_full + (1 - self.p_full) * (1 - cdf)
        return torch.where(t <= T, s, torch.zeros_like(s))

    def sample(self, lengths, generator=None, rewards=None, group_size=None):
        from scipy.special import betaincinv

        T = lengths.long().cpu()
        full = torch.rand(len(T), generator=generator) < self.p_full
        v = torch.rand(len(T), generator=generator).double().numpy()
        u = torch.from_numpy(betaincinv(self.a, self.b, v))
        C = torch.ceil(u * T.double()).long().clamp(min=1)
        C = torch.where(full, T, torch.minimum(C, T))
        return C.to(lengths.device), self.survival(lengths)


class GroupAdaptive:
    def __init__(self, p_min: float = 0.1, p_max: float = 0.5, skip_zero_adv: bool = True, beta: float = 0.0):
        if not 0.0 < p_min <= p_max <= 1.0:
            raise ValueError("need 0 < model.p_min <= model.p_max <= 1")
        if skip_zero_adv and beta:
            raise ValueError("model.skip_zero_adv=true is unbiased only with model.beta=0 (a KL term has gradient "
                             "even where the advantage is 0): set one of them off")
        self.p_min, self.p_max, self.skip = p_min, p_max, skip_zero_adv
        self.mix = MixtureFull(1.0)

    def p_full(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        r = rewards.float().view(-1, group_size)
        rng = (r.max(1).values - r.min(1).values).clamp_min(1e-12)
        pi = ((r - r.min(1, keepdim=True).values) / rng.unsqueeze(1)).mean(1)  # pass rate for 0/1 rewards
        p = self.p_min + (self.p_max - self.p_min) * 4 * pi * (1 - pi)
        return p.repeat_interleave(group_size)

    def sample(self, lengths, generator=None, rewards=None, group_size=None):
        if rewards is None or group_size is None:
            raise ValueError("cutoff=group needs the group's rewards (it conditions on the prompt's pass rate)")
        p = self.p_full(rewards, group_size).cpu()
        C, S = self.mix.sample(lengths, generator, p_full=p)
        if self.skip:
            flat = (rewards.float().view(-1, group_size).std(1) == 0).repeat_interleave(group_size)
            C = torch.where(flat.to(C.device), torch.zeros_like(C), C)
        return C, S


def build_cutoff(name: str, p_full: float = 0.2, c_min: int = 1, beta_a: float = 1.0, beta_b: float = 2.0,
                 p_min: float = 0.1, p_max: float = 0.5, skip_zero_adv: bool = True, beta: float = 0.0):
    if name == "uniform":
        return Uniform(c_min)
    if name == "mixture_full":
        return MixtureFull(p_full)
    if name == "beta":
        return BetaFraction(beta_a, beta_b, p_full)
    if name == "group":
        return GroupAdaptive(p_min, p_max, skip_zero_adv, beta)
    raise ValueError(f"model.cutoff={name!r}: choose one of uniform, mixture_full, beta, group")
