"""Masked diffusion language models (LLaDA, Dream) on a transformers backbone: shared by mdlm_masks and dllmquant.

- ``make_bidirectional(model)``: every attention layer attends to the whole sequence (a core for
  ``attention.patch_attention``). No padding mask at all: LLaDA pads with EOS and attends to (and predicts) it.
- ``MaskedDiffusionLM(model, mask_token_id, logit_shift=0)``: the wrapper a method talks to.
  ``logits(ids)`` are aligned so position i predicts token i (``logit_shift=1`` for Dream, whose output at i predicts
  token i+1: its logits are shifted right by one, position 0 keeping its own). ``loss(ids, prompt_mask)`` is LLaDA's
  objective: t ~ U(0,1) per sequence, p = (1-eps) t + eps, each (non-prompt) token masked with probability p, and
  the masked tokens' cross-entropy weighted 1/p, summed and divided by B·L (pretraining) or, with a prompt mask, by
  each sequence's answer length and B (LLaDA's SFT); ``random_length_prob`` (``random_length``) first cuts the batch
  to a random length, as LLaDA's pretraining does for 1% of its data (off unless asked). ``sample(prompt, ...)`` is LLaDA's ``generate``: append
  ``gen_length`` masks, split them into semi-autoregressive blocks, and in each of ``steps / blocks`` steps unmask
  the scheduled number of tokens (LLaDA's ``get_num_transfer_tokens``), chosen by confidence (low_confidence
  remasking) or at random; Gumbel-max with ``temperature``; ``callback(step, x, transferred)`` after every step.
  As in LLaDA, a position left masked before the current block (its sampled token was [MASK]) is offered again.
  ``denoise(x, steps)`` unmasks whatever masks ``x`` holds, the study's "iterative unmasking".
- ``build_diffusion_backbone(spec)``: a backbone spec (``conf/backbone/*.yaml``) with a ``diffusion:
  {mask_token_id, logit_shift}`` block and optionally ``weight_map: llada|dream``: LLaDA ships custom code for
  transformers 4.38, so the LLaMA-shaped model is built from ``config`` and its safetensors are loaded through a
  checked key map (every checkpoint key used once, every model key filled once, shapes equal).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from lightning_modules.common.attention import is_patched, patch_attention, repeat_kv

EPS = 1e-3  # LLaDA's minimum masking probability
RANDOM_LENGTH_PROB = 0.01  # LLaDA's pretraining: the share of its data cut to a random length
REMASKING = ("low_confidence", "random")


# --- the backbone ------------------------------------------------------------------------------------------------
def bidirectional_core(attn, hidden_states, q, k, v, attention_mask) -> torch.Tensor:
    """Full (non-causal) attention; the causal/padding mask transformers built is ignored on purpose.
    ``attn._paperlab_value_hook(attn, q, k, v) -> v`` (optional; dllmquant's IA-AQ value quantizer and recorder)
    sees the expanded heads and returns the V the attention uses."""
    k, v = repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)
    hook = getattr(attn, "_paperlab_value_hook", None)
    if hook is not None:
        v = hook(attn, q, k, v)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=False, scale=attn.scaling)
    return out.transpose(1, 2)


def make_bidirectional(model):
    """Patch every attention layer of ``model`` to attend bidirectionally (in place); returns the model."""
    if not is_patched(model):
        patch_attention(model, bidirectional_core)
    model.config.use_cache = False  # a KV cache means nothing when every step re-reads the whole sequence
    return model


def is_bidirectional(model) -> bool:
    from lightning_modules.common.attention import attention_modules

    return all(getattr(a, "_paperlab_core", None) is bidirectional_core for a in attention_modules(model))


# --- the objective -----------------------------------------------------------------------------------------------
def forward_process(input_ids: torch.Tensor, mask_token_id: int, eps: float = EPS, t: torch.Tensor | None = None,
                    prompt_mask: torch.Tensor | None = None, generator: torch.Generator | None = None):
    """LLaDA's forward process: (noisy ids, masked bool, p per token). ``prompt_mask`` tokens are never masked."""
    b, n = input_ids.shape
    if t is None:
        t = torch.rand(b, device=input_ids.device, generator=generator)
    p = ((1 - eps) * t + eps)[:, None].expand(b, n)
    masked = torch.rand(b, n, device=input_ids.device, generator=generator) < p
    if prompt_mask is not None:
        masked &= ~prompt_mask.bool()
    return torch.where(masked, torch.full_like(input_ids, mask_token_id), input_ids), masked, p


def random_length(seq_len: int, prob: float, generator: torch.Generator | None = None,
                  device: torch.device | str = "cpu") -> int:
    """LLaDA's variable-length pretraining: the length a batch of ``seq_len`` tokens is cut to before the forward
    process — with probability ``prob`` one length drawn uniformly from [1, seq_len] for the whole batch, else
    ``seq_len``. LLaDA's GUIDELINES.md (ML-GSAI/LLaDA, "Pre-training") sets "1% of the pre-training data to a random
    length" this way (``torch.rand(1) < 0.01`` per batch, ``input_ids[:, :random_length]``), so the model also learns
    sequences shorter than its fixed 4,096-token context; the cut tokens are dropped (never seen, never scored) and
    the loss is divided by B times the kept length. Its SFT cuts nothing. ``prob = 0`` draws no random number, so
    the RNG stream (and every later mask) is the one without the switch."""
    if not 0 <= prob <= 1:
        raise ValueError(f"random_length_prob={prob}: a probability in [0, 1] (LLaDA's pretraining 0.01; 0 = off)")
    if prob == 0 or float(torch.rand(1, device=device, generator=generator)) >= prob:
        return seq_len
    return int(torch.randint(1, seq_len + 1, (1,), device=device, generator=generator))


def weighted_masked_ce(logits: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor, p: torch.Tensor,
                       prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
    """LLaDA's loss from aligned logits: Σ_masked CE/p over B·L, or with ``prompt_mask`` (SFT) Σ_masked CE/(p·|answer|)
    over B. ``p`` is the masking probability per token (B, L)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    token = torch.where(masked, ce / p, torch.zeros_like(ce))
    if prompt_mask is None:
        return token.sum() / targets.numel()
    answer_len = (~prompt_mask.bool()).sum(-1, keepdim=True).clamp_min(1)
    return (token / answer_len).sum() / targets.shape[0]


# --- sampling ----------------------------------------------------------------------------------------------------
def num_transfer_tokens(n_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """(B, steps): how many tokens each step unmasks, LLaDA's schedule (an even split, the remainder first)."""
    base, rem = n_masked // steps, n_masked % steps
    out = base[:, None].expand(-1, steps).clone()
    out += (torch.arange(steps, device=n_masked.device)[None] < rem[:, None]).long()
    return out


def add_gumbel_noise(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None):
    """LLaDA's Gumbel-max in float64: argmax of exp(logits) / (-log u)^T samples softmax(logits / T)."""
    if temperature == 0:
        return logits
    logits = logits.double()
    u = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    return logits.exp() / (-torch.log(u)) ** temperature


class MaskedDiffusionLM(torch.nn.Module):
    """A bidirectional backbone with its mask id: aligned logits, LLaDA's loss and sampler.

    Args:
        model: a transformers LM; made bidirectional here if it is not yet.
        mask_token_id: the [MASK] id (LLaDA 126336, Dream 151666).
        logit_shift: 0 when position i predicts token i (LLaDA), 1 when it predicts token i+1 (Dream).
    """

    def __init__(self, model, mask_token_id: int, logit_shift: int = 0):
        super().__init__()
        if mask_token_id is None or int(mask_token_id) < 0:
            raise ValueError(f"mask_token_id={mask_token_id!r}: a masked diffusion LM needs the tokenizer's [MASK] id "
                             "(backbone.diffusion.mask_token_id)")
        if logit_shift not in (0, 1):
            raise ValueError(f"logit_shift={logit_shift!r}: 0 (LLaDA: position i predicts token i) or 1 (Dream)")
        self.model = make_bidirectional(model)
        self.mask_token_id = int(mask_token_id)
        self.logit_shift = int(logit_shift)

    def logits(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, use_cache=False).logits
        if self.logit_shift:
            out = torch.cat([out[:, :1], out[:, :-1]], dim=1)
        return out

    forward = logits

    def loss(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor | None = None, eps: float = EPS,
             t: torch.Tensor | None = None, generator: torch.Generator | None = None,
             random_length_prob: float = 0.0) -> torch.Tensor:
        """LLaDA's loss on clean ``input_ids`` (pretraining; SFT when ``prompt_mask`` marks the prompt), after
        ``random_length``'s cut with ``random_length_prob`` (LLaDA's pretraining 0.01, its SFT 0; default 0: off)."""
        n = random_length(input_ids.shape[1], random_length_prob, generator, input_ids.device)
        if n < input_ids.shape[1]:
            input_ids = input_ids[:, :n]
            prompt_mask = None if prompt_mask is None else prompt_mask[:, :n]
        noisy, masked, p = forward_process(input_ids, self.mask_token_id, eps, t, prompt_mask, generator)
        return weighted_masked_ce(self.logits(noisy), input_ids, masked, p, prompt_mask)

    @torch.no_grad()
    def denoise(self, x: torch.Tensor, steps: int, temperature: float = 0.0, remasking: str = "low_confidence",
                window: tuple[int, int] | None = None, callback: Callable | None = None, step_offset: int = 0,
                generator: torch.Generator | None = None, offer_before: bool = False) -> torch.Tensor:
        """Unmask every mask of ``x`` inside ``window`` (start, end; default: all) in ``steps`` steps; returns x.
        ``offer_before``: masks before the window (the prompt's, or an earlier block's position whose sampled token
        was [MASK]) compete for the window's scheduled transfers too, as in LLaDA's ``generate``, which hides only
        the positions after the current block; the schedule still counts the window's masks alone."""
        if remasking not in REMASKING:
            raise ValueError(f"remasking={remasking!r}: choose one of {', '.join(REMASKING)}")
        x = x.clone()
        lo, hi = window or (0, x.shape[1])
        inside = torch.zeros_like(x, dtype=torch.bool)
        inside[:, lo:hi] = True
        schedule = num_transfer_tokens(((x == self.mask_token_id) & inside).sum(-1), steps)
        offered = inside.clone()
        if offer_before:
            offered[:, :lo] = True
        for i in range(steps):
            mask = (x == self.mask_token_id) & offered
            logits = self.logits(x)
            x0 = add_gumbel_noise(logits, temperature, generator).argmax(-1)
            if remasking == "low_confidence":
                conf = torch.softmax(logits.float(), dim=-1).gather(-1, x0[..., None]).squeeze(-1)
            else:
                conf = torch.rand(x0.shape, device=x.device, generator=generator)
            conf = torch.where(mask, conf, torch.full_like(conf, -float("inf")))
            transfer = torch.zeros_like(mask)
            for b in range(x.shape[0]):
                k = int(schedule[b, i])
                if k:
                    transfer[b, conf[b].topk(k).indices] = True
            x = torch.where(transfer, x0, x)
            if callback is not None:
                callback(step_offset + i, x, transfer)
        return x

    @torch.no_grad()
    def sample(self, prompt: torch.Tensor, gen_length: int = 128, steps: int = 128, block_length: int | None = None,
               temperature: float = 0.0, remasking: str = "low_confidence", callback: Callable | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """LLaDA's generate: ``prompt`` (B, P) + ``gen_length`` masks, unmasked block by block (``block_length``,
        default one block) in ``steps`` steps in all; returns (B, P + gen_length)."""
        block_length = block_length or gen_length
        if gen_length <= 0 or gen_length % block_length:
            raise ValueError(f"gen_length={gen_length} must be a positive multiple of block_length={block_length}")
        blocks = gen_length // block_length
        if steps <= 0 or steps % blocks:
            raise ValueError(f"steps={steps} must be a positive multiple of the number of blocks ({blocks})")
        masks = torch.full((prompt.shape[0], gen_length), self.mask_token_id, dtype=prompt.dtype, device=prompt.device)
        x, start = torch.cat([prompt, masks], dim=1), prompt.shape[1]
        per_block = steps // blocks
        for b in range(blocks):
            lo = start + b * block_length
            x = self.denoise(x, per_block, temperature, remasking, (lo, lo + block_length), callback,
                             step_offset=b * per_block, generator=generator, offer_before=True)
        return x


# --- building from a spec ----------------------------------------------------------------------------------------
def llada_key_map(n_layers: int) -> dict[str, str]:
    """LLaDA checkpoint key -> transformers LlamaForCausalLM key. LLaDA's blocks (OLMo code) compute
    ``ff_out(act(ff_proj(x)) * up_proj(x))``: ff_proj is SwiGLU's gate, up_proj its up, ff_out its down."""
    out = {"model.transformer.wte.weight": "model.embed_tokens.weight",
           "model.transformer.ln_f.weight": "model.norm.weight",
           "model.transformer.ff_out.weight": "lm_head.weight"}
    names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
             "attn_out": "self_attn.o_proj", "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
             "ff_out": "mlp.down_proj", "attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm"}
    for i in range(n_layers):
        for src, dst in names.items():
            out[f"model.transformer.blocks.{i}.{src}.weight"] = f"model.layers.{i}.{dst}.weight"
    return out


def identity_key_map(model) -> dict[str, str]:
    """Dream's checkpoint carries Qwen2's own names: the map is the identity over the model's keys."""
    return {k: k for k in model.state_dict()}


def _checkpoint_files(location: Path) -> list[Path]:
    index = location / "model.safetensors.index.json"
    if index.exists():
        return sorted({location / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(location.glob("*.safetensors"))
    if not files:
        from datamodules.common.errors import PretrainedNotFoundError

        raise PretrainedNotFoundError(
            f"no safetensors under backbone.pretrained={str(location)!r} — a mapped checkpoint loads from a local dir: "
            "put its *.safetensors (and model.safetensors.index.json) there, or download it where the hub is "
            "reachable (hf download <id> --local-dir <dir>) and pass backbone.pretrained=<dir>")
    return files


def load_mapped_checkpoint(model, location: str | Path, key_map: Mapping[str, str]) -> None:
    """Load safetensors under ``location`` into ``model`` through ``key_map`` (checkpoint key -> model key): every
    checkpoint key mapped once, every model key filled exactly once, shapes equal; else one line naming the key."""
    from safetensors import safe_open

    own = model.state_dict()
    seen_src, filled = set(), {}
    for file in _checkpoint_files(Path(location)):
        with safe_open(str(file), framework="pt") as f:
            for src in f.keys():
                if src in seen_src:
                    raise ValueError(f"checkpoint key {src} appears twice under {location}")
                seen_src.add(src)
                if src not in key_map:
                    raise ValueError(f"checkpoint key {src} has no place in the key map: is this the right "
                                     "backbone.weight_map?")
                dst = key_map[src]
                if dst not in own or dst in filled:
                    raise ValueError(f"{src} -> {dst}: {'no such model key' if dst not in own else 'filled twice'}")
                tensor = f.get_tensor(src)
                if tuple(tensor.shape) != tuple(own[dst].shape):
                    raise ValueError(f"{src} has shape {tuple(tensor.shape)} but {dst} is {tuple(own[dst].shape)}: "
                                     "backbone.config does not match this checkpoint")
                filled[dst] = tensor
    tied = {k for k in own if k == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)}
    missing = sorted(set(own) - set(filled) - tied - {k for k in own if k.endswith("rotary_emb.inv_freq")})
    if missing:
        raise ValueError(f"{len(missing)} model weights missing from the checkpoint under {location}, e.g. {missing[0]}")
    model.load_state_dict(filled, strict=False)


WEIGHT_MAPS = ("llada", "dream")


def build_diffusion_backbone(spec: Mapping[str, Any]) -> MaskedDiffusionLM:
    """A ``MaskedDiffusionLM`` from a backbone spec with a ``diffusion: {mask_token_id, logit_shift}`` block.

    ``weight_map: llada|dream`` builds the model from ``config`` and loads ``pretrained``'s safetensors through the
    checked key map; without it the backbone is built as any other (``build_backbone``: random or from_pretrained)."""
    from lightning_modules.common.backbone import _dtype, build_backbone, build_config
    from datamodules.common.tiny_models import resolve_pretrained

    diffusion = spec.get("diffusion")
    if not diffusion or diffusion.get("mask_token_id") is None:
        raise ValueError(f"backbone {spec.get('family')!r} has no diffusion.mask_token_id: a causal backbone cannot run "
                         "as a masked diffusion LM; choose a diffusion backbone (backbone=tiny_mdlm|llada_8b|dream_7b)")
    weight_map = spec.get("weight_map")
    if weight_map is None:
        model = build_backbone(spec)
    elif weight_map not in WEIGHT_MAPS:
        raise ValueError(f"backbone.weight_map={weight_map!r}: choose one of {', '.join(WEIGHT_MAPS)} or null")
    else:
        from transformers import AutoModelForCausalLM

        config = build_config(spec)
        config._attn_implementation = spec.get("attn_implementation") or "sdpa"
        model = AutoModelForCausalLM.from_config(config)
        if spec.get("pretrained"):
            key_map = (llada_key_map(config.num_hidden_layers) if weight_map == "llada" else identity_key_map(model))
            load_mapped_checkpoint(model, resolve_pretrained(spec["pretrained"]), key_map)
        dtype = _dtype(spec.get("dtype"))
        if dtype is not None:
            model = model.to(dtype)
        if spec.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable()
    return MaskedDiffusionLM(model, diffusion["mask_token_id"], diffusion.get("logit_shift", 0))

