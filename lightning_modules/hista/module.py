"""Hista / Numca token-level advantages on the shared RL core (Chen et al., ICML 2026; spec ../shared/papers/hista.md).

The core runs the π_old pass before advantages (with the last layer's states when the estimator needs them) and
calls :meth:`HistaModule.token_advantages`; this class fills it in. ``estimator``:

- ``grpo``: R − group mean on every token (the baseline; GRPO's advantage once scaled).
- ``numca``: values of the set of numbers written so far, from a per-problem table kept across steps
  (``numca.py``); positions are tokens (a number's first character → the token holding it, +1), ``merge_gap``.
- ``hista``: values by k nearest prefixes of the group's own last-layer states (``hista.py``; ``state_grid`` and
  ``zero_last_token`` follow the release by default, see there).

Both then take GAE over segments (λ = ``lam``, γ = 1) and divide by the group reward std + 1e-4
(``scale_rewards: group|none``). Every rank holds all G rollouts of each of its groups, so the group — Hista's
library — is local; Numca's table is updated with every rank's rollouts (all-gathered) before any advantage.
Dynamic sampling: ``data.dynamic_sampling_scale`` = k serves k × the prompts; the k-th part whose group accuracy
is nearest 0.5 is kept, ranked over the groups of every rank and dealt back out (:func:`dynamic_sample_ranks`, the
release's selection; one process: its own groups). Loss: the core's ``loss_type`` (``ppo`` with ``token_mean`` and eps_high 0.28 = TRL's
dapo, or ``cispo`` with eps_high 5.0).
"""
from __future__ import annotations

import torch

from lightning_modules.common.rl.advantages import scale_rewards
from lightning_modules.common.rl.module import RLModule
from lightning_modules.common.rl.ranks import gather_objects
from lightning_modules.common.rl.rollouts import Rollouts
from lightning_modules.hista.sampling import dynamic_sample_ranks
from lightning_modules.hista.hista import (HistaConfig, hista_token_advantages, representations,
                                           state_positions)
from lightning_modules.hista.numca import NumcaTable, chars_to_tokens, numca_token_advantages, parse_numbers

ESTIMATORS = ("grpo", "numca", "hista")


class HistaModule(RLModule):
    def __init__(self, *args, estimator: str = "hista", scale_rewards: str = "group", lam: float = 1.0,
                 alpha: float = 0.7, mean_window: int = 5, min_interval: int = 50, d_min: float | str | None = None,
                 power: float = 1.0, max_k: int = 66, min_k: int = 6, ema_init: str = "h0", merge_gap: int = 50,
                 state_grid: str = "prompt", zero_last_token: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        if estimator not in ESTIMATORS:
            raise ValueError(f"model.estimator={estimator!r}: choose one of {', '.join(ESTIMATORS)}")
        if self.group_size < 2:
            raise ValueError(f"model.group_size={self.group_size}: state values need G >= 2 rollouts per prompt")
        if estimator == "hista" and min_interval >= self.max_new_tokens:
            raise ValueError(f"model.min_interval={min_interval} >= model.max_new_tokens={self.max_new_tokens}: no "
                             "intermediate state fits; lower model.min_interval")
        if scale_rewards not in ("group", "none"):
            raise ValueError(f"model.scale_rewards={scale_rewards!r}: choose one of group, none")
        self.estimator, self.scale, self.lam, self.merge_gap = estimator, scale_rewards, lam, merge_gap
        # d_min: a number, or "median" (each rollout's median prefix distance; tiny scale); None: the recipe's 5
        self.hista = HistaConfig(alpha, mean_window, min_interval, 5.0 if d_min is None else d_min, power, max_k,
                                 min_k, lam, ema_init, state_grid, zero_last_token)
        self.numca = NumcaTable()

    @property
    def needs_hidden(self) -> bool:
        return self.estimator == "hista"

    # --- rollouts: problem ids, dynamic sampling ---------------------------------------------------
    def rollout(self, batch) -> Rollouts:
        ro = super().rollout(batch)
        ro.problem_ids = [pid for pid in batch["id"] for _ in range(self.group_size)]
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        k = int(getattr(dm, "dynamic_sampling_scale", 1) or 1)
        if k > 1:
            ro = dynamic_sample_ranks(ro, self.group_size, len(batch["id"]) // k, self.get_tokenizer().pad_token_id)
        return ro

    # --- the hook -------------------------------------------------------------------------------------
    def token_advantages(self, ro: Rollouts, hidden: torch.Tensor | None) -> torch.Tensor:
        T = ro.response_mask.shape[1]
        if self.estimator == "grpo":  # the chain [group mean, R]: R − mean on every token (GRPO once scaled)
            r = ro.rewards.float().view(-1, self.group_size)
            adv = (r - r.mean(1, keepdim=True)).view(-1, 1).expand(-1, T)
        elif self.estimator == "numca":
            adv = self.numca_advantages(ro, T)
        else:
            adv = self.hista_advantages(ro, hidden, T)
        adv = scale_rewards(adv.to(ro.rewards.device), ro.rewards, self.group_size, self.scale)
        return adv * ro.response_mask

    def numca_advantages(self, ro: Rollouts, T: int) -> torch.Tensor:
        tok = self.get_tokenizer()
        rows = []
        for ids, n in zip(ro.response_ids.tolist(), ro.lengths.tolist()):
            pieces = tok.batch_decode([[t] for t in ids[:n]], skip_special_tokens=True)  # offsets of the sampled tokens
            ends = torch.tensor([len(p) for p in pieces]).cumsum(0).tolist()
            nums = parse_numbers("".join(pieces))
            rows.append((nums, chars_to_tokens([c for _, c in nums], ends), n))
        rewards = ro.rewards.tolist()
        for pid, (nums, _, _), r in gather_objects(list(zip(ro.problem_ids, rows, rewards))):
            self.numca.update(pid, [x for x, _ in nums], r)  # every rank's rollouts first, then the advantages
        return torch.stack([numca_token_advantages(self.numca, pid, nums, r, n, T, self.merge_gap, self.lam, pos)
                            for pid, (nums, pos, n), r in zip(ro.problem_ids, rows, rewards)])

    def hista_advantages(self, ro: Rollouts, hidden: torch.Tensor, T: int) -> torch.Tensor:
        G, cfg = self.group_size, self.hista
        plens, lengths = ro.prompt_lengths.tolist(), ro.lengths.tolist()
        states = [hidden[i][ro.attention_mask[i].bool()] for i in range(len(ro))]  # unpadded prompt + response
        out = []
        for g in range(0, len(ro), G):
            reps = representations(states[g:g + G], cfg)
            pos = [state_positions(plens[i], lengths[i], cfg.min_interval, cfg.state_grid) for i in range(g, g + G)]
            out.append(hista_token_advantages(reps, pos, plens[g:g + G], lengths[g:g + G], ro.rewards[g:g + G], T, cfg))
        return torch.cat(out)
