"""LongLoRA's shifted sparse attention (S²-Attn, Chen et al. 2024), HiCI's main baseline, and segment-local attention.

S²-Attn: the sequence is cut into groups of ``group_ratio``·N tokens (a quarter); each group attends causally within
itself; half of the heads use groups shifted by half a group so information flows between neighbouring groups.

``shift`` switch:
- ``roll``    LongLoRA's released code: the shifted heads are ``torch.roll``-ed by -G/2, so the first G/2 tokens wrap
              behind the last ones and share their group — they see the future (a known LongLoRA bug), kept for
              faithfulness.
- ``no_wrap`` (default) the shifted groups are [0, G/2), [G/2, 3G/2), …, [N-G/2, N): same pattern, no wrap, leak-free.

``LocalCore`` is attention inside each of S segments only (no prefix, no shift): the benchmark's lower bound.

``attention_impl`` (``common.block_attention``): ``blockwise`` / ``flex`` run the shifted heads as a ``groups_layout``
(``no_wrap``) or ``rolled_groups_layout`` (``roll``) and the plain heads / local segments as a ``groups_layout``,
without masks; ``sdpa_dense`` is the code below (grouped ``is_causal`` SDPA, a (groups, G, G) mask for ``no_wrap``);
``auto`` = flex on CUDA, else blockwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_modules.common.attention import repeat_kv
from lightning_modules.common.block_attention import (attend, check_impl, groups_layout, resolve_impl,
                                                      rolled_groups_layout)

S2_SHIFTS = ("roll", "no_wrap")


def _grouped_causal(q, k, v, g: int, mask=None):
    """(B, h, N, D) with N a multiple of g → causal attention within each group of g tokens → (B, h, N, D)."""
    b, h, n, d = q.shape
    r = lambda t: t.reshape(b, h, n // g, g, d).reshape(b * h, n // g, g, d)
    if mask is None:
        out = F.scaled_dot_product_attention(r(q), r(k), r(v), is_causal=True)
    else:
        out = F.scaled_dot_product_attention(r(q), r(k), r(v), attn_mask=mask)
    return out.reshape(b, h, n, d)


def s2_layouts(batch: int, n: int, g: int, shift: str):
    """The plain heads' and the shifted heads' layouts: groups [0, G), [G, 2G), ...; shifted [0, G/2), [G/2, 3G/2),
    ..., [N - G/2, N) (``no_wrap``) or LongLoRA's rolled groups (``roll``)."""
    plain = groups_layout(batch, n, g)
    return plain, rolled_groups_layout(batch, n, g) if shift == "roll" else groups_layout(batch, n, g, g // 2)


def s2_attention(q, k, v, group_ratio: float = 0.25, shift: str = "no_wrap", attention_impl: str = "auto"):
    """S²-Attn on q (B, h, N, D), k/v (B, h or kv, N, D) → (B, N, h, D)."""
    if shift not in S2_SHIFTS:
        raise ValueError(f"s2.shift={shift!r}: choose one of {', '.join(S2_SHIFTS)}")
    b, h, n, d = q.shape
    g = int(n * group_ratio)
    if g < 2 or n % g or g % 2:
        raise ValueError(f"S²-Attn needs the sequence length ({n}) to be a multiple of an even group size "
                         f"(s2.group_ratio={group_ratio} gives {g}): pick data.seq_len accordingly")
    half = h // 2
    if resolve_impl(attention_impl, q.device) != "sdpa_dense":
        rep = h // k.shape[1]
        if half % rep:  # the split would cut a KV group: expand to one KV head per query head
            k, v, rep = repeat_kv(k, rep), repeat_kv(v, rep), 1
        plain, shifted = s2_layouts(b, n, g, shift)
        kv_half = half // rep
        return torch.cat([attend(q[:, :half], k[:, :kv_half], v[:, :kv_half], plain, attention_impl),
                          attend(q[:, half:], k[:, kv_half:], v[:, kv_half:], shifted, attention_impl)],
                         dim=1).transpose(1, 2)
    k, v = repeat_kv(k, h // k.shape[1]), repeat_kv(v, h // v.shape[1])
    plain = _grouped_causal(q[:, :half], k[:, :half], v[:, :half], g)
    qs, ks, vs = q[:, half:], k[:, half:], v[:, half:]
    if shift == "roll":
        roll = lambda t, s: torch.roll(t, shifts=s, dims=2)
        shifted = roll(_grouped_causal(roll(qs, -g // 2), roll(ks, -g // 2), roll(vs, -g // 2), g), g // 2)
    else:  # pad G/2 at both ends: groups [−G/2, G/2), [G/2, 3G/2), ..., and mask the front pad out of group 0
        pad = lambda t: F.pad(t, (0, 0, g // 2, g // 2))
        groups = n // g + 1
        causal = torch.ones(g, g, dtype=torch.bool, device=q.device).tril()
        mask = causal.expand(groups, g, g).clone()
        mask[0, :, : g // 2] = False
        mask[0, : g // 2, : g // 2] = torch.eye(g // 2, dtype=torch.bool, device=q.device)  # pad rows: keep finite
        shifted = _grouped_causal(pad(qs), pad(ks), pad(vs), g, mask=mask)[:, :, g // 2: g // 2 + n]
    return torch.cat([plain, shifted], dim=1).transpose(1, 2)


class S2Core:
    """``patch_attention`` core for S²-Attn."""

    def __init__(self, group_ratio: float = 0.25, shift: str = "no_wrap", attention_impl: str = "auto"):
        if shift not in S2_SHIFTS:
            raise ValueError(f"s2.shift={shift!r}: choose one of {', '.join(S2_SHIFTS)}")
        self.group_ratio, self.shift, self.attention_impl = group_ratio, shift, check_impl(attention_impl)

    def __call__(self, attn, hidden_states, q, k, v, attention_mask=None):
        return s2_attention(q, k, v, self.group_ratio, self.shift, self.attention_impl)


class LocalCore:
    """``patch_attention`` core for segment-local causal attention (S segments, nothing crosses a boundary)."""

    def __init__(self, num_segments: int = 4, attention_impl: str = "auto"):
        self.num_segments, self.attention_impl = num_segments, check_impl(attention_impl)

    def __call__(self, attn, hidden_states, q, k, v, attention_mask=None):
        n = q.shape[2]
        if n % self.num_segments:
            raise ValueError(f"sequence length {n} is not divisible by hici.num_segments={self.num_segments}")
        if resolve_impl(self.attention_impl, q.device) != "sdpa_dense":
            layout = groups_layout(q.shape[0], n, n // self.num_segments)
            return attend(q, k, v, layout, self.attention_impl).transpose(1, 2)
        h = q.shape[1]
        k, v = repeat_kv(k, h // k.shape[1]), repeat_kv(v, h // v.shape[1])
        return _grouped_causal(q, k, v, n // self.num_segments).transpose(1, 2)
