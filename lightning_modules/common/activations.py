"""Read and edit a transformers causal LM's residual stream with forward hooks (any family with one ModuleList of blocks).

``capture(model, sites, layers)`` records, during the forwards run inside it, per decoder block ``layer``:

- ``embed``: the residual stream entering block 0 (token + position embeddings; ``hidden_states[0]``), one entry
  keyed ``0`` whatever ``layers`` is;
- ``block_out``: the block's output (``hidden_states[layer + 1]`` of transformers, except the last, which
  transformers reports after the final norm);
- ``post_attn``: the residual stream after the attention sub-block, h + attn(h), before the MLP adds its part
  (a parallel-residual block such as GPT-NeoX's never forms it; it is still h + attn(ln(h)));
- ``attn_out``: the attention sub-block's output alone, attn(h) (what ``post_attn`` adds to the stream);
- ``head_write``: what each head writes, ``(B, T, n_heads, d_model)``: the head's slice of the output projection's
  input times that projection's columns for the head; summed over heads plus the projection's bias it is the
  attention output.

``intervene(model, layer, fn)`` replaces block ``layer``'s output ``h`` by ``fn(h, positions)``, where
``positions`` are the absolute positions of the tokens in this forward (``offset + arange(T)``, the offset read from
the KV cache), so an edit at position t lands on t in a full forward and in cached generation alike. ``at(t, delta)``
builds the common fn: add ``delta[b]`` at position ``t[b]`` of row b.

``model`` is a transformers model or a ``CausalLMModule`` (its ``.model``). Tensors are detached unless
``capture(..., detach=False)`` (a regulariser needs the graph).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Sequence

import torch

SITES = ("embed", "block_out", "post_attn", "attn_out", "head_write")
_ATTN = ("self_attn", "attn", "attention")            # llama/qwen/mixtral | gpt2 | gpt_neox
_OUT_PROJ = ("o_proj", "c_proj", "dense", "out_proj")


def hf_model(model):
    """The transformers model of a ``CausalLMModule`` (or the model itself)."""
    from lightning_modules.common.lm import CausalLMModule

    return model.model if isinstance(model, CausalLMModule) else model


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks: the first non-empty ModuleList (pre-order, so the blocks before any experts list)."""
    for mod in hf_model(model).modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            return list(mod)
    raise ValueError(f"{type(model).__name__} has no ModuleList of decoder blocks to hook")


def _child(block: torch.nn.Module, names: Sequence[str], what: str) -> torch.nn.Module:
    for name in names:
        if isinstance(getattr(block, name, None), torch.nn.Module):
            return getattr(block, name)
    raise ValueError(f"{type(block).__name__} has no {what} submodule (looked for {', '.join(names)})")


def _hidden(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _first(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _check_layers(layers: Iterable[int] | None, n: int) -> list[int]:
    layers = list(range(n)) if layers is None else [int(i) for i in layers]
    bad = [i for i in layers if not -n <= i < n]
    if bad:
        raise ValueError(f"layer(s) {bad} beyond the model's {n} decoder blocks: choose layers in 0..{n - 1}")
    return [i % n for i in layers]


def _n_heads(model) -> int:
    cfg = hf_model(model).config
    for key in ("num_attention_heads", "n_head"):
        if getattr(cfg, key, None):
            return int(getattr(cfg, key))
    raise ValueError(f"{type(cfg).__name__} names no head count (num_attention_heads / n_head)")


def head_slices(proj: torch.nn.Module, x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per-head writes of an output projection: x (..., n_heads*d_head) -> (..., n_heads, d_out), bias left out."""
    # nn.Linear stores (out, in); GPT-2's Conv1D stores (in, out)
    w = proj.weight if isinstance(proj, torch.nn.Linear) else proj.weight.t()
    d_out, d_in = w.shape
    xh = x.reshape(*x.shape[:-1], n_heads, d_in // n_heads)
    wh = w.reshape(d_out, n_heads, d_in // n_heads)
    return torch.einsum("...hd,ohd->...ho", xh, wh)


@contextmanager
def capture(model, sites: Sequence[str] = ("block_out",), layers: Iterable[int] | None = None, detach: bool = True):
    """Record ``sites`` at decoder blocks ``layers`` (None = all) while inside; yields ``{site: {layer: tensor}}``.

    Each forward overwrites the previous one's entries (a generation loop keeps only the last step's)."""
    bad = [s for s in sites if s not in SITES]
    if bad:
        raise ValueError(f"unknown activation site(s) {bad}: choose from {', '.join(SITES)}")
    blocks = decoder_layers(model)
    layers = _check_layers(layers, len(blocks))
    store: dict[str, dict[int, torch.Tensor]] = {s: {} for s in sites}
    keep = (lambda t: t.detach()) if detach else (lambda t: t)
    handles, inputs = [], {}

    def pre(i):
        def hook(mod, args, kwargs):
            inputs[i] = _hidden(args, kwargs)
            if i == 0 and "embed" in store:
                store["embed"][0] = keep(inputs[i])
        return hook

    def post_block(i):
        def hook(mod, args, kwargs, output):
            store["block_out"][i] = keep(_first(output))
        return hook

    def post_attn(i):
        def hook(mod, args, kwargs, output):
            if "post_attn" in store:
                store["post_attn"][i] = keep(inputs[i] + _first(output))
            if "attn_out" in store:
                store["attn_out"][i] = keep(_first(output))
        return hook

    def head_write(i, n_heads):
        def hook(mod, args, kwargs):
            store["head_write"][i] = keep(head_slices(mod, _hidden(args, kwargs), n_heads))
        return hook

    try:
        hooked = set(layers) | ({0} if "embed" in store else set())
        for i in sorted(hooked):
            handles.append(blocks[i].register_forward_pre_hook(pre(i), with_kwargs=True))
        for i in layers:
            if "block_out" in store:
                handles.append(blocks[i].register_forward_hook(post_block(i), with_kwargs=True))
            if "post_attn" in store or "attn_out" in store:
                handles.append(_child(blocks[i], _ATTN, "attention").register_forward_hook(post_attn(i), with_kwargs=True))
            if "head_write" in store:
                proj = _child(_child(blocks[i], _ATTN, "attention"), _OUT_PROJ, "attention output projection")
                handles.append(proj.register_forward_pre_hook(head_write(i, _n_heads(model)), with_kwargs=True))
        yield store
    finally:
        for h in handles:
            h.remove()


def _cache_offset(kwargs) -> int:
    """Tokens already in the KV cache (0 without one): the absolute position of this forward's first token."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0


@contextmanager
def intervene(model, layer: int, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """Replace block ``layer``'s output h (B, T, D) by ``fn(h, positions)`` while inside; positions (T,) absolute."""
    top, blocks = hf_model(model), decoder_layers(model)
    (layer,) = _check_layers([layer], len(blocks))
    offset = [0]

    def top_pre(mod, args, kwargs):
        offset[0] = _cache_offset(kwargs)

    def block_post(mod, args, output):
        h = _first(output)
        positions = torch.arange(h.shape[1], device=h.device) + offset[0]
        new = fn(h, positions)
        return (new, *output[1:]) if isinstance(output, (tuple, list)) else new

    handles = [top.register_forward_pre_hook(top_pre, with_kwargs=True), blocks[layer].register_forward_hook(block_post)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def at(t: torch.Tensor | int, delta: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """An ``intervene`` fn adding ``delta[b]`` (B, D) or ``delta`` (D,) at absolute position ``t[b]`` (or t) of each row;
    a forward that does not contain that position is left alone."""

    def fn(h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, D = h.shape[0], h.shape[-1]
        ts = torch.as_tensor(t, device=h.device).reshape(-1).expand(B)
        d = delta.to(h).reshape(-1, D).expand(B, D)
        hit = (positions[None, :] == ts[:, None]).to(h.dtype)          # (B, T): 1 where the row's position is here
        return h + hit[..., None] * d[:, None, :]

    return fn
