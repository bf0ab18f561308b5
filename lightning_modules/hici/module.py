"""HiCI long-context adaptation (arXiv 2603.20843) and its LongLoRA S²-Attn baseline, as one LightningModule.

The recipe (spec ../shared/papers/hici.md, from the released ``fine-tune_hici.py``), each piece a constructor arg:

- ``attention``: ``hici`` (the paper) | ``s2`` (LongLoRA's S²-Attn, the main baseline) | ``local`` (segment-local
  only) | ``full`` (plain attention). Patched in through ``lightning_modules.common.attention``.
- ``hici``: num_segments S=4, local_slots M=8, global_slots K=4, heads 8, bottleneck_dim 512, compress_dim c=128
  (160 at 13B), expand_dim d=512, integrator_heads 8, gate_init 0.1, causal_mode (default ``causal_shift_g``,
  leak-free; ``none`` is the released code, which leaks the future — see ``hici_attention``), eval_segments 1
  (Option B prefill: "entire sequence as one group"), bias false (the release's linear maps have none),
  global_query_init ``top_norm_tokens`` (the spec's: the K highest-norm token embeddings through the compressor
  and expander) | ``xavier``.
- ``s2``: group_ratio 1/4, shift ``no_wrap`` (default, leak-free) | ``roll`` (LongLoRA's code; wraps, leaks).
- ``lora``: r=8, α=16, dropout 0 on q/k/v/o (``common.lora.apply_lora``); ``trainable``: embeddings and norms
  fully trainable; HiCI modules trainable with their own lr ``hici_lr`` (2e-4 vs 2e-5) and their own grad-norm clip
  ``hici_grad_clip``
  (0.3, HiCI parameters only; under DeepSpeed ZeRO the norm is taken over the full gradients through
  ``deepspeed.utils.safe_get_full_grad`` / ``safe_set_full_grad``).
- ``rope``: linear position interpolation with factor ceil(target_length / original_length) (original: the
  backbone's ``max_position_embeddings`` unless given).
- ``eval_mode``: ``full`` (how the paper measures perplexity: HiCI modules dropped, LoRA merged, plain attention;
  ``full_model()`` returns that plain transformers model) | ``hici`` (modules kept for prefill).
- ``evaluation``: the test loop's long-context suite: sliding-window perplexity at ``ppl_lengths`` (stride
  ``ppl_stride``) on the validation stream and passkey retrieval at ``passkey_lengths`` (``passkey_samples`` each),
  scored from greedy generated tokens. Every rank evaluates its share of the windows and samples (the same number
  of forward passes on each, as sharded weights need) and the counts are summed over ranks.
- ``export_dir``: where fit writes the ``full`` model (gathered from the shards under FSDP2; under ZeRO-3, convert
  the checkpoint first and call ``full_model()``).
- Padding: the attention mask is honoured in the slots, the statistics and the broadcast (``hici_attention``), and
  the loss ignores padded labels.

Added parameters (tests/test_hici.py, LLaMA-2-7B on the meta device, no biases as released): 12.16M per layer
(8.42M local + 3.74M global), 389.1M in all = 5.77% of the base model, 5.46% of the adapted model — the spec's
arithmetic (~5.7%) and the abstract page's "<5.5%" agree once the latter is read as a fraction of base + added; LoRA
adds 8.4M more. (With ``bias: true``: 389.5M, 5.78%.)
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
from typing import Any, Mapping

import torch

from lightning_modules.common.attention import (attention_enabled, attention_modules, patch_attention,
                                                 set_linear_rope_scaling, unpatch_attention)
from lightning_modules.common.backbone import build_backbone
from lightning_modules.common.lm import CausalLMModule
from lightning_modules.common.lora import apply_lora, merge_lora
from lightning_modules.hici.hici_attention import (QUERY_INITS, GlobalIntegrator, HiCICore, LocalConstructor,
                                                   is_partitioned)
from lightning_modules.hici.s2attn import LocalCore, S2Core

log = logging.getLogger(__name__)

ATTENTIONS = ("hici", "s2", "local", "full")
HICI_KEYS = ("local_constructor", "global_integrator")
HICI_DEFAULTS = dict(num_segments=4, local_slots=8, global_slots=4, heads=8, bottleneck_dim=512, compress_dim=128,
                     expand_dim=512, integrator_heads=8, gate_init=0.1, causal_mode="causal_shift_g", eval_segments=1,
                     bias=False, global_query_init="top_norm_tokens")
S2_DEFAULTS = dict(group_ratio=0.25, shift="no_wrap")
LORA_DEFAULTS = dict(enabled=True, r=8, alpha=16, dropout=0.0, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
ROPE_DEFAULTS = dict(type="linear", target_length=None, original_length=None)
EVAL_DEFAULTS = dict(ppl_lengths=[], ppl_stride=None, ppl_max_tokens=None, passkey_lengths=[], passkey_samples=0,
                     passkey_new_tokens=8)


def _merge(defaults: dict, given: Mapping | None, what: str) -> dict:
    given = dict(given or {})
    unknown = set(given) - set(defaults)
    if unknown:
        raise ValueError(f"model.{what} has unknown keys {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **given}


def attach_hici(model, cfg: Mapping[str, Any]) -> list:
    """Register a LocalConstructor and a GlobalIntegrator on every attention layer (before LoRA wrapping), on the
    layer's device and dtype, the global queries initialised as ``global_query_init`` says. Returns the layers."""
    cfg = {**HICI_DEFAULTS, **cfg}
    if cfg["global_query_init"] not in QUERY_INITS:
        raise ValueError(f"hici.global_query_init={cfg['global_query_init']!r}: choose one of {', '.join(QUERY_INITS)}")
    layers = attention_modules(model)
    top_norm = cfg["global_query_init"] == "top_norm_tokens"
    embeddings = [model.get_input_embeddings().weight] if top_norm else []
    for attn in layers:
        hidden, w = attn.config.hidden_size, attn.q_proj.weight
        with torch.device(w.device):
            attn.local_constructor = LocalConstructor(hidden, cfg["local_slots"], cfg["bottleneck_dim"], cfg["heads"],
                                                      cfg["bias"]).to(w.dtype)
            attn.global_integrator = GlobalIntegrator(hidden, cfg["global_slots"], cfg["compress_dim"], cfg["expand_dim"],
                                                      cfg["integrator_heads"], cfg["gate_init"], cfg["bias"]).to(w.dtype)
        gi = attn.global_integrator
        with gathered([*gi.parameters(), *embeddings]):  # ZeRO-3 partitions at construction: init the full tensors
            if is_partitioned(gi):
                gi.reset_parameters()
            if top_norm:
                gi.init_queries(embeddings[0])
    return layers


def gathered(params):
    """A context in which ZeRO-3-partitioned ``params`` are whole and may be written (rank 0's values are kept);
    nothing to do otherwise."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def is_hici_param(name: str) -> bool:
    return any(k in name for k in HICI_KEYS)


def rope_factor(target_length: int | None, original_length: int) -> int:
    """LongLoRA/HiCI's position-interpolation factor: ceil(target / original), never below 1."""
    if not target_length:
        return 1
    return max(1, math.ceil(target_length / original_length))


class HiCILongContextLM(CausalLMModule):
    """Long-context adaptation with HiCI (or S²-Attn / local / full attention) + LoRA + PI. See the module docstring."""

    def __init__(self, backbone: Mapping[str, Any], optimizer=None, scheduler=None, weight_decay: float = 0.0,
                 attention: str = "hici", hici: Mapping | None = None, s2: Mapping | None = None,
                 lora: Mapping | None = None, trainable: list[str] | tuple = ("embed", "norm"),
                 hici_lr: float = 2e-4, hici_grad_clip: float | None = 0.3, rope: Mapping | None = None,
                 eval_mode: str = "full", evaluation: Mapping | None = None, export_dir: str | None = None):
        if attention not in ATTENTIONS:
            raise ValueError(f"model.attention={attention!r}: choose one of {', '.join(ATTENTIONS)}")
        if eval_mode not in ("full", "hici"):
            raise ValueError(f"model.eval_mode={eval_mode!r}: choose full (the paper's) or hici")
        super().__init__(backbone, optimizer, scheduler, weight_decay)
        self.attention = attention
        self.hici_cfg = _merge(HICI_DEFAULTS, hici, "hici")
        self.s2_cfg = _merge(S2_DEFAULTS, s2, "s2")
        self.lora_cfg = _merge(LORA_DEFAULTS, lora, "lora")
        self.rope_cfg = _merge(ROPE_DEFAULTS, rope, "rope")
        self.eval_cfg = _merge(EVAL_DEFAULTS, evaluation, "evaluation")
        if self.rope_cfg["type"] != "linear":
            raise ValueError(f"model.rope.type={self.rope_cfg['type']!r}: only linear position interpolation (the "
                             "recipe's default) is implemented")
        self.trainable = list(trainable)
        self.hici_lr, self.hici_grad_clip = hici_lr, hici_grad_clip
        self.eval_mode, self.export_dir = eval_mode, export_dir
        self.results: dict = {}

    # --- model -----------------------------------------------------------------------------------
    def make_core(self):
        if self.attention == "hici":
            return HiCICore(self.hici_cfg["num_segments"], self.hici_cfg["causal_mode"], self.hici_cfg["eval_segments"])
        if self.attention == "s2":
            return S2Core(self.s2_cfg["group_ratio"], self.s2_cfg["shift"])
        if self.attention == "local":
            return LocalCore(self.hici_cfg["num_segments"])
        return None

    def build_model(self):
        model = build_backbone(self.backbone_spec)
        original = self.rope_cfg["original_length"] or model.config.max_position_embeddings
        factor = rope_factor(self.rope_cfg["target_length"], original)
        set_linear_rope_scaling(model, factor)
        self.rope_factor_used = factor
        if self.attention == "hici":
            attach_hici(model, self.hici_cfg)
        core = self.make_core()
        if core is not None:
            patch_attention(model, core)
        if self.lora_cfg["enabled"]:
            model = apply_lora(model, self.lora_cfg["r"], self.lora_cfg["alpha"], self.lora_cfg["dropout"],
                               self.lora_cfg["targets"], trainable=[*self.trainable, *HICI_KEYS])
        return model

    def plain_model(self):
        """The transformers model under the peft wrapper (or the model itself without LoRA)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def full_model(self, state_dict: dict | None = None):
        """The `full` inference model: a copy with LoRA merged, HiCI modules dropped and plain attention — a plain
        transformers model (save_pretrained / from_pretrained round-trip). With ``state_dict`` (the gathered weights
        of a sharded model) a fresh unsharded copy is built and loaded instead of copying the sharded one."""
        if state_dict is None:
            model = copy.deepcopy(self.model)
        else:
            model = self.build_model()
            model.load_state_dict(state_dict)
        model = merge_lora(model)
        for attn in attention_modules(model):
            for key in HICI_KEYS:
                if key in attn._modules:
                    del attn._modules[key]
        unpatch_attention(model)
        return model

    def _eval_context(self):
        return attention_enabled(self.model, self.eval_mode == "hici")

    # --- loss and evaluation ---------------------------------------------------------------------
    def compute_loss(self, batch):
        mask = batch.get("attention_mask")
        if mask is not None and self.attention in ("s2", "local") and not bool(mask.all()):
            raise ValueError(f"model.attention={self.attention} trains on packed, unpadded sequences; this batch "
                             "has padding (use datamodules.long_context / packed data, or model.attention=hici)")
        if mask is not None:  # padded positions are never targets
            batch = {**batch, "labels": batch["labels"].masked_fill(mask == 0, -100)}
        return super().compute_loss(batch)

    @torch.no_grad()
    def token_nll(self, batch):
        with self._eval_context():
            return super().token_nll(batch)

    def on_test_epoch_end(self):
        super().on_test_epoch_end()
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None:
            return
        self.results.update(self.long_context_eval(dm))  # on every rank: sharded weights need all of them
        for k, v in self.results.items():
            if isinstance(v, (int, float)):
                self.log(f"test/{k}", float(v))  # already reduced: the same value on every rank
        if not self.trainer.is_global_zero:
            return
        from lightning_modules.common.dashboard import curve, log_table

        by = {m: {int(k.split("@")[1]): v for k, v in self.results.items() if k.startswith(m + "@")} for m in ("ppl", "passkey")}
        log_table("long_context/by_length", [{"context_length": n, "ppl": by["ppl"].get(n), "passkey": by["passkey"].get(n)}
                                             for n in sorted(set(by["ppl"]) | set(by["passkey"]))], self.loggers)
        for m, label in (("ppl", "perplexity"), ("passkey", "passkey accuracy")):
            if by[m]:
                curve(f"long_context/{m}", {self.eval_cfg.get("mode", m): (sorted(by[m]), [by[m][n] for n in sorted(by[m])])},
                      self.loggers, xlabel="context length (tokens)", ylabel=label, logx=True)

    @torch.no_grad()
    def long_context_eval(self, dm) -> dict:
        """Sliding-window perplexity at several lengths and passkey retrieval, in ``eval_mode``. Each rank takes its
        share of windows and samples; sums are reduced over ranks, so every rank returns the same figures."""
        from datamodules.synthetic import passkey_sample
        from lightning_modules.common.evaluation import greedy_generate, perplexity, string_match_part

        cfg, out = self.eval_cfg, {}
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self._trainer is not None else (0, 1)

        def total(*values):  # summed over ranks
            t = torch.tensor(values, dtype=torch.float64, device=self.device)
            return (self.trainer.strategy.reduce(t, reduce_op="sum") if world > 1 else t).tolist()

        was_training = self.model.training
        self.model.eval()
        with self._eval_context():
            tokens = dm.eval_tokens()
            if cfg["ppl_max_tokens"]:
                tokens = tokens[: cfg["ppl_max_tokens"]]
            for length in cfg["ppl_lengths"]:
                if len(tokens) < 2 * length:
                    out[f"ppl@{length}"] = float("nan")
                    continue
                stride = cfg["ppl_stride"] or length // 4
                r = perplexity(self.model, tokens, seq_len=length, stride=min(stride, length), batch_size=1,
                               shard=(rank, world))
                nll, n = total(r["nll"], r["tokens"])
                out[f"ppl@{length}"] = math.exp(nll / n)
            n = cfg["passkey_samples"]
            for length in cfg["passkey_lengths"] if n else []:
                hits = 0.0
                for i in range(rank, n + (-n % world), world):  # the same number of generate calls on every rank
                    s = passkey_sample(dm.tokenizer, length, seed=10_000 + min(i, n - 1))
                    pred = greedy_generate(self.model, dm.tokenizer, [s["prompt"]], cfg["passkey_new_tokens"],
                                           synced_gpus=world > 1)[0]
                    hits += string_match_part(pred, [s["answer"]]) if i < n else 0.0
                out[f"passkey@{length}"] = total(hits)[0] / n
        self.model.train(was_training)
        return out

    def on_fit_end(self):
        if not self.export_dir:
            return
        if getattr(self.trainer.strategy, "zero_stage_3", False):
            # rebuilding an unsharded copy on rank 0 alone would re-enter ZeRO-3's collective construction
            # (transformers sees the run's DeepSpeed config): convert the checkpoint, then call full_model()
            if self.trainer.global_rank == 0:
                log.warning("model.export_dir: not written under ZeRO-3; convert the checkpoint to fp32 "
                            "(lightning.pytorch.utilities.deepspeed) and export with full_model()")
            return
        state = self._gathered_state_dict()  # a collective under FSDP2: every rank takes part
        if self.trainer.global_rank == 0:
            self.full_model(state).save_pretrained(self.export_dir)
            tok = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
            if tok is not None:
                tok.save_pretrained(self.export_dir)

    def _gathered_state_dict(self) -> dict | None:
        """The full weights on rank 0 when FSDP2 shards them (DTensors); None otherwise."""
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return None

    # --- optimisation ----------------------------------------------------------------------------
    def _named_trainable(self):
        model = self.trainer.model if self._trainer is not None else self
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def param_groups(self) -> list[dict]:
        hici = [p for n, p in self._named_trainable() if is_hici_param(n)]
        base = [p for n, p in self._named_trainable() if not is_hici_param(n)]
        return [{"params": base, "weight_decay": self.weight_decay},
                {"params": hici, "weight_decay": self.weight_decay, "lr": self.hici_lr}]

    def hici_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self._named_trainable() if is_hici_param(n)]

    def on_before_optimizer_step(self, optimizer):
        if self.hici_grad_clip:
            clip_hici_gradients(self.hici_parameters(), self.hici_grad_clip, self._deepspeed_zero())

    def _deepspeed_zero(self) -> bool:
        return self._trainer is not None and "DeepSpeed" in type(self.trainer.strategy).__name__

    def parameter_counts(self) -> dict[str, int]:
        counts = super().parameter_counts()
        if self.model is not None:
            counts["params/hici"] = sum(p.numel() for n, p in self.model.named_parameters() if is_hici_param(n))
            counts["params/lora"] = sum(p.numel() for n, p in self.model.named_parameters() if "lora_" in n)
        return counts


@torch.no_grad()
def clip_hici_gradients(params, max_norm: float, deepspeed: bool = False) -> float:
    """Clip the global L2 norm of ``params``' gradients to ``max_norm`` (HiCI parameters only); returns the norm
    before clipping. Under DeepSpeed ZeRO, ``p.grad`` is not the full gradient: read and write the full gradient
    through DeepSpeed's accessors instead."""
    if deepspeed:
        from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

        grads = [(p, safe_get_full_grad(p)) for p in params]
        grads = [(p, g) for p, g in grads if g is not None]
        if not grads:
            return 0.0
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for _, g in grads]))
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if coef < 1:
            for p, g in grads:
                safe_set_full_grad(p, g * coef.to(g.dtype))
        return float(norm)
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
