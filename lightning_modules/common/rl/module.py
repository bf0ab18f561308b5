"""The critic-free RL LightningModule (GRPO / Dr.GRPO / RLOO), with manual optimisation.

One ``training_step`` = one batch of prompts:

1. **rollout**: G samples per prompt from the current weights, which are the frozen old policy π_old of this
   step (``generate_rollouts``; no gradient; ``rollout_chunk`` > 0 generates that many sequences at a time, which
   bounds the KV cache); rewards from ``reward`` (``scorers.py``, config group
   ``model/reward``: exact match by default, a reward model for RLHF); group advantages (``advantages.py``:
   ``grpo``, ``dr_grpo``, ``rloo``).
2. **plan**: per PPO epoch, per trajectory, how many response tokens to backpropagate and the per-token weights
   (hook :meth:`token_weights`; here every token with weight 1 — PS-PPO overrides it). Log-probs of π_old
   (and π_ref when ``beta > 0``) are recorded once, no-grad, over the longest prefix any epoch needs.
3. **update**: ``ppo_epochs`` passes over ``minibatches`` shuffled minibatches, one optimizer step each. A
   minibatch is split into micro-batches of ``micro_batch_size`` rows sorted by kept length, each fed only its
   longest kept prefix (gradient accumulation; the loss's divisor is fixed per minibatch so this is exact).
   With ``packing`` a micro-batch's kept prefixes go in as one row without padding (``packed_logprobs``) and rows
   are balanced over the micro-batches by tokens, so activation memory follows the sum of kept tokens instead of
   rows · the longest one (:meth:`micro_batches`).
   Loss: PPO-clip with ``eps_low``/``eps_high`` (+ ``beta`` · k3 KL to π_ref), aggregated as ``aggregation``
   (``seq_mean`` | ``token_mean`` | ``dr_grpo``, divisors counting full untruncated tokens; ``losses.py``);
   ``token_mean_scope``: ``global`` (default, TRL's dapo / cispo and AReaL: the token count of every rank) or
   ``local`` (this rank's).

``trainer.max_steps`` counts optimizer steps (ppo_epochs · minibatches per batch of prompts). Validation and
test: greedy decoding on held-out prompts, the mean reward as ``val/<reward.metric>`` (``val/accuracy`` for exact
match, ``val/reward`` for a reward model). ``warmup`` (a dict, optional) starts from a cached supervised warm-up
on the task format (``warmup.py``). Logged per step: reward, accuracy, response length, KL (to π_old, and to
π_ref when beta > 0), clip fraction, tokens backpropagated vs full, max weight, gradient norm, rollout/update wall
time; with ``measure_activations`` the bytes autograd saves per micro-batch.
``attention_impl`` (``common.block_attention``): ``auto`` (FlexAttention on CUDA, block-wise elsewhere) | ``flex`` |
``blockwise`` run the policy's attention through ``use_block_attention``, so padded and packed rows
never build an N × N mask; ``sdpa_dense`` leaves the backbone's own implementation (transformers' 4-D masks).
Under DeepSpeed ZeRO the gradients are partitioned, so the engine clips: :meth:`setup` writes ``max_grad_norm``
into its config's ``gradient_clipping`` (Lightning would write ``trainer.gradient_clip_val``, which manual
optimisation must leave null, i.e. no clipping at all).
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable, Mapping

import torch

from lightning_modules.common.block_attention import check_impl, use_block_attention
from lightning_modules.common.eval_hooks import TestIsValidation
from lightning_modules.common.lm import CausalLMModule, _plain
from lightning_modules.common.rl.advantages import batch_normalize, compute_advantages
from lightning_modules.common.rl.losses import AGGREGATIONS, LOSS_TYPES, SCOPES, divisors, k3_kl, policy_loss
from lightning_modules.common.rl.scorers import ExactMatch
from lightning_modules.common.rl.rollouts import (Rollouts, batched_logprobs, generate_rollouts, packed_logprobs,
                                                  response_logprobs)


# train/* metrics kept per step for the dashboard's curves
DASHBOARD_CURVES = ("train/reward", "train/accuracy", "train/response_length", "train/tokens_backprop", "train/tokens_full")


class SavedBytes:
    """Counts bytes of the tensors autograd saves for backward inside the block (activation memory of one
    forward; works on CPU, where a process's peak RSS cannot show it). Off: a no-op. Tensors sharing storage with
    ``exclude`` (the parameters: a linear layer saves its weight, which is not activation memory) are not counted."""

    def __init__(self, enabled: bool = True, exclude=()):
        self.enabled, self.bytes, self._ctx = enabled, 0, None
        self._seen = {(p.untyped_storage().data_ptr(), p.dtype) for p in exclude} if enabled else set()

    def _pack(self, t):
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in self._seen:  # count each storage once (views and re-saves share it)
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        if self.enabled:
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        return False


class RLModule(TestIsValidation, CausalLMModule):
    def __init__(self, backbone: Mapping[str, Any], optimizer: Callable | None = None, scheduler: Callable | None = None,
                 weight_decay: float = 0.0, advantage: str = "grpo", aggregation: str = "seq_mean", group_size: int = 8,
                 max_new_tokens: int = 32, temperature: float = 1.0, top_p: float = 1.0, ppo_epochs: int = 1,
                 minibatches: int = 1, micro_batch_size: int = 8, eps_low: float = 0.2, eps_high: float = 0.2,
                 beta: float = 0.0, max_grad_norm: float | None = 1.0, warmup: Mapping[str, Any] | None = None,
                 val_max_new_tokens: int | None = None, measure_activations: bool = False, packing: bool = False,
                 reward: Callable | None = None,
                 advantage_batch_norm: bool = False, loss_type: str = "ppo", top_k: int = 0,
                 token_mean_scope: str = "global", rollout_chunk: int = 0, attention_impl: str = "auto"):
        super().__init__(backbone, optimizer, scheduler, weight_decay)
        self.attention_impl = check_impl(attention_impl)
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"model.loss_type={loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
        self.loss_type = loss_type
        self.reward = reward if reward is not None else ExactMatch()
        self.hparams["reward"] = repr(self.reward)  # the scorer object itself is not plain data
        self._curves: list[dict] = []    # per step, for the dashboard's plots at fit end
        self._samples: list[dict] = []   # a few greedy completions per evaluation, for its table
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"model.aggregation={aggregation!r}: choose one of {', '.join(AGGREGATIONS)}")
        if advantage == "rloo" and group_size < 2:
            raise ValueError("model.advantage=rloo needs model.group_size >= 2")
        self.automatic_optimization = False
        self.advantage, self.aggregation, self.group_size = advantage, aggregation, group_size
        self.max_new_tokens, self.temperature, self.top_p, self.top_k = max_new_tokens, temperature, top_p, top_k
        self.ppo_epochs, self.minibatches, self.micro_batch_size = ppo_epochs, minibatches, micro_batch_size
        self.eps_low, self.eps_high, self.beta, self.max_grad_norm = eps_low, eps_high, beta, max_grad_norm
        self.warmup = _plain(warmup) if warmup else None
        self.val_max_new_tokens = val_max_new_tokens or max_new_tokens
        self.measure_activations, self.packing = measure_activations, packing
        self.advantage_batch_norm = advantage_batch_norm
        if token_mean_scope not in SCOPES:
            raise ValueError(f"model.token_mean_scope={token_mean_scope!r}: choose global (TRL, AReaL) or local")
        self.token_mean_scope = token_mean_scope
        if rollout_chunk < 0:
            raise ValueError(f"model.rollout_chunk={rollout_chunk}: sequences per generate call, >= 0 (0 = all at once)")
        self.rollout_chunk = rollout_chunk
        self.hparams["warmup"] = self.warmup
        self.tokenizer = None
        self._ref = None  # π_ref, kept out of the module tree: not trained, not checkpointed
        self._eval = None

    # --- model -----------------------------------------------------------------------------------
    def build_model(self):
        if self.warmup:
            from lightning_modules.common.backbone import build_backbone
            from lightning_modules.common.rl.warmup import warmup_dir

            warmup = {**self.warmup, **self.held_out_fractions()}
            model = build_backbone({**self.backbone_spec, "pretrained": str(warmup_dir(self.backbone_spec, warmup))})
        else:
            model = super().build_model()
        return use_block_attention(model, self.attention_impl)

    @classmethod
    def preflight_model(cls, model_cfg: Mapping[str, Any], backbone):
        """The policy trains in full; ``beta`` > 0 holds π_ref, a frozen copy of it (``common/preflight.py``)."""
        from lightning_modules.common.preflight import default_trained

        trained = default_trained(model_cfg, backbone)
        if model_cfg.get("beta"):
            trained.copies = 1
            trained.notes.append(f"beta={model_cfg['beta']}: π_ref is a frozen copy of the policy")
        return trained

    def held_out_fractions(self) -> dict[str, float]:
        """The data's val/test shares of the problem space, which the warm-up must not train on."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        return {k: float(getattr(dm, k)) for k in ("val_fraction", "test_fraction") if hasattr(dm, k)}

    def reference(self):
        if self.beta and self._ref is None:
            self._ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        if self._ref is not None:
            self._ref.to(self.device)
        return self._ref

    def get_tokenizer(self):
        if self.tokenizer is None:
            dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
            if dm is None or not hasattr(dm, "tokenizer"):
                raise ValueError("the RL module needs a tokenizer: use a datamodule with .tokenizer (data=verifiable)")
            self.tokenizer = dm.tokenizer
        return self.tokenizer

    def setup(self, stage: str) -> None:
        if hasattr(self.reward, "check"):  # e.g. a missing reward model: fail before the policy is built
            self.reward.check()
        strategy = self.trainer.strategy
        if "DeepSpeed" in type(strategy).__name__ and strategy.config is not None:  # before the engine is built
            clip = float(self.max_grad_norm or 0.0)
            # at ZeRO-3 the config is formatted before this hook (callbacks.deepspeed_hf): Lightning's own default,
            # trainer.gradient_clip_val or 0.0, is no setting of the user's
            lightning_default = float(getattr(self.trainer, "gradient_clip_val", None) or 0.0)
            if strategy.config.get("gradient_clipping", clip) not in (clip, lightning_default):
                raise ValueError(f"the DeepSpeed config's gradient_clipping={strategy.config['gradient_clipping']} "
                                 f"differs from model.max_grad_norm={self.max_grad_norm}: set only model.max_grad_norm")
            strategy.config["gradient_clipping"] = clip

    def on_train_start(self):
        self.model.train()  # from_pretrained returns eval mode; generation switches modes itself

    # --- the one hook a method changes -----------------------------------------------------------
    def token_weights(self, ro: Rollouts, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept response tokens per trajectory (N,) and per-token weights (N, T); full trajectories here."""
        return ro.lengths, ro.response_mask.clone()

    def regularizer(self, ro: Rollouts, rows: torch.Tensor) -> torch.Tensor | None:
        """An extra loss term backpropagated once per minibatch (``rows`` of ``ro``), before its optimizer step
        (None: none; RLKV's reward-gated L1 on its gates)."""
        return None

    needs_hidden = False  # True: the π_old pass also keeps the last layer's states for token_advantages

    def token_advantages(self, ro: Rollouts, hidden: torch.Tensor | None) -> torch.Tensor:
        """Per-token advantages (N, T), computed after the π_old pass (``hidden``: its last-layer states (N, P+T, H)
        when :attr:`needs_hidden`, else None). Here the group advantage on every token."""
        return ro.advantages.view(-1, 1).expand(-1, ro.response_mask.shape[1])

    # --- one RL step -----------------------------------------------------------------------------
    def score(self, ro: Rollouts, batch) -> torch.Tensor:
        # the bare question (a reward model applies its own chat template), the prompt for data without one
        key = "question" if "question" in batch else "prompt"
        prompts, golds = ([x for x in batch[k] for _ in range(ro.group_size)] for k in (key, "answer"))
        r = self.reward(prompts, ro.completions, golds, device=ro.input_ids.device)
        return r.to(ro.input_ids.device, torch.float32)

    def rollout(self, batch) -> Rollouts:
        tok = self.get_tokenizer()
        ro = generate_rollouts(self.model, batch["prompt_ids"], self.group_size, self.max_new_tokens, tok.eos_token_id,
                               tok.pad_token_id, self.temperature, self.top_p, tokenizer=tok, top_k=self.top_k,
                               chunk=self.rollout_chunk)
        ro.rewards = self.score(ro, batch)
        ro.advantages = compute_advantages(self.advantage, ro.rewards, self.group_size)
        if self.advantage_batch_norm:  # then over the whole batch, token-weighted (AReaL's adv_norm)
            ro.advantages = batch_normalize(ro.advantages, ro.lengths)
        return ro

    def update(self, ro: Rollouts, plans: list[tuple[torch.Tensor, torch.Tensor]], step_fn=None) -> dict[str, float]:
        """PPO epochs over minibatches; ``plans[e] = (kept, weights)``. Returns summed statistics."""
        need = torch.stack([k for k, _ in plans]).max(0).values
        logp_old = batched_logprobs(self.model, ro, need, self.micro_batch_size, self.temperature, self.needs_hidden)
        logp_old, hidden = logp_old if self.needs_hidden else (logp_old, None)
        t_adv = time.perf_counter()
        adv = self.token_advantages(ro, hidden)  # (N, T), sliced below to each micro-batch's kept prefix
        del hidden
        t_adv = time.perf_counter() - t_adv
        ref = self.reference()
        logp_ref = batched_logprobs(ref, ro, need, self.micro_batch_size, self.temperature) if ref is not None else None
        N, lengths = len(ro), ro.lengths
        stats = {k: 0.0 for k in ("loss", "clipped", "kept", "kl_ref", "kl_old", "grad_norm", "steps", "saved_bytes",
                                  "saved_bytes_sum")}
        stats["advantage_s"] = t_adv
        gen = torch.Generator().manual_seed(int(self.global_step) * 7 + 1)
        for epoch in range(self.ppo_epochs):
            kept, weights = plans[epoch]
            for mb in torch.randperm(N, generator=gen).to(ro.input_ids.device).chunk(self.minibatches):
                div = divisors(self.aggregation, lengths[mb], self.max_new_tokens, self.token_mean_scope)
                total = 0.0
                for part in self.micro_batches(kept[mb], ro.prompt_lengths[mb]):
                    rows, d = mb[part], div[part]
                    n = int(kept[rows].max())
                    if n == 0:
                        continue
                    with SavedBytes(self.measure_activations, self.model.parameters()) as saved:
                        if self.packing:  # beyond a row's cutoff: π_old's value (ratio 1, weight 0, no graph)
                            logp, valid = packed_logprobs(self.model, ro.input_ids[rows], ro.attention_mask[rows],
                                                          ro.prompt_len, kept[rows], self.temperature)
                            logp = torch.where(valid, logp, logp_old[rows, :n])
                        else:
                            logp = response_logprobs(self.model, ro.input_ids[rows], ro.attention_mask[rows],
                                                     ro.prompt_len, n, self.temperature)
                        w = weights[rows, :n]
                        loss, st = policy_loss(logp, logp_old[rows, :n], adv[rows, :n], w, d,
                                               logp_ref[rows, :n] if logp_ref is not None else None, self.beta,
                                               self.eps_low, self.eps_high, self.loss_type)
                    stats["saved_bytes"] = max(stats["saved_bytes"], saved.bytes)
                    stats["saved_bytes_sum"] += saved.bytes
                    self.manual_backward(loss)
                    total += float(loss.detach())
                    stats["clipped"] += float(st["clipped"])
                    stats["kept"] += float(st["kept"])
                    stats["kl_ref"] += float(st.get("kl", 0.0))
                    with torch.no_grad():
                        stats["kl_old"] += float((k3_kl(logp, logp_old[rows, :n]) * (w > 0)).sum())
                stats["loss"] += total
                reg = self.regularizer(ro, mb)
                if reg is not None:
                    self.manual_backward(reg)
                    stats["reg"] = stats.get("reg", 0.0) + float(reg.detach())
                stats["grad_norm"] += self._step()
                stats["steps"] += 1
        return stats

    def micro_batches(self, kept: torch.Tensor, prompt_lengths: torch.Tensor) -> list[torch.Tensor]:
        """Index groups for one minibatch's forwards. Padded: ``micro_batch_size`` rows sorted by kept length (a
        forward costs rows · its longest row). Packed: the same number of forwards, rows dealt longest-first to
        the micro-batch with the fewest tokens so far, so each holds about Σ_i (p_i + C_i) / k tokens."""
        k = -(-len(kept) // self.micro_batch_size)
        if not self.packing:
            return list(torch.split(torch.argsort(kept, stable=True), self.micro_batch_size))
        cost = (kept + prompt_lengths * (kept > 0)).tolist()
        bins, load = [[] for _ in range(k)], [0] * k
        for i in sorted(range(len(cost)), key=lambda j: -cost[j]):
            b = min(range(k), key=load.__getitem__)
            bins[b].append(i)
            load[b] += cost[i]
        return [torch.tensor(b, dtype=torch.long, device=kept.device) for b in bins if b]

    def _step(self) -> float:
        opt = self.optimizers()
        if "DeepSpeed" in type(self.trainer.strategy).__name__:
            # ZeRO partitions gradients: the engine clips (gradient_clipping = max_grad_norm, see setup) and steps
            opt.step()
            opt.zero_grad(set_to_none=True)
            engine = self.trainer.strategy.model
            return float(getattr(engine, "get_global_grad_norm", lambda: 0.0)() or 0.0)
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm or float("inf")) if params else torch.zeros((), dtype=torch.float32)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sch = self.lr_schedulers()
        if sch is not None:
            sch.step()
        return float(norm)

    def training_step(self, batch, batch_idx):
        t0 = time.perf_counter()
        ro = self.rollout(batch)
        t1 = time.perf_counter()
        plans = [self.token_weights(ro, e) for e in range(self.ppo_epochs)]
        st = self.update(ro, plans)
        t2 = time.perf_counter()
        steps = max(1.0, st["steps"])
        kept_tokens = sum(float(k.sum()) for k, _ in plans)
        full_tokens = float(ro.lengths.sum()) * self.ppo_epochs
        max_w = max(float(w.max()) for _, w in plans)
        log = {"train/loss": st["loss"] / steps, "train/reward": float(ro.rewards.mean()),
               "train/accuracy": float((ro.rewards > 0.5).float().mean()),
               "train/response_length": float(ro.lengths.float().mean()),
               "train/clip_frac": st["clipped"] / max(1.0, st["kept"]),
               "train/kl_old": st["kl_old"] / max(1.0, st["kept"]),
               "train/grad_norm": st["grad_norm"] / steps,
               "train/tokens_backprop": kept_tokens, "train/tokens_full": full_tokens,
               "train/tokens_ratio": kept_tokens / max(1.0, full_tokens),
               "train/prompt_tokens": float(ro.prompt_lengths.sum()) * self.ppo_epochs,
               "train/max_weight": max_w, "train/rollout_s": t1 - t0, "train/update_s": t2 - t1}
        log["train/advantage_s"] = st["advantage_s"]  # the token_advantages hook's share of update_s
        if self.measure_activations:  # peak bytes saved for backward by one micro-batch (CPU-countable)
            log["train/saved_act_mb"] = st["saved_bytes"] / 2**20
            log["train/saved_act_mb_sum"] = st["saved_bytes_sum"] / 2**20  # over all micro-batches of the step
        if torch.cuda.is_available() and self.device.type == "cuda":
            log["train/peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.beta:
            log["train/kl_ref"] = st["kl_ref"] / max(1.0, st["kept"])
        if "reg" in st:
            log["train/reg"] = st["reg"] / steps
        self.log_dict(log, on_step=True, on_epoch=False, prog_bar=False, batch_size=len(ro))
        self.log("train/reward_step", log["train/reward"], prog_bar=True, on_step=True, on_epoch=False, batch_size=len(ro))
        self._curves.append({"step": self.global_step, **{k[6:]: log[k] for k in DASHBOARD_CURVES}})
        return {"loss": torch.tensor(log["train/loss"], dtype=torch.float32)}

    # --- evaluation: greedy exact match ------------------------------------------------------------
    def on_validation_epoch_start(self):
        self._eval = torch.zeros(2, dtype=torch.float64, device=self.device)
        self._samples = []

    @torch.no_grad()
    def validation_step(self, batch, batch_idx):
        tok = self.get_tokenizer()
        ro = generate_rollouts(self.model, batch["prompt_ids"], 1, self.val_max_new_tokens, tok.eos_token_id,
                               tok.pad_token_id, temperature=0.0, tokenizer=tok)
        r = self.score(ro, batch)
        self._eval += torch.tensor([float(r.sum()), float(len(r))], dtype=torch.float64, device=self.device)
        self._samples += [{"prompt": tok.decode(p, skip_special_tokens=True), "completion": c, "answer": a, "reward": float(x)}
                          for p, c, a, x in zip(batch["prompt_ids"], ro.completions, batch["answer"], r)][:8 - len(self._samples)]

    def _eval_end(self, prefix: str):
        tot = self._eval
        if self.trainer.world_size > 1:
            tot = self.trainer.strategy.reduce(tot, reduce_op="sum")
        self.log(f"{prefix}/{self.reward.metric}", (tot[0] / tot[1].clamp_min(1)).float(), prog_bar=True, sync_dist=False)
        from lightning_modules.common.dashboard import log_table

        log_table(f"{prefix}/completions", [{"step": self.global_step, **s} for s in self._samples], self.loggers)

    def on_fit_end(self):
        """Reward and accuracy, response length and tokens backpropagated against the step, as plots."""
        from lightning_modules.common.dashboard import curve

        steps = [c["step"] for c in self._curves]
        for keys, ylabel in ((("reward", "accuracy"), "train reward / accuracy"), (("response_length",), "tokens"),
                             (("tokens_backprop", "tokens_full"), "response tokens per step")):
            if steps:
                curve(f"rl/{keys[0]}", {k: (steps, [c[k] for c in self._curves]) for k in keys}, self.loggers,
                      xlabel="step", ylabel=ylabel)
