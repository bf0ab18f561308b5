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
- ``attention_impl``: ``auto`` (FlexAttention on CUDA, block-wise elsewhere) | ``flex`` | ``blockwise`` compute the
  cores' patterns and the layers' padding masks without N × N tensors (``common.block_attention``); ``sdpa_dense``
  is the dense-mask code (the reference; the release's way).
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
  ``ppl_stride``) on the datamodule's evaluation stream (``data.test_files``: PG-19 test / Proof-pile, else the
  held-out split), ``ppl_protocol`` ``once`` (every token scored once) or ``release`` (the release's
  eval_distributed_hici.py: a window every ``ppl_stride`` tokens, each fully scored); passkey retrieval at
  ``passkey_lengths`` plus every ``passkey_interval`` tokens up to ``passkey_max_length`` (``passkey_samples``
  each), scored from greedy generated tokens; LongBench v1 (``longbench_*``, ``lightning_modules.hici.longbench``)
  and LongEval topic retrieval (``topics_*``, ``lightning_modules.hici.topics``) from local jsonl. Every rank
  evaluates its share of the windows and samples (the same number of forward passes on each, as sharded weights
  need) and the counts are summed over ranks.
- ``init_from``: a single-file checkpoint of this module to start from (the SFT stage starts from the HiCI run's).
- ``export_dir``: where fit writes the ``full`` model (gathered from the shards under FSDP2 and ZeRO-3).
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
from pathlib import Path
from typing import Any, Mapping

import torch

from callbacks.deepspeed_hf import unpartitioned
from lightning_modules.common.attention import (attention_enabled, attention_modules, patch_attention,
                                                 set_linear_rope_scaling, unpatch_attention)
from lightning_modules.common.backbone import build_backbone
from lightning_modules.common.block_attention import check_impl, unuse_block_attention, use_block_attention
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
EVAL_DEFAULTS = dict(ppl_lengths=[], ppl_stride=None, ppl_max_tokens=None, ppl_protocol="once", passkey_lengths=[],
                     passkey_interval=None, passkey_max_length=None, passkey_samples=0, passkey_new_tokens=8,
                     chat_template="[INST]{prompt}[/INST]", longbench_dir=None, longbench_config_dir=None,
                     longbench_tasks=[], longbench_max_length=15500, longbench_max_samples=None, topics_files=None,
                     topics_max_samples=None, topics_new_tokens=50)
PPL_PROTOCOLS = ("once", "release")


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
                 eval_mode: str = "full", evaluation: Mapping | None = None, export_dir: str | None = None,
                 init_from: str | None = None, attention_impl: str = "auto"):
        if attention not in ATTENTIONS:
            raise ValueError(f"model.attention={attention!r}: choose one of {', '.join(ATTENTIONS)}")
        if eval_mode not in ("full", "hici"):
            raise ValueError(f"model.eval_mode={eval_mode!r}: choose full (the paper's) or hici")
        super().__init__(backbone, optimizer, scheduler, weight_decay)
        self.attention, self.attention_impl = attention, check_impl(attention_impl)
        self.hici_cfg = _merge(HICI_DEFAULTS, hici, "hici")
        self.s2_cfg = _merge(S2_DEFAULTS, s2, "s2")
        self.lora_cfg = _merge(LORA_DEFAULTS, lora, "lora")
        self.rope_cfg = _merge(ROPE_DEFAULTS, rope, "rope")
        self.eval_cfg = _merge(EVAL_DEFAULTS, evaluation, "evaluation")
        if self.eval_cfg["ppl_protocol"] not in PPL_PROTOCOLS:
            raise ValueError(f"model.evaluation.ppl_protocol={self.eval_cfg['ppl_protocol']!r}: choose once (every "
                             "token scored once) or release (HiCI/LongLoRA's eval: every window fully scored)")
        from lightning_modules.hici import longbench

        longbench.check_tasks(self.eval_cfg["longbench_tasks"])
        if self.eval_cfg["longbench_tasks"] and not self.eval_cfg["longbench_dir"]:
            raise ValueError("model.evaluation.longbench_tasks needs model.evaluation.longbench_dir=<LongBench data dir>")
        if init_from is not None and not str(init_from).endswith((".ckpt", ".pt", ".bin")):
            raise ValueError(f"model.init_from={init_from!r}: give a single-file checkpoint (.ckpt/.pt/.bin); convert a "
                             "DeepSpeed checkpoint dir first with lightning.pytorch.utilities.deepspeed."
                             "convert_zero_checkpoint_to_fp32_state_dict")
        self.init_from = init_from
        if self.rope_cfg["type"] != "linear":
            raise ValueError(f"model.rope.type={self.rope_cfg['type']!r}: only linear position interpolation (the "
                             "recipe's default) is implemented")
        self.trainable = list(trainable)
        self.hici_lr, self.hici_grad_clip = hici_lr, hici_grad_clip
        self.eval_mode, self.export_dir = eval_mode, export_dir
        self.results: dict = {}

    # --- model -----------------------------------------------------------------------------------
    def make_core(self):
        impl = self.attention_impl
        if self.attention == "hici":
            return HiCICore(self.hici_cfg["num_segments"], self.hici_cfg["causal_mode"], self.hici_cfg["eval_segments"],
                            impl)
        if self.attention == "s2":
            return S2Core(self.s2_cfg["group_ratio"], self.s2_cfg["shift"], impl)
        if self.attention == "local":
            return LocalCore(self.hici_cfg["num_segments"], impl)
        return None

    def build_model(self):
        if self.init_from and not Path(self.init_from).is_file():  # before loading billions of weights
            raise FileNotFoundError(f"model.init_from={self.init_from} does not exist: train the HiCI stage first (and "
                                    "convert its DeepSpeed checkpoint to one file)")
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
        use_block_attention(model, self.attention_impl)  # padded batches: the 2-D mask, not transformers' N x N one
        if self.lora_cfg["enabled"]:
            model = apply_lora(model, self.lora_cfg["r"], self.lora_cfg["alpha"], self.lora_cfg["dropout"],
                               self.lora_cfg["targets"], trainable=[*self.trainable, *HICI_KEYS])
        if self.init_from:
            load_weights(model, self.init_from)
        return model

    @classmethod
    def preflight_model(cls, model_cfg: Mapping[str, Any], backbone):
        """The parameters ``build_model`` adds to the meta backbone (``common/preflight.py``): HiCI's modules, LoRA,
        and what trains in full (the modules, ``trainable``)."""
        from lightning_modules.common.preflight import Trained

        notes = []
        if model_cfg.get("attention", "hici") == "hici":
            attach_hici(backbone, _merge(HICI_DEFAULTS, model_cfg.get("hici"), "hici"))
            notes.append("HiCI modules trained in full (their own activations are not counted)")
        lora = _merge(LORA_DEFAULTS, model_cfg.get("lora"), "lora")
        if lora["enabled"]:
            trainable = [*model_cfg.get("trainable", ("embed", "norm")), *HICI_KEYS]
            backbone = apply_lora(backbone, lora["r"], lora["alpha"], lora["dropout"], lora["targets"],
                                  trainable=trainable)
            notes.append(f"LoRA r={lora['r']} on {', '.join(lora['targets'])}; "
                         f"{', '.join(model_cfg.get('trainable', ('embed', 'norm')))} in full")
        return Trained(backbone, notes=notes)

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
        return unuse_block_attention(model)

    def _eval_context(self):
        return attention_enabled(self.model, self.eval_mode == "hici")

    # --- loss and evaluation ---------------------------------------------------------------------
    def compute_loss(self, batch):
        mask = batch.get("attention_mask")
        if mask is not None and self.attention in ("s2", "local") and not bool(mask.all()):
            raise ValueError(f"model.attention={self.attention} trains on packed, unpadded sequences; this batch "
                             "has padding (use lightning_modules.hici.data / packed data, or model.attention=hici)")
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
            tokens = dm.eval_tokens() if cfg["ppl_lengths"] else None
            if tokens is not None and cfg["ppl_max_tokens"]:
                tokens = tokens[: cfg["ppl_max_tokens"]]
            for length in cfg["ppl_lengths"]:
                if len(tokens) < 2 * length:
                    out[f"ppl@{length}"] = float("nan")
                    continue
                stride = min(cfg["ppl_stride"] or length // 4, length)
                if cfg["ppl_protocol"] == "release":
                    nll, n = total(*release_perplexity(self.model, tokens, length, stride, (rank, world)))
                else:
                    r = perplexity(self.model, tokens, seq_len=length, stride=stride, batch_size=1, shard=(rank, world))
                    nll, n = total(r["nll"], r["tokens"])
                out[f"ppl@{length}"] = math.exp(nll / n)
            n = cfg["passkey_samples"]
            for length in passkey_grid(cfg) if n else []:
                hits = 0.0
                for i in range(rank, n + (-n % world), world):  # the same number of generate calls on every rank
                    s = passkey_sample(dm.tokenizer, length, seed=10_000 + min(i, n - 1))
                    pred = greedy_generate(self.model, dm.tokenizer, [s["prompt"]], cfg["passkey_new_tokens"],
                                           synced_gpus=world > 1)[0]
                    hits += string_match_part(pred, [s["answer"]]) if i < n else 0.0
                out[f"passkey@{length}"] = total(hits)[0] / n
            out.update(self.generation_benchmarks(dm.tokenizer, rank, world, total))
        self.model.train(was_training)
        return out

    def generation_benchmarks(self, tokenizer, rank: int, world: int, total) -> dict:
        """LongBench (English tasks) and LongEval topic retrieval from local files, greedy decoding; each rank
        generates for its share of the samples (the same number of calls on every rank)."""
        from lightning_modules.common.evaluation import greedy_generate
        from lightning_modules.hici import longbench, topics

        cfg, out = self.eval_cfg, {}

        def mean_score(prompts, scorer, new_tokens) -> float:
            n, got = len(prompts), 0.0
            for i in range(rank, n + (-n % world), world):
                pred = greedy_generate(self.model, tokenizer, [prompts[min(i, n - 1)]], new_tokens, synced_gpus=world > 1)[0]
                got += scorer(i, pred) if i < n else 0.0
            return total(got)[0] / n

        for task in cfg["longbench_tasks"]:
            recs, template, budget = longbench.load(cfg["longbench_dir"], cfg["longbench_config_dir"] or
                                                    f"{cfg['longbench_dir']}/../config", task, cfg["longbench_max_samples"])
            prompts = [longbench.build_prompt(tokenizer, task, template, r, cfg["longbench_max_length"],
                                              cfg["chat_template"]) for r in recs]
            out[f"longbench/{task}"] = 100 * mean_score(
                prompts, lambda i, p: longbench.score(task, p, recs[i]["answers"], recs[i].get("all_classes")), budget)
        if cfg["longbench_tasks"]:
            out["longbench/avg"] = sum(out[f"longbench/{t}"] for t in cfg["longbench_tasks"]) / len(cfg["longbench_tasks"])
        if cfg["topics_files"]:
            from datamodules.common.shards import _expand

            for path in _expand(cfg["topics_files"]):
                recs = topics.load(path, cfg["topics_max_samples"])
                prompts = [cfg["chat_template"].format(prompt=r["prompt"]) for r in recs]
                out[f"topics@{topics.num_topics(path)}"] = mean_score(
                    prompts, lambda i, p: topics.correct(p, recs[i]["topics"]), cfg["topics_new_tokens"])
        return out

    def on_fit_end(self):
        if not self.export_dir:
            return
        state = self._gathered_state_dict()  # a collective under FSDP2 / ZeRO-3: every rank takes part
        if self.trainer.global_rank == 0:
            with unpartitioned():  # the unsharded copy is built on rank 0 alone, not partitioned
                self.full_model(state).save_pretrained(self.export_dir)
            tok = getattr(getattr(self.trainer, "datamodule", None), "tokenizer", None)
            if tok is not None:
                tok.save_pretrained(self.export_dir)

    def _gathered_state_dict(self) -> dict | None:
        """The full weights on rank 0 (None elsewhere) when FSDP2 (DTensors) or ZeRO-3 (partitioned parameters,
        gathered one at a time so no rank holds more than one whole tensor on the device) shards them; None when
        nothing is sharded."""
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not is_partitioned(self.model):
            return None
        import deepspeed

        rank0, out = self.trainer.global_rank == 0, {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            with deepspeed.zero.GatheredParameters([t]) if hasattr(t, "ds_id") else contextlib.nullcontext():
                if rank0:
                    out[name] = t.detach().cpu().clone()
        return out if rank0 else None

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
        if not self.hici_grad_clip:
            return
        engine = getattr(self.trainer.strategy, "deepspeed_engine", None) if self._deepspeed_zero() else None
        if engine is not None and not engine.is_gradient_accumulation_boundary():
            return  # DeepSpeed accumulates in its engine (Lightning steps every micro-batch): no full gradient yet
        clip_hici_gradients(self.hici_parameters(), self.hici_grad_clip, engine is not None)

    def _deepspeed_zero(self) -> bool:
        return self._trainer is not None and "DeepSpeed" in type(self.trainer.strategy).__name__

    def parameter_counts(self) -> dict[str, int]:
        counts = super().parameter_counts()
        if self.model is not None:
            counts["params/hici"] = sum(p.numel() for n, p in self.model.named_parameters() if is_hici_param(n))
            counts["params/lora"] = sum(p.numel() for n, p in self.model.named_parameters() if "lora_" in n)
        return counts


def passkey_grid(cfg: Mapping) -> list[int]:
    """``passkey_lengths`` plus every ``passkey_interval`` tokens up to ``passkey_max_length`` (the release: 1,024-token
    steps up to ~57K), sorted."""
    grid = set(cfg["passkey_lengths"])
    if cfg["passkey_interval"] and cfg["passkey_max_length"]:
        grid |= set(range(cfg["passkey_interval"], cfg["passkey_max_length"] + 1, cfg["passkey_interval"]))
    return sorted(grid)


@torch.no_grad()
def release_perplexity(model, tokens: torch.Tensor, length: int, stride: int, shard=(0, 1)) -> tuple[float, int]:
    """HiCI's (LongLoRA's) PG-19 evaluation: windows of ``length`` tokens starting every ``stride`` tokens while a
    whole window fits (``range(0, n - length, stride)``), every next-token target of each window scored (tokens in
    overlaps count once per window). Returns this rank's (summed NLL, targets); each rank runs the same number of
    windows (a dummy one scored 0 where it has run out), as sharded weights need."""
    from lightning_modules.common.evaluation import perplexity

    starts = list(range(0, len(tokens) - length, stride))
    rank, world = shard
    starts += [None] * (-len(starts) % world)
    nll, n = 0.0, 0
    for s in starts[rank::world]:
        r = perplexity(model, tokens[(s or 0): (s or 0) + length], seq_len=length, batch_size=1)
        if s is not None:
            nll, n = nll + r["nll"], n + r["tokens"]
    return nll, n


def load_weights(model, path: str) -> None:
    """Start from a trained run's weights (the SFT stage from the HiCI checkpoint): a Lightning .ckpt of this module
    (``state_dict`` keys under ``model.``) or a plain state dict of the same model; every key must match."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    state = state.get("state_dict", state)
    state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    model.load_state_dict(state, strict=True)


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
