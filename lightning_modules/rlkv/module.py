"""The RLKV probe (arXiv 2510.08525): GRPO on the gates of a frozen LLM's mixed attention.

A subclass of the RL core (``lightning_modules/common/rl/module.py``): rollouts come from the *gated* model (the
core runs on decoding steps too, ``patch_attention(..., decode=True)``), the only trainable parameters are the gates
α (L, H_kv), and two hooks carry the method:

- :meth:`regularizer`: the reward-gated L1 ``λ · 1[r̄ > τ] · (e^{r̄} − 1) · mean|α|``, r̄ a mean *raw* reward
  (detached), backpropagated once per minibatch before its optimizer step. ``penalty_scope``:

  * ``microbatch`` (default, the release's ``FSDPEngine.train_batch``): the rollouts are split into AReaL's token-packed
    micro-batches (first-fit decreasing, at most ``penalty_tokens_per_mb`` = 7,680 prompt + response tokens each,
    :func:`ffd_micro_batches`, their number the largest of any rank), r̄ is each micro-batch's mean and its penalty is
    weighted by its share of the step's response tokens over all ranks (AReaL's ``loss_weight_fn``). The penalty so
    never switches off entirely while some micro-batch is above τ: the multiplier Σ_m w_m 1[r̄_m > τ](e^{r̄_m} − 1) at
    accuracy 0.30 is ~0.1, where the batch form gives 0.
  * ``batch``: one r̄ over the rank's whole batch (ours before; the spec's reading of the README formula). It is the
    formula the paper writes; kept as a switch.
- :meth:`_step`: gates clamped to [0, 1] after every optimizer step.

Advantages (``advantage: reward`` + ``advantage_batch_norm``, the default): the reward itself normalised over every
response token of the batch on all ranks, no group normalisation, as the released recipe runs (rlkv-areal
``examples/rlkv/{deepseek,qwen3}_grpo.yaml`` set ``adv_norm`` at batch level and no ``reward_norm``). The spec's
"[SRC: README] group-level normalisation" is not in the README and not in the recipe; ``advantage: grpo`` keeps it as a
switch (group, then batch). It matters: on a 32 x 4 batch at accuracy 0.7 an all-correct group gets +0.65 per token
from the recipe and -0.03 after group normalisation. AReaL's
decoupled-PPO behaviour-importance cap (``behav_imp_cap`` 5) is inert here: rollouts are synchronous, so the
behaviour policy is π_old and its importance weight is 1; the key is kept so the recipe reads as the authors'.
``reward_scale`` / ``reward_bias`` (AReaL's (r + bias) · scale) default to 1 / 0, since the penalty's r̄ is compared
with τ on the raw reward. ``self_filter`` (an int): before RL, the first that many training problems are kept only if
the model solves one of its own G samples (self-distillation sampling; paper scale reads the authors' filtered file).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from lightning_modules.common.rl.module import RLModule
from lightning_modules.common.rl.rollouts import Rollouts, generate_rollouts
from lightning_modules.rlkv.mixed_attention import MixedAttention, check_backbone, check_window


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


def check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"model.{name}={value}: it must lie in [0, 1]")


class GatedModelMixin:
    """Builds the frozen backbone with the mixed attention installed; ``self.mixed`` holds the gates."""

    def install_gates(self, model, window: Mapping[str, Any]):
        model.requires_grad_(False)
        self.mixed = MixedAttention.for_model(model, **window)
        self.mixed.install(model)
        return model

    def gate_results(self) -> dict:
        g = self.mixed.gates.detach().float().cpu()
        return {"gates": g.tolist(), "gate_mean": float(g.mean()), "gate_min": float(g.min())}


PENALTY_SCOPES = ("microbatch", "batch")


class RLKVModule(GatedModelMixin, RLModule):
    """Args beyond the RL core's: the training window ``sink``/``recent``/``window``/``block``, ``gate_init``,
    ``reg_scale`` λ, ``tau`` τ, ``penalty_scope`` / ``penalty_tokens_per_mb`` (see above), ``reward_scale`` /
    ``reward_bias``, ``behav_imp_cap`` (inert, see above), and ``self_filter`` (problems to self-filter before RL,
    null = off)."""

    def __init__(self, backbone: Mapping[str, Any], sink: int = 128, recent: int = 256, window: str = "token",
                 block: int = 128, gate_init: float = 1.0, reg_scale: float = 1e-3, tau: float = 0.5,
                 reward_scale: float = 1.0, reward_bias: float = 0.0, behav_imp_cap: float = 5.0,
                 self_filter: int | None = None, penalty_scope: str = "microbatch",
                 penalty_tokens_per_mb: int = 7680, **kwargs):
        check_window(sink, recent, window, block)
        if penalty_scope not in PENALTY_SCOPES:
            raise ValueError(f"model.penalty_scope={penalty_scope!r}: choose microbatch (the release) or batch")
        if penalty_tokens_per_mb < 1:
            raise ValueError(f"model.penalty_tokens_per_mb={penalty_tokens_per_mb}: a micro-batch holds >= 1 token")
        check_unit("tau", tau)
        check_unit("gate_init", gate_init)
        kwargs.setdefault("advantage", "reward")
        kwargs.setdefault("advantage_batch_norm", True)
        super().__init__(backbone, **kwargs)
        self.window = {"sink": sink, "recent": recent, "window": window, "block": block, "init": gate_init}
        self.reg_scale, self.tau = reg_scale, tau
        self.reward_scale, self.reward_bias, self.behav_imp_cap = reward_scale, reward_bias, behav_imp_cap
        self.self_filter = self_filter
        self.penalty_scope, self.penalty_tokens_per_mb = penalty_scope, penalty_tokens_per_mb
        self.mixed = None
        self.results: dict = {}
        self._raw = torch.zeros(0)

    def setup(self, stage: str) -> None:
        check_backbone(self.backbone_spec)
        super().setup(stage)

    def build_model(self):
        return self.install_gates(super().build_model(), self.window)

    def score(self, ro: Rollouts, batch) -> torch.Tensor:
        raw = super().score(ro, batch)
        self._raw = raw.detach()
        return (raw + self.reward_bias) * self.reward_scale

    def regularizer(self, ro: Rollouts, rows: torch.Tensor) -> torch.Tensor:
        raw = self._raw.to(rows.device)[rows]
        if self.penalty_scope == "batch":
            return sparsity_penalty(self.mixed.gates, float(raw.mean()), self.reg_scale, self.tau)
        lengths = ro.attention_mask[rows].sum(-1)
        weight = microbatch_penalty_weight(raw, lengths, ro.lengths[rows], self.tau, self.penalty_tokens_per_mb)
        return self.reg_scale * weight * self.mixed.gates.abs().mean()

    def _step(self) -> float:
        norm = super()._step()
        self.mixed.clamp_()
        return norm

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        g = self.mixed.gates.detach()
        self.log_dict({"train/gate_mean": float(g.mean()), "train/gate_min": float(g.min())}, on_step=True,
                      on_epoch=False, batch_size=len(batch["prompt"]))
        return out

    def on_fit_start(self):
        if self.self_filter:
            self.filter_training_problems(int(self.self_filter))

    @torch.no_grad()
    def filter_training_problems(self, n: int) -> None:
        """Self-distillation sampling: keep the first ``n`` training problems the model solves in one of G samples."""
        from datamodules.verifiable import collate

        dm, tok = self.trainer.datamodule, self.get_tokenizer()
        items = dm.train_set.items[:n]
        kept = []
        for start in range(0, len(items), self.micro_batch_size):
            batch = collate(items[start:start + self.micro_batch_size])
            ro = generate_rollouts(self.model, batch["prompt_ids"], self.group_size, self.max_new_tokens,
                                   tok.eos_token_id, tok.pad_token_id, self.temperature, self.top_p, tokenizer=tok,
                                   top_k=self.top_k)
            solved = super().score(ro, batch).view(-1, self.group_size).amax(1) > 0.5
            kept += [it for it, s in zip(batch_items(batch), solved) if s]
        if not kept:
            raise ValueError(f"model.self_filter={n}: the model solves none of its first {n} training problems; "
                             "raise it, warm the model up longer, or set model.self_filter=null")
        dm.train_set.items = kept
        self.results["self_filter"] = {"checked": len(items), "kept": len(kept)}

    def on_fit_end(self):
        super().on_fit_end()
        self.results.update(self.gate_results())


def batch_items(batch: dict) -> list[dict]:
    keys = list(batch)
    return [dict(zip(keys, vals)) for vals in zip(*(batch[k] for k in keys))]
