"""Preflight: what a run will need per GPU at its real scale, from its config alone (no weights, no data, no GPU).

``python run.py experiment=<name> debug=preflight`` prints it, writes ``preflight.json`` into the run dir and stops
(``preflight=print`` prints it, then runs). The model is built on the meta device from the backbone spec's
architecture numbers (``backbone.build_backbone(meta=True)``, never the hub checkpoint) and turned into what the run
trains by the module class's classmethod ``preflight_model(model_cfg, backbone) -> Trained`` where it has one (gates,
a grown shape, an 8-bit base, HiCI's modules, π_ref or a reference copy), else by ``default_trained``: ``model.lora``
and ``model.trainable`` as ``common/lora.apply_lora`` takes them. No module, datamodule or trainer is instantiated.
Each figure says whether it is *counted* (parameter counts times the bytes the precision and strategy store) or a
*formula*, and whether ``tests/test_preflight.py`` checks it against what a tiny CPU run really allocates.

Shapes are read from the config, each printed with the keys it came from: training micro-batch ``data.batch_size``
x ``data.seq_len`` (or ``data.n_tokens``, ``model.max_length``), RL ``model.micro_batch_size`` x
(``data.max_prompt_tokens`` + ``model.max_new_tokens``); an evaluation forward at an explicit evaluation batch
(``model.eval_batch_size``, ``data.eval_batch_size``, ``model.batch_size``) and length; generation from every
``*_new_tokens`` key with its rows (a node's ``batch_size``, else the data's; prompts x ``group_size`` for rollouts)
and context (a node's ``max_context_tokens`` / ``<prefix>_max_length``, ``data.max_prompt_tokens``, ``max_length``,
``data.seq_len``, ``max(data.lengths)``). They are the configured maxima: padded rows are usually shorter.

Per GPU (``W`` = trainer.devices x trainer.num_nodes data-parallel ranks; ``N_t`` trainable, ``N_f`` frozen):

- **weights**: every parameter at its stored dtype. ``bf16-true``/``16-true`` convert the module to 16 bits (Lightning's
  half precision plugin); DeepSpeed with any 16-bit precision holds 16-bit weights and fp32 master copies of the
  trainable ones; otherwise the dtype the model was built in (``backbone.dtype``; peft keeps LoRA adapters in fp32).
- **gradients**: ``N_t`` at the weight dtype. **optimizer states**: ``N_t`` x states x bytes: Adam-family 2 states,
  SGD/LARS 1, Muon 1 on hidden matrices and 2 elsewhere; at the parameter dtype (torch keeps ``zeros_like(p)``), fp32
  under DeepSpeed, 1 byte in an 8-bit optimizer (``adamw_8bit: true`` or a bitsandbytes ``_target_``).
- **sharding** (ZeRO accounting, Rajbhandari et al. 2020, "ZeRO", §3): DDP replicates all (+ DDP's gradient buckets,
  as large as the gradients: ``gradient_as_bucket_view`` is off); FSDP2 (``ModelParallelStrategy``) and ZeRO-3 divide
  all by ``W`` and gather two layers at a time; ZeRO-2 replicates the weights and divides gradients, master copies and
  states (+ Lightning's 2e8 + 2e8-element reduce / all-gather buckets); ``offload_optimizer`` moves master copies and
  states to host memory, ``offload_parameters`` the weights too (reported per node).
- **activations** (formula: the bytes each layer saves for backward, counted op by op in transformers' LLaMA block
  the way Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.1, count GPT's;
  here pre-norm RMSNorm computed in fp32, separate q/k/v projections, grouped-query attention through a fused kernel
  (SDPA / flash: no s² scores, an fp32 log-sum-exp per head), SwiGLU, no dropout). Per token and layer, with ``h``
  hidden, ``a``/``k`` query/KV heads of ``d``, ``I`` intermediate, ``n`` norms, ``p`` the compute dtype's bytes and
  ``r`` the residual stream's (the parameter dtype under autocast, else ``p``):
  norms ``n·((4 + r + p)·h + 4)`` (an fp32 copy of the input, the normalised input, the output, the rsqrt),
  attention ``2p·(a·d) + 2p·(k·d) + 4a`` (rotated q, rotated k, v, the output, the log-sum-exp), MLP ``4p·I`` gated
  (gate, up, act, product; ``2p·I`` ungated), x top-k (+ ``2p·h`` routed copies) for a mixture of experts. Under
  autocast over fp32 weights the norms' outputs are not saved but each separate q/k/v and gate/up projection saves
  its own 16-bit cast of its input (``(3 + 2)·p·h``), and every linear its 16-bit weight copy (``2·N`` bytes for the
  model). Korthikanti's GPT count is ``34·h`` bytes per token and layer (+ ``5·a·s`` without a fused kernel).
  With gradient checkpointing each layer's input (``r·h``) stays, plus the larger of one recomputed layer's full set
  and the head's. The LM head holds the logits (``p·V``) and the fp32 log-softmax (``4·V``) per token, and one more
  fp32 logits-sized tensor at a time (the upcast copy, then the log-softmax's gradient). The test checks the layer
  formula to 2% (fp32, bf16, autocast) and the model's to 5% on a tiny LLaMA; checkpointing is formula only, and other
  blocks (GPT-2's GELU and dropout, parallel residual, q/k-norm, MoE routing; sandwich norms are counted by their norm
  modules) are approximations, said in the output.
- **KV cache** (formula, checked against a ``DynamicCache``): ``rows x (prompt + new tokens) x layers x 2 x kv_heads x
  head_dim x p``, sliding-window layers capped at their window; ``rows`` = prompts x group size for RL rollouts; the
  prefill's working set (no logits but the last position's) on top.
- **helper models** (counted): a frozen model a run loads whole on every GPU beside the trained one (a reward model,
  ``HELPERS``), from its directory's ``config.json`` on the meta device at its configured dtype; said in a note where
  the directory is not there yet.
Peak = weights + gradients + states + buffers + frozen copies + helper models + the largest of (training activations, evaluation
forward, generation); CUDA context (~0.5-1 GiB) and allocator fragmentation are not counted.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

GIB = 1024 ** 3


@dataclass
class Trained:
    """What a module trains, as its ``preflight_model`` hook returns it.

    ``model``: on the meta device, as the run holds it: ``requires_grad`` marks what trains, each tensor's dtype what is
    stored (an 8-bit base: int8 weights); None for a run with no local model (an API endpoint). ``copies``: frozen full
    copies of the weights held beside it (π_ref, a full-precision reference). ``offload_blocks``: the decoder blocks
    (of the model and its copies) live in host memory and one block at a time visits the GPU (a quantizer's
    ``model.offload``). ``checkpointing``: set where the module
    turns gradient checkpointing on itself. ``micro_batches``: forwards the module splits each data batch into
    (its own gradient accumulation). ``notes``: one line each, printed under the table."""
    model: Any
    copies: int = 0
    offload_blocks: bool = False
    checkpointing: bool | None = None
    micro_batches: int = 1
    notes: list[str] = field(default_factory=list)


# --- what trains ------------------------------------------------------------------------------------------------

def lora_convention(model_cfg: Mapping[str, Any], model, within: str | None = None):
    """``model.lora`` (``apply_lora``'s arguments; ``enabled: false`` or null = off) and ``model.trainable`` (name
    substrings trained in full) applied to a (meta) model, as the modules that adapt a frozen backbone do."""
    lora = model_cfg.get("lora")
    if not isinstance(lora, Mapping) or not lora.get("enabled", True) or not lora.get("r"):
        return model
    from lightning_modules.common.lora import apply_lora

    kwargs = {k: v for k, v in lora.items() if k in ("r", "alpha", "dropout", "targets")}
    trainable = list(model_cfg.get("trainable") or []) + list(lora.get("trainable") or [])
    return apply_lora(model, trainable=trainable, within=within, **kwargs)


def default_trained(model_cfg: Mapping[str, Any], backbone) -> Trained:
    """The hook's default: the backbone, with LoRA where ``model.lora`` asks for it (a VLM's adapters on its language
    model only)."""
    within = _language_model_name(backbone) if _is_vlm(backbone) else None
    model = lora_convention(model_cfg, backbone, within=within)
    notes = [f"LoRA r={model_cfg['lora']['r']} on {', '.join(model_cfg['lora'].get('targets') or ['q/k/v/o'])}"
             + (f" + {', '.join(model_cfg.get('trainable'))} in full" if model_cfg.get("trainable") else "")] \
        if model is not backbone else []
    return Trained(model, notes=notes)


def int8_base(model):
    """A meta model as ``BitsAndBytesConfig(load_in_8bit=True)`` + peft's ``prepare_model_for_kbit_training`` hold it:
    every ``nn.Linear`` weight but the LM head's in int8 (LLM.int8; its per-row scales are not counted), every other
    floating parameter upcast to fp32, all frozen."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod is not head:
            mod.weight = torch.nn.Parameter(torch.empty(mod.weight.shape, dtype=torch.int8, device="meta"),
                                            requires_grad=False)
    for p in model.parameters():
        p.requires_grad_(False)
        if p.is_floating_point():
            p.data = p.data.to(torch.float32)
    return model


def _is_vlm(model) -> bool:
    config = getattr(model, "config", None)
    return config is not None and getattr(config, "vision_config", None) is not None


def _language_model_name(model) -> str | None:
    return next((n for n, _ in model.named_modules() if n.endswith("language_model")), None)


def build_trained(cfg: DictConfig) -> tuple[Trained, Any]:
    """The meta model the run trains and the backbone's transformers config (its text config for a VLM)."""
    from hydra.utils import get_object

    from lightning_modules.common.backbone import build_backbone

    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    spec = OmegaConf.to_container(cfg.backbone, resolve=True) if cfg.get("backbone") else None
    # checkpointing is read from the spec by the estimate; enabling it on a meta model only warns
    backbone = build_backbone({**spec, "gradient_checkpointing": False}, meta=True) if spec else None
    cls = get_object(model_cfg["_target_"]) if "_target_" in model_cfg else None
    hook = getattr(cls, "preflight_model", None)
    import torch

    with torch.device("meta"):  # what a hook adds (adapters, gates) is built on the meta device too: no memory, no init
        trained = hook(model_cfg, backbone) if hook is not None else default_trained(model_cfg, backbone)
    config = _text_config(trained.model) if trained.model is not None else None
    return trained, config


def _text_config(model):
    from transformers import PretrainedConfig

    for mod in model.modules():
        config = getattr(mod, "config", None)
        if isinstance(config, PretrainedConfig):
            return config.get_text_config() if hasattr(config, "get_text_config") else config
    return None


# --- bytes per parameter ----------------------------------------------------------------------------------------

@dataclass
class Strategy:
    name: str                 # single | ddp | fsdp | zero2 | zero3
    world: int
    offload_states: bool = False
    offload_weights: bool = False

    @property
    def deepspeed(self) -> bool:
        return self.name.startswith("zero")


def strategy_of(cfg: DictConfig) -> Strategy:
    tr = cfg.trainer
    devices = tr.get("devices", 1)
    n = devices if isinstance(devices, int) else (len(devices) if not isinstance(devices, str) else 1)
    world = max(n, 1) * int(tr.get("num_nodes") or 1)
    strategy = tr.get("strategy")
    target = strategy.get("_target_", "") if isinstance(strategy, DictConfig) else str(strategy or "")
    if "deepspeed" in target.lower():
        if not isinstance(strategy, DictConfig):  # Lightning's registry names: deepspeed_stage_3_offload
            stage = int(re.search(r"stage_(\d)", target).group(1)) if "stage_" in target else 2
            return Strategy(f"zero{stage}", world, "offload" in target, "offload" in target and stage == 3)
        stage = int(strategy.get("stage", 2))
        return Strategy(f"zero{stage}", world, bool(strategy.get("offload_optimizer")),
                        bool(strategy.get("offload_parameters")) and stage == 3)
    if "ModelParallel" in target or "fsdp" in target.lower():
        return Strategy("fsdp", world)
    if world > 1 or "DDP" in target or "ddp" in target:
        return Strategy("ddp", world)
    return Strategy("single", 1)


def _precision(cfg: DictConfig) -> str:
    return str(cfg.trainer.get("precision", "32-true"))


def _half_true(precision: str) -> bool:
    return precision in ("bf16-true", "16-true", "bf16", "16", "half")


def _sixteen(precision: str) -> bool:
    return "16" in precision


def optimizer_states(model_cfg: Mapping[str, Any]) -> tuple[str, float, int]:
    """(name, states per trainable parameter (Muon: per hidden matrix; 2 elsewhere), 1 for 8-bit states else 0)."""
    opt = model_cfg.get("optimizer") or {}
    words = " ".join(str(v) for k, v in opt.items() if k in ("_target_", "optimizer", "name")).lower()
    eight = "8bit" in words or "bitsandbytes" in words or _find(model_cfg, "adamw_8bit") is True
    for key, states in (("muon", 1), ("lars", 1), ("sgd", 1), ("adafactor", 1)):
        if key in words:
            return key, states, 0
    name = "adamw 8-bit" if eight else (opt.get("optimizer") or str(opt.get("_target_", "adamw")).rsplit(".", 1)[-1])
    return str(name), 2, int(eight)


def _find(node, key: str):
    """The first value of ``key`` anywhere in a plain config tree (None when absent)."""
    if isinstance(node, Mapping):
        if key in node:
            return node[key]
        for v in node.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


def _core(model):
    """The transformers model inside what a hook returns (itself, a peft wrapper, or a container beside gates)."""
    return next((m for m in model.modules() if hasattr(m, "get_input_embeddings")), model)


def _embedding_ids(model) -> set[int]:
    out = set()
    model = _core(model)
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        mod = getattr(model, getter, lambda: None)()
        if mod is not None:
            out.update(id(p) for p in mod.parameters())
    return out


def static_memory(cfg: DictConfig, trained: Trained, model_cfg: Mapping[str, Any]) -> dict:
    """Weights, gradients, optimizer states (+ master copies), buffers and frozen copies per GPU (and per node's host
    memory where offloaded), with the parameter counts they come from."""
    st, precision = strategy_of(cfg), _precision(cfg)
    model = trained.model
    params = {id(p): p for p in model.parameters()}.values()
    trains = "fit" in str(cfg.get("task"))
    emb = _embedding_ids(model)
    opt_name, n_states, eight = optimizer_states(model_cfg)
    muon = opt_name == "muon"
    weights = grads = master = states = 0.0
    n_total = n_train = 0
    for p in params:
        n = p.numel()
        n_total += n
        size = p.element_size()
        if p.is_floating_point() and (_half_true(precision) or (st.deepspeed and _sixteen(precision))):
            size = 2
        weights += n * size
        if not (trains and p.requires_grad):
            continue
        n_train += n
        grads += n * size
        if st.deepspeed and _sixteen(precision):
            master += 4 * n
        k = 1 if muon and p.ndim >= 2 and id(p) not in emb else (2 if muon else n_states)
        states += n * k * (1 if eight else (4 if st.deepspeed else size))
    buffers, buffer_src = 0.0, ""
    gathered = 2 * _largest_block(model) * (2 if st.deepspeed and _sixteen(precision) else _bytes_per_param(model))
    if st.name == "ddp" and grads:
        buffers, buffer_src = grads, "DDP gradient buckets (gradient_as_bucket_view off)"
    elif st.deepspeed:
        buffers, buffer_src = 2 * 2e8 * 2, "DeepSpeed reduce + all-gather buckets (2e8 + 2e8 elements)"
    W = st.world
    host = 0.0
    if st.name in ("fsdp", "zero3"):
        weights, grads, master, states = weights / W, grads / W, master / W, states / W
        buffers += gathered
        buffer_src += ("; " if buffer_src else "") + "two layers gathered at a time"
    elif st.name == "zero2":
        grads, master, states = grads / W, master / W, states / W
    frozen_copies = trained.copies * weights  # held as the weights are (a deep copy of the sharded module)
    if trained.offload_blocks:  # every block in host memory (model and copies); the largest visits the GPU
        in_blocks = sum(p.numel() for layer in decoder_layers(model) for p in layer.parameters()) * weights / max(1, n_total)
        one = max((sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)), default=0) * weights / max(1, n_total)
        host += (weights + frozen_copies) * W
        weights, frozen_copies = weights - in_blocks + one, trained.copies * one
    if st.offload_states:
        host += (master + states) * W
        master = states = 0.0
    if st.offload_weights:
        host += weights * W
        weights = 0.0
    nodes = int(cfg.trainer.get("num_nodes") or 1)
    return {"params_total": n_total, "params_trainable": n_train, "optimizer": opt_name if n_train else None,
            "weights": weights, "gradients": grads, "master_weights": master, "optimizer_states": states,
            "buffers": buffers, "buffers_what": buffer_src, "frozen_copies": frozen_copies,
            "host_per_node": host / nodes if host else 0.0}


HELPERS = ("RewardModel",)  # ``_target_`` endings of frozen models loaded whole on every GPU (callbacks.deepspeed_hf)


def helper_models(model_cfg: Mapping[str, Any]) -> tuple[float, list[str]]:
    """Bytes per GPU of the frozen helper models under ``model`` (see the module docstring), and one note each."""
    import torch

    total, notes = 0.0, []

    def walk(node, path):
        nonlocal total
        if isinstance(node, Mapping):
            if str(node.get("_target_", "")).endswith(HELPERS) and node.get("path"):
                where = Path(str(node["path"])).expanduser()
                if not (where / "config.json").exists():
                    notes.append(f"{path}: no config.json at {where} yet: its whole copy per GPU is not counted")
                else:
                    from transformers import AutoConfig, AutoModelForSequenceClassification

                    with torch.device("meta"):
                        helper = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(str(where)))
                    n = sum(p.numel() for p in helper.parameters())
                    total += n * getattr(torch, str(node.get("dtype", "float32"))).itemsize
                    notes.append(f"{path}: {count_text(n)} parameters at {node.get('dtype', 'float32')}, whole on every GPU")
            for k, v in node.items():
                walk(v, f"{path}.{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    walk(model_cfg, "model")
    return total, notes


def _bytes_per_param(model) -> float:
    ps = list(model.parameters())
    return sum(p.numel() * p.element_size() for p in ps) / max(1, sum(p.numel() for p in ps))


def decoder_layers(model, config=None) -> list:
    """The language model's repeated blocks: the longest ModuleList of attention blocks (a VLM's vision tower has its
    own; the text config's layer count picks the right one)."""
    import torch

    want = getattr(config, "num_hidden_layers", None)
    best = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            names = {n.rsplit(".", 1)[-1] for n, _ in mod[0].named_modules()}
            if not names & {"self_attn", "attn", "attention", "self_attention"}:
                continue
            if len(mod) == want:
                return list(mod)
            if len(mod) > len(best):
                best = list(mod)
    return best


def _largest_block(model) -> int:
    layers = decoder_layers(model)
    biggest_layer = max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0)
    biggest_leaf = max((p.numel() for p in model.parameters()), default=0)
    return max(biggest_layer, biggest_leaf)


# --- activations and KV cache (formulas) ------------------------------------------------------------------------

@dataclass
class Block:
    """One decoder layer's shape as the activation formula needs it."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    norms: int = 2            # hidden-size norms per layer (Gemma's sandwich norms: 4)
    qk_norm: bool = False
    gated: bool = True
    separate_qkv: bool = True
    experts_per_token: int = 1
    llama_like: bool = True   # the block the formula was counted on
    window: int | None = None
    sliding_layers: int = 0


def block_of(config, model=None) -> Block:
    h = config.hidden_size
    a = config.num_attention_heads
    k = getattr(config, "num_key_value_heads", None) or a
    d = getattr(config, "head_dim", None) or h // a
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    inter = (getattr(config, "moe_intermediate_size", None) if top_k > 1 else None) or \
        getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    names, norms, qk = set(), 2, False
    layers = decoder_layers(model, config) if model is not None else []
    if layers:
        named = list(layers[0].named_modules())
        names = {n.rsplit(".", 1)[-1] for n, _ in named}
        sized = [m for n, m in named if "norm" in type(m).__name__.lower() or "ln" in n.rsplit(".", 1)[-1]]
        norms = sum(1 for m in sized if getattr(m, "weight", None) is not None and m.weight.numel() == h) or 2
        qk = bool(names & {"q_norm", "k_norm"})
    types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    sliding = sum(1 for t in types if "sliding" in str(t)) if window else 0
    gated = bool(names & {"gate_proj", "w1", "gate_up_proj", "experts"}) if names else True
    return Block(hidden=h, heads=a, kv_heads=k, head_dim=d, intermediate=inter, layers=config.num_hidden_layers,
                 vocab=config.vocab_size, norms=norms, qk_norm=qk, gated=gated,
                 separate_qkv=("q_proj" in names) if names else True, experts_per_token=top_k,
                 llama_like=config.model_type in LLAMA_LIKE, window=window, sliding_layers=sliding)


# families whose decoder block is the one the formula counts (RMSNorm pre-norm, q/k/v/o, SwiGLU, no dropout)
LLAMA_LIKE = ("llama", "mistral", "ministral", "qwen2", "qwen3", "olmo", "olmo2", "gemma", "gemma2", "gemma3_text")


def layer_activation_bytes(block: Block, tokens: int, p: int, r: int | None = None) -> float:
    """Bytes one decoder layer saves for backward for ``tokens`` = micro-batch x sequence length (module docstring)."""
    r = p if r is None else r
    h, a, k, d, inter = block.hidden, block.heads, block.kv_heads, block.head_dim, block.intermediate
    autocast = r != p
    # an fp32 copy of the input, the normalised input, the output (under autocast only its 16-bit casts, below, are
    # saved) and the fp32 rsqrt
    norms = block.norms * ((4 + r + (0 if autocast else p)) * h + 4)
    if block.qk_norm:
        norms += (4 + 2 * p) * (a + k) * d
    attn = 2 * p * a * d + 2 * p * k * d + 4 * a
    mlp_one = (4 if block.gated else 2) * p * inter
    top_k = block.experts_per_token
    mlp = top_k * mlp_one + (2 * p * h * top_k if top_k > 1 else 0)  # + the routed copies in and out
    casts = ((3 if block.separate_qkv else 1) + (2 if block.gated else 1)) * p * h if autocast else 0
    return tokens * (norms + attn + mlp + casts)


def head_activation_bytes(block: Block, tokens: int, p: int, r: int | None = None, transient: bool = True) -> float:
    """The final norm, the logits held (``p·V``) and the fp32 log-softmax the loss saves (``4·V``), per token; with
    ``transient``, one more fp32 logits-sized tensor (the upcast copy in the forward when ``p`` < 4, the log-softmax's
    gradient in the backward)."""
    r = p if r is None else r
    return tokens * ((4 + r + p) * block.hidden + (p + 4 + (4 if transient else 0)) * block.vocab)


def train_activation_bytes(block: Block, batch: int, seq: int, p: int, r: int | None = None,
                           checkpointing: bool = False, autocast_weight_bytes: float = 0.0) -> dict:
    """One micro-batch's activations: {"layers", "head"} bytes and their peak. Without checkpointing every layer's
    saved set lives until the backward reaches it, the head's on top; with it, every layer's input lives, plus either
    the head's set (start of the backward) or one recomputed layer's, whichever is larger."""
    r = p if r is None else r
    tokens = batch * seq
    one = layer_activation_bytes(block, tokens, p, r)
    head = head_activation_bytes(block, tokens, p, r)
    if checkpointing:
        inputs = block.layers * tokens * r * block.hidden
        return {"layers": inputs + one, "head": head, "peak": inputs + max(head, one) + autocast_weight_bytes}
    layers = block.layers * one
    return {"layers": layers, "head": head, "peak": layers + head + autocast_weight_bytes}


def eval_activation_bytes(block: Block, batch: int, seq: int, p: int) -> float:
    """A no-grad forward: the residual stream, one layer's MLP working set and the logits with their log-softmax."""
    tokens = batch * seq
    per_token = 2 * p * block.hidden + 3 * p * block.intermediate * block.experts_per_token
    return tokens * (per_token + p * block.vocab + 8 * block.vocab)


def prefill_bytes(block: Block, rows: int, prompt: int, p: int) -> float:
    """Generation's prefill, no grad: the residual stream and one layer's MLP working set over the prompt, and the
    last position's logits only (what ``generate`` keeps)."""
    return rows * prompt * (2 * p * block.hidden + 3 * p * block.intermediate * block.experts_per_token) + \
        rows * (p + 8) * block.vocab


def kv_cache_bytes(block: Block, rows: int, tokens: int, p: int) -> float:
    """rows x tokens x layers x 2 (K and V) x kv_heads x head_dim x p; sliding-window layers hold their window."""
    per_token_layer = 2 * block.kv_heads * block.head_dim * p
    full = block.layers - block.sliding_layers
    capped = min(tokens, block.window) if block.window else tokens
    return rows * per_token_layer * (full * tokens + block.sliding_layers * capped)


# --- the run's shapes (read from the config, each with the keys it came from) ----------------------------------

def _first(*pairs):
    """The first (value, key) whose value is set."""
    for value, key in pairs:
        if value is not None and value != []:
            return value, key
    return None, None


def workloads(cfg: DictConfig, model_cfg: Mapping[str, Any], config) -> dict:
    """Training micro-batch, evaluation forward and generation shapes, each {batch/rows, tokens, from}."""
    data = OmegaConf.to_container(cfg.data, resolve=True) if isinstance(cfg.get("data"), DictConfig) else {}
    data = data or {}
    out: dict = {}
    trains = "fit" in str(cfg.get("task"))
    rl = "group_size" in model_cfg and "max_new_tokens" in model_cfg
    prompt, prompt_key = _first((data.get("max_prompt_tokens"), "data.max_prompt_tokens"))
    lengths = data.get("lengths")
    max_len = max(lengths) if isinstance(lengths, list) and lengths else None
    if trains:
        if rl and model_cfg.get("max_new_tokens"):
            mb = model_cfg.get("micro_batch_size") or data.get("batch_size") or 1
            out["train"] = {"batch": mb, "seq": (prompt or 0) + model_cfg["max_new_tokens"],
                            "from": f"model.micro_batch_size x ({prompt_key or '0'} + model.max_new_tokens)"}
        else:
            seq, key = _first((data.get("seq_len"), "data.seq_len"), (data.get("n_tokens"), "data.n_tokens"),
                              (model_cfg.get("max_length"), "model.max_length"))
            if seq:
                out["train"] = {"batch": data.get("batch_size") or 1, "seq": seq, "from": f"data.batch_size x {key}"}
    gens = list(_generations(cfg, model_cfg, data, trains, prompt, prompt_key, max_len))
    if cfg.get("task") != "fit":
        # the batch of an evaluation forward: an explicit evaluation batch, else (a run that does not generate) the
        # data's batch
        batch, bkey = _first((model_cfg.get("eval_batch_size"), "model.eval_batch_size"),
                             (data.get("eval_batch_size"), "data.eval_batch_size"),
                             (model_cfg.get("batch_size"), "model.batch_size"),
                             (None if gens else data.get("batch_size"), "data.batch_size"), (None if gens else 1, "1"))
        # model.max_length: null means the model's own limit (an evaluation harness); without any length key the
        # evaluation is generation, sized below
        limit = getattr(config, "max_position_embeddings", None) if "max_length" in model_cfg else None
        seq, skey = _first((model_cfg.get("eval_seq_len"), "model.eval_seq_len"), (data.get("seq_len"), "data.seq_len"),
                           (model_cfg.get("max_length"), "model.max_length"), (max_len, "max(data.lengths)"),
                           (limit, "max_position_embeddings (model.max_length=null)"))
        if seq and batch:
            out["eval"] = {"batch": batch, "seq": seq, "from": f"{bkey} x {skey}"}
    if gens:
        out["generate"] = max(gens, key=lambda g: g["rows"] * g["tokens"])
    return out


def _generations(cfg, model_cfg, data, trains, prompt, prompt_key, max_len):
    """Every ``*new_tokens`` setting of the model config, as rows x (prompt + new) tokens with its sources."""
    def walk(node, path):
        if not isinstance(node, Mapping):
            return
        for key, value in node.items():
            if isinstance(value, Mapping):
                yield from walk(value, f"{path}.{key}")
            elif key == "max_new_tokens" or (key.endswith("_new_tokens") and not key.startswith("val_")):
                yield node, path, key, value

    for node, path, key, new in walk(model_cfg, "model"):
        prefix = key[: -len("_new_tokens")] if key != "max_new_tokens" else ""
        if prefix and prefix != "max":
            ctx, ckey = node.get(f"{prefix}_max_length"), f"{path}.{prefix}_max_length"
            if not ctx:
                continue  # that evaluation is off (no context length of its own)
        else:
            ctx, ckey = _first((node.get("max_context_tokens"), f"{path}.max_context_tokens"), (prompt, prompt_key),
                               (node.get("max_length"), f"{path}.max_length"),
                               (model_cfg.get("max_length"), "model.max_length"), (data.get("seq_len"), "data.seq_len"),
                               (max_len, "max(data.lengths)"))
        if ctx is None and not new:
            continue
        if "group_size" in node:
            b, bkey = (data.get("batch_size"), "data.batch_size") if trains else _first(
                (data.get("eval_batch_size"), "data.eval_batch_size"), (data.get("batch_size"), "data.batch_size"))
            rows, rkey = (b or 1) * int(node["group_size"]), f"{bkey} x {path}.group_size"
        else:
            rows, rkey = _first((node.get("batch_size"), f"{path}.batch_size"),
                                (data.get("eval_batch_size"), "data.eval_batch_size"),
                                (data.get("batch_size"), "data.batch_size"), (1, "1"))
        new_note = f"{path}.{key}" if new else f"{path}.{key}=null (the task's own budget, not counted)"
        yield {"rows": rows, "prompt": ctx or 0, "new": new or 0, "tokens": (ctx or 0) + (new or 0),
               "from": f"{rkey} x ({ckey or '0'} + {new_note})"}


# --- the header -------------------------------------------------------------------------------------------------

_GPUS = re.compile(r"(\d+)\s*[x×]\s*([^,;()]{0,40}?)\b(\d+(?:\.\d+)?)\s*GB\+?", re.IGNORECASE)
_HOURS = re.compile(r"((?:under\s+|<=?\s*|~)*\d[\d,.]*(?:\s*[-–]\s*[\d,.]+)?\+?\s*GPU-hours?(?:\s+per\s+[\w(),]+)?)",
                    re.IGNORECASE)


def parse_hardware(text: str | None) -> dict:
    """GPU count and per-GPU memory (GB as written, read as GiB: an "80GB" card holds ~80 GiB) and the GPU-hours
    phrase of a ``paper.hardware`` string; None where it does not say."""
    text = str(text or "")
    m = _GPUS.search(re.split(r"[(;]", text, maxsplit=1)[0])  # the GPUs come first; asides hold other sizes
    hours = _HOURS.search(text)
    return {"gpus": int(m.group(1)) if m else None, "gpu_gib": float(m.group(3)) if m else None,
            "gpus_text": m.group(0).strip() if m else None, "gpu_hours": hours.group(1).strip() if hours else None}


# --- the whole estimate -----------------------------------------------------------------------------------------

def estimate(cfg: DictConfig) -> dict:
    """The preflight of a composed config, as a plain dict (bytes per GPU; see the module docstring)."""
    header = OmegaConf.to_container(cfg.paper, resolve=True) if isinstance(cfg.get("paper"), DictConfig) else {}
    hardware = parse_hardware(header.get("hardware"))
    st = strategy_of(cfg)
    tr = cfg.trainer
    out: dict[str, Any] = {"experiment": _experiment_name(cfg), "task": str(cfg.get("task")),
                           "strategy": st.name, "world_size": st.world, "precision": _precision(cfg),
                           "hardware": header.get("hardware"), "header_gpu_hours": hardware["gpu_hours"],
                           "header_gpu_gib": hardware["gpu_gib"], "header_gpus": hardware["gpus"],
                           "header_gpus_text": hardware["gpus_text"], "notes": []}
    steps = tr.get("max_steps") if "fit" in str(cfg.get("task")) else None
    out["optimizer_steps"] = steps if isinstance(steps, int) and steps > 0 else None
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    trained, config = build_trained(cfg)
    out["notes"] += trained.notes
    if trained.model is None:
        out["model"] = None
        out["notes"].append("no local model: nothing to place on a GPU")
        _tokens(out, cfg, header)
        return out
    static = static_memory(cfg, trained, model_cfg)
    static["helper_models"], helper_notes = helper_models(model_cfg)
    out["notes"] += helper_notes
    out.update(static)
    out["model"] = getattr(config, "model_type", None) or type(trained.model).__name__
    block = block_of(config, trained.model) if config is not None else None
    spec = cfg.get("backbone") or {}
    checkpointing = bool(spec.get("gradient_checkpointing")) if trained.checkpointing is None else trained.checkpointing
    precision = _precision(cfg)
    # the compute dtype: 16-bit under any 16-bit precision, else the dtype the embeddings (the residual stream) have
    stream = _stream_bytes(trained.model)
    p = 2 if _sixteen(precision) else stream
    autocast = "mixed" in precision and not st.deepspeed
    r = stream if autocast else p
    out["activation_dtype_bytes"], out["checkpointing"] = p, checkpointing
    # the layer formula was checked on this block (LLaMA-like, dense), without checkpointing
    out["activation_formula_checked"] = bool(block and block.llama_like and block.experts_per_token == 1
                                             and not checkpointing)
    shapes = workloads(cfg, model_cfg, config)
    if "train" in shapes and trained.micro_batches > 1:
        s = shapes["train"]
        s["batch"] = max(1, s["batch"] // trained.micro_batches)
        s["from"] = f"({s['from'].replace(' x ', f' / {trained.micro_batches} micro-batches) x ', 1)}"
    out["shapes"] = shapes
    dynamic = {}
    if block is None:
        out["notes"].append("no transformer block found: activations and KV cache not estimated")
    else:
        if not block.llama_like or block.experts_per_token > 1:
            kind = "mixture-of-experts " if block.experts_per_token > 1 else ""
            out["notes"].append(f"activations: the LLaMA-block formula applied to a {kind}{config.model_type} block "
                                "(approximate)")
        if spec.get("kind") == "image_text_to_text":
            out["notes"].append("activations: the language model only (the vision tower's are not counted)")
        if "train" not in shapes and static["params_trainable"] and "fit" in out["task"]:
            out["notes"].append("training length unknown (no data.seq_len, data.n_tokens or model.max_length): "
                                "training activations not estimated")
        if "train" in shapes and static["params_trainable"]:
            s = shapes["train"]
            copies = 2 * _linear_weights(trained.model) if r != p else 0.0
            act = train_activation_bytes(block, s["batch"], s["seq"], p, r, checkpointing, copies)
            dynamic["activations_train"], dynamic["logits_train"] = act["peak"], act["head"]
            dynamic["autocast_weight_copies"] = copies
        if "eval" in shapes:
            s = shapes["eval"]
            dynamic["activations_eval"] = eval_activation_bytes(block, s["batch"], s["seq"], p)
        if "generate" in shapes:
            g = shapes["generate"]
            dynamic["kv_cache"] = kv_cache_bytes(block, g["rows"], g["tokens"], p)
            dynamic["generate_working_set"] = prefill_bytes(block, g["rows"], g["prompt"], p)
    out.update(dynamic)
    static_total = sum(static[k] for k in ("weights", "gradients", "master_weights", "optimizer_states", "buffers",
                                           "frozen_copies", "helper_models"))
    phases = {"train": dynamic.get("activations_train", 0.0), "eval": dynamic.get("activations_eval", 0.0),
              "generate": dynamic.get("kv_cache", 0.0) + dynamic.get("generate_working_set", 0.0)}
    worst = max(phases, key=phases.get)
    out["static"], out["peak"], out["peak_phase"] = static_total, static_total + phases[worst], worst
    _tokens(out, cfg, header)
    _check_hardware(out, cfg)
    return out


def _stream_bytes(model) -> int:
    """Bytes per element of the residual stream: the input embeddings' dtype (else the mean over the parameters)."""
    emb = _core(model).get_input_embeddings() if hasattr(_core(model), "get_input_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return emb.weight.element_size()
    return 4 if _bytes_per_param(model) > 2 else 2


def _linear_weights(model) -> float:
    """Parameters of the 2-D weights autocast copies to 16 bits for every forward (linear layers and the LM head)."""
    emb = _core(model).get_input_embeddings() if hasattr(_core(model), "get_input_embeddings") else None
    skip = {id(p) for p in emb.parameters()} if emb is not None else set()
    return float(sum(p.numel() for p in model.parameters()
                     if p.ndim == 2 and id(p) not in skip and p.is_floating_point()))


def _tokens(out: dict, cfg: DictConfig, header: Mapping) -> None:
    """Global batch (data.batch_size x ranks x accumulation), tokens (x data.seq_len x max_steps) and the header's."""
    tr, data = cfg.trainer, cfg.get("data") or {}
    accumulate = int(tr.get("accumulate_grad_batches") or 1)
    batch = data.get("batch_size") if isinstance(data, DictConfig) else None
    steps = out["optimizer_steps"]
    out["global_batch"] = batch * out["world_size"] * accumulate if isinstance(batch, int) and steps else None
    seq = data.get("seq_len") if isinstance(data, DictConfig) else None
    out["tokens"] = out["global_batch"] * seq * steps if out["global_batch"] and isinstance(seq, int) else None
    out["header_tokens"] = header.get("tokens")


def _check_hardware(out: dict, cfg: DictConfig) -> None:
    gib = out["peak"] / GIB
    accelerator = str(cfg.trainer.get("accelerator", ""))
    if out["header_gpu_gib"] is None:
        out["warning"] = (f"the header's hardware names no per-GPU memory ({_short(out['hardware'], 60)!r}): "
                          f"cannot check the {gib:.1f} GiB estimate" if out["hardware"] else
                          f"no paper.hardware header: cannot check the {gib:.1f} GiB estimate")
        if accelerator == "cpu" and not out["hardware"]:
            out["warning"] = None
    elif gib > out["header_gpu_gib"]:
        out["warning"] = (f"estimated peak {gib:.1f} GiB per GPU exceeds the header's {out['header_gpu_gib']:g} GB "
                          f"({out['header_gpus_text']})")
    else:
        out["warning"] = None
    if out["header_gpus"] and out["header_gpus"] != out["world_size"]:
        out["notes"].append(f"the header names {out['header_gpus']} GPUs, the trainer runs {out['world_size']} "
                            "process(es)")


def _experiment_name(cfg: DictConfig) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get("experiment", "?")
    except Exception:  # noqa: BLE001 - composed without Hydra's runtime
        return "?"


# --- printing ---------------------------------------------------------------------------------------------------

def _gib(x: float | None) -> str:
    """Bytes in the largest binary unit below them (GiB, MiB, KiB)."""
    if not x:
        return "0"
    for unit, scale in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if x >= scale:
            return f"{x / scale:,.1f} {unit}"
    return f"{x:.0f} B"


def count_text(n: int | None) -> str:
    """A parameter count as 7.14B / 529M / 256."""
    if not n:
        return "0"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _tokens_text(batch: int, seq: int) -> str:
    return f"{batch} x {seq:,} tokens"


def _short(text: str | None, n: int = 90) -> str:
    text = str(text or "-")
    return text if len(text) <= n else text[: n - 1] + "…"


def render(report: Mapping[str, Any]) -> None:
    """The preflight as a compact table (rich), then where each shape came from, the notes and the warning."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    title = (f"preflight: {report['experiment']} ({report['task']}, {report['strategy']} x {report['world_size']}, "
             f"{report['precision']})")
    table = Table(title=title, title_justify="left")
    table.add_column("per GPU")
    table.add_column("", justify="right")
    table.add_column("how")
    shapes = report.get("shapes", {})
    if report.get("model") is not None:
        table.add_row("parameters", f"{count_text(report['params_total'])}", f"{report['model']}; "
                      f"{count_text(report['params_trainable'])} trained")
        table.add_row("weights", _gib(report["weights"]), "counted (checked)")
        table.add_row("gradients", _gib(report["gradients"]), "counted (checked)")
        opt = report["optimizer"]
        table.add_row("optimizer states", _gib(report["optimizer_states"] + report["master_weights"]),
                      "counted (checked)" + (f": {opt}" if opt else "")
                      + (", fp32 master" if report["master_weights"] else ""))
        if report["buffers"]:
            table.add_row("buffers", _gib(report["buffers"]), f"formula: {report['buffers_what']}")
        if report["frozen_copies"]:
            table.add_row("frozen copies", _gib(report["frozen_copies"]), "counted: reference / π_ref weights")
        if report.get("helper_models"):
            table.add_row("helper models", _gib(report["helper_models"]), "counted: a reward model, whole per GPU")
        if "activations_train" in report:
            s = shapes["train"]
            how = f"formula{' (checked)' if report['activation_formula_checked'] else ''}: " \
                f"{_tokens_text(s['batch'], s['seq'])}, " + \
                ("checkpointed" if report["checkpointing"] else "no checkpointing") + \
                f"; logits + loss {_gib(report['logits_train'])}"
            if report.get("autocast_weight_copies"):
                how += f"; autocast weight copies {_gib(report['autocast_weight_copies'])}"
            table.add_row("activations (train)", _gib(report["activations_train"]), how)
        if "activations_eval" in report:
            s = shapes["eval"]
            table.add_row("forward (eval)", _gib(report["activations_eval"]),
                          f"formula: {_tokens_text(s['batch'], s['seq'])}, no grad")
        if "kv_cache" in report:
            g = shapes["generate"]
            table.add_row("KV cache (generate)", _gib(report["kv_cache"]),
                          f"formula (checked): {g['rows']} row{'s' if g['rows'] != 1 else ''} x {g['tokens']:,} tokens"
                          f" (+ prefill {_gib(report['generate_working_set'])})")
        table.add_row("peak", _gib(report["peak"]), f"static {_gib(report['static'])} + {report['peak_phase']}",
                      style="bold")
        if report.get("host_per_node"):
            table.add_row("host memory / node", _gib(report["host_per_node"]), "counted: offloaded states / weights")
    steps = report.get("optimizer_steps")
    if steps:
        tokens = f"{report['tokens']:.3g}" if report.get("tokens") else "-"
        header = f"{float(report['header_tokens']):.3g}" if report.get("header_tokens") else "-"
        table.add_row("steps x batch", f"{steps:,} x {report['global_batch'] or '-'}",
                      f"tokens {tokens} (header {header})")
    table.add_row("GPU-hours", report.get("header_gpu_hours") or "-", f"header: {_short(report.get('hardware'))}")
    console.print(table)
    if report.get("model") is not None:
        console.print("  counted: parameters x bytes stored; formula: see common/preflight.py; (checked): against a "
                      "tiny CPU run by tests/test_preflight.py", highlight=False)
    for name, s in shapes.items():
        console.print(f"  {name} shape from {s['from']}", highlight=False)
    for note in report.get("notes", []):
        console.print(f"  note: {note}", highlight=False)
    if report.get("warning"):
        console.print(f"WARNING: {report['warning']}", highlight=False, style="bold yellow")


def preflight(cfg: DictConfig, write: bool = True) -> dict:
    """Estimate, print, and write ``preflight.json`` into the run dir (when the config has one)."""
    report = estimate(cfg)
    render(report)
    if write:
        try:
            out_dir = Path(cfg.paths.output_dir)
        except Exception:  # noqa: BLE001 - composed without a run dir
            out_dir = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "preflight.json").write_text(json.dumps(report, indent=2, default=str))
    return report
