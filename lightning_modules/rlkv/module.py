"""The RLKV probe (arXiv 2510.08525): GRPO on the gates of a frozen LLM's mixed attention.

A subclass of the RL core (``lightning_modules/common/rl/module.py``): rollouts come from the *gated* model (the
core runs on decoding steps too, ``patch_attention(..., decode=True)``), the only trainable parameters are the gates
α (L, H_kv), and two hooks carry the method:

- :meth:`regularizer`: the reward-gated L1 ``λ · 1[r̄ > τ] · (e^{r̄} − 1) · mean|α|``, r̄ a mean *raw* reward
  (detached), backpropagated once per minibatch before its optimizer step. ``penalty_scope``:

  * ``microbatch`` (default, the release's ``FSDPEngine.train_batch``): the rollouts are split into AReaL's token-packed
    micro-batches (first-fit decreasing, at most ``penalty_tokens_per_mb`` = 7,680 prompt + response tokens each,
    ``penalty.ffd_micro_batches``, their number the largest of any rank), r̄ is each micro-batch's mean and its penalty is
    weighted by its share of the step's response tokens over all ranks (AReaL's ``loss_weight_fn``). The penalty so
    never switches off entirely while some micro-batch is above τ: the multiplier Σ_m w_m 1[r̄_m > τ](e^{r̄_m} − 1) at
    accuracy 0.30 is ~0.1, where the batch form gives 0.
  * ``batch``: one r̄ over the rank's whole batch (ours before; the spec's reading of the README formula). It is the
    formula the paper writes; kept as a switch.
- :meth:`_step`: gates clamped to [0, 1] after every optimizer step (``clamp: after_step``, ours; ``before_forward``
  is the release's timing, see :class:`GatedModelMixin`).

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

from typing import Any, Mapping

import torch

from lightning_modules.common.rl.module import RLModule
from lightning_modules.common.rl.rollouts import Rollouts, generate_rollouts
from lightning_modules.rlkv.mixed_attention import MixedAttention, check_backbone, check_window
from lightning_modules.rlkv.penalty import microbatch_penalty_weight, sparsity_penalty


def check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"model.{name}={value}: it must lie in [0, 1]")


CLAMPS = ("after_step", "before_forward")


def check_clamp(clamp: str) -> None:
    if clamp not in CLAMPS:
        raise ValueError(f"model.clamp={clamp!r}: choose after_step (ours) or before_forward (the release)")


class GatedModelMixin:
    """Builds the frozen backbone with the mixed attention installed; ``self.mixed`` holds the gates.

    ``clamp`` (when the gates are put back in [0, 1]): ``after_step`` (default, ours): right after every optimizer
    step, so the gates the rollouts, the evaluation and the saved results see always lie in [0, 1]; ``before_forward``
    (the releases: AReaL's ``train_batch`` and DuoAttention's ``train.py`` clamp before each training forward): the
    step may leave gates outside [0, 1] until the next training forward (rollouts and no-grad passes see them so, and
    the saved gates may lie outside, which the evaluation clips). Ours keeps every pass on the same, valid gates."""

    clamp = "after_step"

    def install_gates(self, model, window: Mapping[str, Any]):
        model.requires_grad_(False)
        self.mixed = MixedAttention.for_model(model, **window, attention_impl=getattr(self, "attention_impl", "auto"))
        self.mixed.install(model)
        if self.clamp == "before_forward":
            model.register_forward_pre_hook(self._clamp_before_training_forward)
        return model

    @classmethod
    def preflight_model(cls, model_cfg: Mapping[str, Any], backbone):
        """The frozen backbone beside its gates (``common/preflight.py``): only the (L, H_kv) gates train."""
        from lightning_modules.common.preflight import Trained

        keys = {"sink": "sink", "recent": "recent", "window": "window", "block": "block", "init": "gate_init"}
        window = {k: model_cfg[c] for k, c in keys.items() if c in model_cfg}  # as __init__ builds self.window
        backbone.requires_grad_(False)
        gates = MixedAttention.for_model(backbone, **window)
        return Trained(torch.nn.ModuleDict({"model": backbone, "gates": gates}),
                       notes=["frozen backbone; only the per-(layer, KV head) gates train"])

    def _clamp_before_training_forward(self, module, args):
        if torch.is_grad_enabled():  # a training forward; generation and the no-grad log-prob passes see them as stepped
            self.mixed.clamp_()

    def clamp_after_step(self) -> None:
        if self.clamp == "after_step":
            self.mixed.clamp_()

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
                 penalty_tokens_per_mb: int = 7680, clamp: str = "after_step", **kwargs):
        check_window(sink, recent, window, block)
        check_clamp(clamp)
        self.clamp = clamp
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
        self.clamp_after_step()
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
