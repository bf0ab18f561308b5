"""PS-PPO: Prefix-Sampling PPO for critic-free RLHF (Hwang & Kim, arXiv 2606.29758).

Per trajectory i a cutoff C_i ~ q(·|x, T_i) (``cutoffs.py``); the update pass feeds only prompt + first C_i
response tokens to π_θ (π_old and π_ref are truncated too) and weights each kept token's term by 1/S_i(t),
S_i(t) = P(C_i >= t), so E_C[loss] and E_C[gradient] equal the full-trajectory GRPO/RLOO objective
(spec 1.2; the Russian-roulette / randomized-truncation estimator). Everything else is the shared RL module:
this class overrides one hook, :meth:`token_weights`.

Switches (all [INF] — the abstract does not give the distribution's form):
- ``cutoff``: ``mixture_full`` (default; ``p_full``), ``uniform`` (``c_min``), ``beta`` (``beta_a``, ``beta_b``,
  ``p_full``), ``group`` (prompt-conditioned on the group pass rate; ``p_min``, ``p_max``, ``skip_zero_adv``).
- ``resample_per_epoch``: a fresh C per PPO epoch (default, lower variance) or one C per trajectory per step.
- ``aggregation`` (shared): divisors always count full, untruncated tokens (dividing by C would bias it).
With ``cutoff=mixture_full, p_full=1`` the loss is exactly the full-trajectory loss.
"""
from __future__ import annotations

import torch

from lightning_modules.common.rl.module import RLModule
from lightning_modules.common.rl.rollouts import Rollouts
from lightning_modules.ps_ppo.cutoffs import build_cutoff, prefix_weights


class PSPPOModule(RLModule):
    def __init__(self, *args, cutoff: str = "mixture_full", p_full: float = 0.2, c_min: int = 1, beta_a: float = 1.0,
                 beta_b: float = 2.0, p_min: float = 0.1, p_max: float = 0.5, skip_zero_adv: bool = True,
                 resample_per_epoch: bool = True, cutoff_seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.cutoff = build_cutoff(cutoff, p_full, c_min, beta_a, beta_b, p_min, p_max,
                                   skip_zero_adv if cutoff == "group" else False, self.beta)
        self.resample_per_epoch, self.cutoff_seed = resample_per_epoch, cutoff_seed
        self._plan = None

    def token_weights(self, ro: Rollouts, epoch: int):
        if epoch > 0 and not self.resample_per_epoch and self._plan is not None:
            return self._plan
        gen = torch.Generator().manual_seed(self.cutoff_seed * 1_000_003 + int(self.global_step) * 101 + epoch)
        C, S = self.cutoff.sample(ro.lengths, gen, ro.rewards, ro.group_size)
        w = prefix_weights(C, S)
        T = ro.response_mask.shape[1]
        weights = torch.zeros((len(ro), T), device=ro.input_ids.device)
        weights[:, :w.shape[1]] = w.to(weights.device)
        self._plan = (C.to(ro.input_ids.device), weights * ro.response_mask)
        return self._plan
