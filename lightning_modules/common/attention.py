"""The one place where paperlab patches transformers 5.x attention layers.

A method that changes *how* a layer attends (HiCI, LongLoRA's S²-Attn, a sparse pattern, ...) writes one function

    core(attn, hidden_states, q, k, v, attention_mask) -> (batch, seq, heads, head_dim)

where ``attn`` is the layer's own attention module (so the core may call ``attn.k_proj`` etc., LoRA-wrapped or not),
``hidden_states`` the layer's attention input, ``q``/``k``/``v`` the projected heads after the layer's q/k norms and
RoPE, shapes (batch, heads, seq, head_dim) and (batch, kv_heads, seq, head_dim). ``patch_attention(model, core)``
installs it on every attention layer; everything else (projections, norms, RoPE, the KV cache, ``o_proj``) stays the
layer's own. Works for any layer with ``q_proj/k_proj/v_proj/o_proj`` and ``head_dim`` (LLaMA, Qwen3, Mistral, ...).

- Packed rows (position ids restarting inside a row, no attention mask, no cache) on a model set up by
  ``common.block_attention.use_block_attention`` (whose masks are the 2-D padding mask or None, never N × N) reach
  the core as ``attention_mask=None, documents=`` (B, N) document ids; a core without a ``documents`` parameter
  refuses them.
- The core runs when there is no cache history (training, prefill); decoding steps with a non-empty cache fall back
  to the layer's configured attention (sdpa/eager/flash), as HiCI's and LongLoRA's inference does.
  ``patch_attention(model, core, decode=True)`` runs the core on decoding steps too (q = the new tokens, k/v = the
  whole cache after the update; ``attention_mask`` then spans the cache), for methods whose generation must use
  the method itself (RLKV's gated rollouts).
- ``attention_enabled(model, False)`` switches every patched layer back to standard attention (a context manager),
  ``unpatch_attention(model)`` removes the patch, leaving a plain transformers model.
- ``set_linear_rope_scaling(model, factor)``: linear position interpolation (Chen et al. 2023), rebuilt in place.
- ``head_mask(model, mask)`` (a context manager): zero the masked heads' outputs before each ``o_proj`` (a forward
  pre-hook, so prefill and cached decoding alike, no ``patch_attention`` core); ``prune_heads(model, keep)`` (a
  context manager): the same heads physically sliced out of q/k/v/o for real speed (GQA: whole KV groups), the
  original projections restored on exit. ``kv_group_mask(mask, n_kv)`` widens a head mask to whole KV groups.

If transformers changes its attention signature, this file is the one edit.
"""
from __future__ import annotations

import contextlib
import inspect
import types
from typing import Callable

import torch
import torch.nn.functional as F

_PATCH_ATTR = "_paperlab_core"
_ENABLED_ATTR = "_paperlab_core_enabled"
_DECODE_ATTR = "_paperlab_core_decode"
_DOCUMENTS_ATTR = "_paperlab_core_documents"


def attention_modules(model) -> list[torch.nn.Module]:
    """Every self-attention module of a (possibly peft-wrapped) causal LM, in layer order."""
    out = []
    for mod in model.modules():
        if all(hasattr(mod, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")) and hasattr(mod, "head_dim"):
            out.append(mod)
    if not out:
        raise ValueError(f"{type(model).__name__} has no attention layer with q_proj/k_proj/v_proj/o_proj to patch")
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as LLaMA/Qwen3 apply it; x (B, h, N, D), cos/sin (B, N, D)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, kv_heads, N, D) → (B, kv_heads * n_rep, N, D), the GQA expansion."""
    if n_rep == 1:
        return x
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


def project_qkv(attn, hidden_states: torch.Tensor, position_embeddings):
    """The layer's q, k, v heads with its q/k norms (Qwen3) and RoPE, exactly as its own forward computes them."""
    shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(hidden_states).view(shape)
    k = attn.k_proj(hidden_states).view(shape)
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q)
    if getattr(attn, "k_norm", None) is not None:
        k = attn.k_norm(k)
    v = attn.v_proj(hidden_states).view(shape)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def project_kv_no_rope(attn, x: torch.Tensor):
    """Keys and values of extra tokens ``x`` (B, T, H) through the layer's k/v path (k_norm included), no RoPE:
    (B, kv_heads, T, D) each. Slot/memory tokens of HiCI-like methods go through here."""
    shape = (*x.shape[:-1], -1, attn.head_dim)
    k = attn.k_proj(x).view(shape)
    if getattr(attn, "k_norm", None) is not None:
        k = attn.k_norm(k)
    v = attn.v_proj(x).view(shape)
    return k.transpose(1, 2), v.transpose(1, 2)


def standard_attention(attn, q, k, v, attention_mask, **kwargs) -> torch.Tensor:
    """The layer's configured attention (sdpa / eager / flash) → (B, N, heads, D)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = attn.config._attn_implementation
    if impl == "eager" or impl not in ALL_ATTENTION_FUNCTIONS:
        kr, vr = repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)
        w = torch.matmul(q, kr.transpose(2, 3)) * attn.scaling
        if attention_mask is not None:
            w = w + attention_mask[:, :, :, : kr.shape[-2]]
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, vr).transpose(1, 2)
    fn = ALL_ATTENTION_FUNCTIONS[impl]
    kw = {k_: v_ for k_, v_ in kwargs.items() if k_ not in ("position_ids", "use_cache", "output_attentions")}
    if getattr(attn, "sliding_window", None) is not None:
        kw["sliding_window"] = attn.sliding_window
    out, _ = fn(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kw)
    return out


def _patched_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                     past_key_values=None, **kwargs):
    cache = cache if cache is not None else past_key_values
    input_shape = hidden_states.shape[:-1]
    history = cache.get_seq_length(self.layer_idx) if cache is not None else 0
    q, k, v = project_qkv(self, hidden_states, position_embeddings)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    if getattr(self, _ENABLED_ATTR, True) and (history == 0 or getattr(self, _DECODE_ATTR, False)):
        core = getattr(self, _PATCH_ATTR)
        attention_mask, documents = _packed_documents(attention_mask, kwargs.get("position_ids"), q.shape[0])
        if documents is None:
            out = core(self, hidden_states, q, k, v, attention_mask)
        elif getattr(self, _DOCUMENTS_ATTR, False):
            out = core(self, hidden_states, q, k, v, attention_mask, documents=documents)
        else:
            raise ValueError(f"{getattr(core, '__qualname__', type(core).__name__)} does not attend within packed "
                             "documents (position ids restart inside a row): feed unpacked rows, or set "
                             "attention_impl=sdpa_dense so transformers builds the document mask")
    else:
        out = standard_attention(self, q, k, v, attention_mask, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), None


def _packed_documents(attention_mask, position_ids, batch: int):
    """(mask, document ids (B, N) or None): packed rows under ``use_block_attention`` come as its ``PACKED`` mask
    (elsewhere transformers folds the documents into a 4-D mask)."""
    from lightning_modules.common.block_attention import layer_documents

    return layer_documents(attention_mask, position_ids, batch)


def patch_attention(model, core: Callable, decode: bool = False) -> list[torch.nn.Module]:
    """Install ``core`` on every attention layer (per instance; the class is untouched). Returns the layers.
    ``decode``: also run it on cached decoding steps (default: prefill/training only)."""
    layers = attention_modules(model)
    try:
        takes_documents = "documents" in inspect.signature(core).parameters
    except (TypeError, ValueError):
        takes_documents = False
    for attn in layers:
        object.__setattr__(attn, _PATCH_ATTR, core)
        object.__setattr__(attn, _DECODE_ATTR, decode)
        object.__setattr__(attn, _DOCUMENTS_ATTR, takes_documents)
        attn.forward = types.MethodType(_patched_forward, attn)
    return layers


def unpatch_attention(model) -> None:
    """Back to the layers' own forward: a plain transformers model again."""
    for attn in attention_modules(model):
        if _PATCH_ATTR in attn.__dict__:
            del attn.__dict__[_PATCH_ATTR]
            attn.__dict__.pop("forward", None)
            attn.__dict__.pop(_ENABLED_ATTR, None)
            attn.__dict__.pop(_DECODE_ATTR, None)
            attn.__dict__.pop(_DOCUMENTS_ATTR, None)


def is_patched(model) -> bool:
    return any(_PATCH_ATTR in a.__dict__ for a in attention_modules(model))


@contextlib.contextmanager
def attention_enabled(model, enabled: bool):
    """Temporarily run patched layers with (True) or without (False) their core."""
    layers = [a for a in attention_modules(model) if _PATCH_ATTR in a.__dict__]
    before = [a.__dict__.get(_ENABLED_ATTR, True) for a in layers]
    for a in layers:
        object.__setattr__(a, _ENABLED_ATTR, enabled)
    try:
        yield model
    finally:
        for a, b in zip(layers, before):
            object.__setattr__(a, _ENABLED_ATTR, b)


def set_linear_rope_scaling(model, factor: float) -> None:
    """Linear RoPE position interpolation by ``factor`` (positions divided by it), written to the config so a saved
    model reloads with it, and the rotary embedding rebuilt in place. ``factor <= 1`` leaves the model alone."""
    if factor is None or factor <= 1:
        return
    config = model.config
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update({"rope_type": "linear", "factor": float(factor)})
    config.rope_parameters = params
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            if name == "rotary_emb":
                dev = child.inv_freq.device
                new = type(child)(config=config)
                setattr(mod, name, new.to(dev))


def _layer_mask(model, mask) -> tuple[list[torch.nn.Module], torch.Tensor]:
    """The attention layers and ``mask`` as a (layers, heads) tensor, checked against them."""
    layers = attention_modules(model)
    mask = torch.as_tensor(mask)
    n_heads = layers[0].q_proj.out_features // layers[0].head_dim
    if mask.shape != (len(layers), n_heads):
        raise ValueError(f"head mask of shape {tuple(mask.shape)}: the model needs (layers, heads) = "
                         f"({len(layers)}, {n_heads})")
    return layers, mask


@contextlib.contextmanager
def head_mask(model, mask):
    """Multiply head h of layer l by ``mask[l, h]`` (0/1 or any weight) at the input of ``o_proj`` while inside:
    a masked head's effect is exactly that of zeroing its W_O columns, in full forwards and cached decoding."""
    layers, mask = _layer_mask(model, mask)
    handles = []

    def hook(m):
        def pre(mod, args):
            x = args[0]
            xh = x.reshape(*x.shape[:-1], m.numel(), -1) * m.to(x)[:, None]
            return (xh.reshape(x.shape), *args[1:])
        return pre

    try:
        for attn, m in zip(layers, mask):
            handles.append(attn.o_proj.register_forward_pre_hook(hook(m.detach().clone())))
        yield model
    finally:
        for h in handles:
            h.remove()


def kv_group_mask(mask, n_kv: int) -> torch.Tensor:
    """A (layers, heads) 0/1 mask widened to whole KV groups: a group is kept when any of its query heads is."""
    mask = torch.as_tensor(mask).bool()
    L, H = mask.shape
    return mask.reshape(L, n_kv, H // n_kv).any(-1, keepdim=True).expand(L, n_kv, H // n_kv).reshape(L, H)


def _sliced(linear: torch.nn.Linear, idx: torch.Tensor, dim: int) -> torch.nn.Linear:
    """A copy of ``linear`` keeping rows (dim 0: outputs) or columns (dim 1: inputs) ``idx``."""
    w = linear.weight.index_select(dim, idx.to(linear.weight.device))
    new = torch.nn.Linear(w.shape[1], w.shape[0], bias=linear.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        new.weight.copy_(w)
        if linear.bias is not None:
            new.bias.copy_(linear.bias if dim == 1 else linear.bias.index_select(0, idx.to(w.device)))
    return new


@contextlib.contextmanager
def prune_heads(model, keep):
    """Slice the heads where ``keep`` (layers, heads) is False out of q/k/v/o (the ``o_proj`` columns, the q rows,
    and for GQA the k/v rows of whole KV groups) while inside; the original projections come back on exit.
    Gives the logits of ``head_mask(model, keep)``; every layer keeps at least one head, and under GQA ``keep``
    must be constant within each KV group (``kv_group_mask`` makes it so)."""
    layers, keep = _layer_mask(model, keep)
    keep = keep.bool()
    saved = []
    for i, attn in enumerate(layers):  # check every layer before touching any
        d, H = attn.head_dim, keep.shape[1]
        n_kv = attn.k_proj.out_features // d
        groups = keep[i].reshape(n_kv, H // n_kv)
        if not keep[i].any():
            raise ValueError(f"prune_heads: layer {i} keeps no head; keep at least one head per layer")
        if not bool((groups.all(-1) | ~groups.any(-1)).all()):
            raise ValueError(f"prune_heads: layer {i} splits a KV group ({H // n_kv} query heads share one KV head); "
                             "widen the mask with kv_group_mask(mask, n_kv) first")
    for i, attn in enumerate(layers):
        d, H = attn.head_dim, keep.shape[1]
        n_kv = attn.k_proj.out_features // d
        groups = keep[i].reshape(n_kv, H // n_kv)
        q_heads = keep[i].nonzero().flatten()
        kv_heads = groups.any(-1).nonzero().flatten()
        rows = lambda heads: (heads[:, None] * d + torch.arange(d)).flatten()  # noqa: E731
        saved.append((attn, {n: getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}))
        attn.q_proj = _sliced(saved[-1][1]["q_proj"], rows(q_heads), 0)
        attn.k_proj = _sliced(saved[-1][1]["k_proj"], rows(kv_heads), 0)
        attn.v_proj = _sliced(saved[-1][1]["v_proj"], rows(kv_heads), 0)
        attn.o_proj = _sliced(saved[-1][1]["o_proj"], rows(q_heads), 1)
    try:
        yield model
    finally:
        for attn, mods in saved:
            for name, mod in mods.items():
                setattr(attn, name, mod)
