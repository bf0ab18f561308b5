"""Gated mixed attention (RLKV / DuoAttention): per KV head, o = α·o_full + (1−α)·o_stream.

Both outputs come from the same post-RoPE q/k/v (the ``patch_attention`` core contract): ``o_full`` is the layer's
causal attention, ``o_stream`` the same softmax restricted to the ``sink`` first and the ``recent`` latest keys a
query may see. Keys are counted from a row's first real token: the ranks come from the attention mask itself
(running count of the keys each query may see), so left padding, packed rows and cached decoding steps (q = the
new tokens, k/v = the whole cache) all count the same way. ``window='block'`` is the released block-sparse kernel's
pattern: ranks in blocks of ``block`` tokens, the first ceil(sink/block) blocks and the ceil(recent/block) latest
(the query's own block included). One gate per KV head, shared by its GQA group; the model stays frozen.

``attention_impl`` (``common.block_attention``): ``blockwise`` / ``flex`` (``auto``: flex on CUDA, else blockwise) run
both branches as layouts (``causal_layout``, ``sink_recent_layout``) from the 2-D padding mask and packed documents,
without the N × K masks and the int32 running count; ``sdpa_dense`` is the dense code below (the reference). A 4-D
mask (a model left on ``sdpa``/``eager``) is already N × K and goes the dense way: ``common.block_attention.
use_block_attention`` makes transformers hand the 2-D mask instead (the RL core does it for ``model.attention_impl``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lightning_modules.common.attention import attention_modules, patch_attention
from lightning_modules.common.block_attention import (attend, causal_layout, check_impl, resolve_impl,
                                                      sink_recent_layout)

WINDOWS = ("token", "block")


def check_window(sink: int, recent: int, window: str = "token", block: int = 128) -> None:
    if window not in WINDOWS:
        raise ValueError(f"window={window!r}: choose token or block")
    if sink < 0 or recent < 1 or block < 1:
        raise ValueError(f"an empty window (sink={sink}, recent={recent}, block={block}): recent and block must be "
                         ">= 1, sink >= 0 (e.g. sink 128 + recent 256 in training, 16 + 64 at inference)")


def check_backbone(spec) -> None:
    """The gates patch q/k/v/o projections: checked on the meta device, before any weight loads."""
    from lightning_modules.common.backbone import build_backbone

    try:
        attention_modules(build_backbone(spec, meta=True))
    except ValueError:
        raise ValueError(f"backbone.family={spec.get('family')}: the gates need attention layers with q_proj/k_proj/"
                         "v_proj/o_proj; choose such a backbone (llama, qwen2, qwen3, mistral)") from None


def allowed_keys(attention_mask: torch.Tensor | None, q_len: int, k_len: int, device) -> torch.Tensor:
    """Bool (B|1, 1, q, K): which keys each query may see, from a 4-D bool or additive mask, or a 2-D padding mask
    (flash attention's), None: causal, the queries being the last ``q_len`` keys. A query that may see nothing (a
    padding row) sees itself, so nothing is NaN."""
    ones = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    causal = ones.tril(k_len - q_len)[None, None]
    if attention_mask is None:
        return causal
    am = attention_mask[:, None, None, :k_len].bool() if attention_mask.dim() == 2 else attention_mask[..., -q_len:, :k_len]
    allowed = (am if am.dtype == torch.bool else am == 0) & causal
    diagonal = causal & ~ones.tril(k_len - q_len - 1)
    return allowed | (diagonal & ~allowed.any(-1, keepdim=True))


def streaming_keys(allowed: torch.Tensor, sink: int, recent: int, window: str = "token", block: int = 128) -> torch.Tensor:
    """The sink + recent subset of ``allowed``: key rank r_k and query rank r_q (= the count of keys it sees - 1)."""
    count = allowed.int().cumsum(-1, dtype=torch.int32)
    r_k, r_q = count - 1, count[..., -1:] - 1
    if window == "block":
        r_k, r_q = r_k // block, r_q // block
        sink, recent = math.ceil(sink / block), math.ceil(recent / block)
    return allowed & ((r_k < sink) | (r_q - r_k < recent))


class MixedAttention(torch.nn.Module):
    """The gates α (L, H_kv), init ``init``, and the attention core that mixes with them (``install(model)``)."""

    def __init__(self, n_layers: int, n_kv_heads: int, sink: int = 128, recent: int = 256, window: str = "token",
                 block: int = 128, init: float = 1.0, attention_impl: str = "auto"):
        super().__init__()
        check_window(sink, recent, window, block)
        self.sink, self.recent, self.window, self.block = sink, recent, window, block
        self.attention_impl = check_impl(attention_impl)
        self.gates = torch.nn.Parameter(torch.full((n_layers, n_kv_heads), float(init)))

    @classmethod
    def for_model(cls, model, **kw) -> "MixedAttention":
        layers = attention_modules(model)  # raises for a backbone without q/k/v/o projections
        cfg = model.config
        return cls(len(layers), getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads, **kw)

    def install(self, model) -> None:
        """Every attention layer runs the mixed core, on decoding steps too (rollouts from the gated model)."""
        patch_attention(model, self.core, decode=True)

    @torch.no_grad()
    def clamp_(self) -> None:
        self.gates.clamp_(0.0, 1.0)

    def core(self, attn, hidden_states, q, k, v, attention_mask, documents=None):
        B, Hq, N, _ = q.shape
        K = k.shape[-2]
        dense = attention_mask is not None and attention_mask.dim() == 4
        if resolve_impl(self.attention_impl, q.device) == "sdpa_dense" or dense:
            if documents is not None:  # packed rows as the 4-D mask transformers' sdpa would have built
                attention_mask = documents[:, None, :, None] == documents[:, None, None, :]
            allowed = allowed_keys(attention_mask, N, K, q.device)
            stream = streaming_keys(allowed, self.sink, self.recent, self.window, self.block)
            gqa = Hq != k.shape[1]
            full = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=attn.scaling, enable_gqa=gqa)
            part = F.scaled_dot_product_attention(q, k, v, attn_mask=stream, scale=attn.scaling, enable_gqa=gqa)
        else:
            valid = None if attention_mask is None else attention_mask[:, -K:].bool()
            full = attend(q, k, v, causal_layout(B, N, K, valid, documents), self.attention_impl, attn.scaling)
            part = attend(q, k, v, sink_recent_layout(B, N, K, self.sink, self.recent, self.window, self.block, valid,
                                                      documents), self.attention_impl, attn.scaling)
        a = self.gates[attn.layer_idx].to(q.dtype).repeat_interleave(Hq // k.shape[1])[None, :, None, None]
        return (a * full + (1 - a) * part).transpose(1, 2)
