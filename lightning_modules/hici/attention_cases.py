"""HiCI's and LongLoRA's attention patterns as cases of the shared attention benchmark (``benchmarks/attention.py``,
which finds this module by its name): each case builds, for N tokens, ``heads`` × ``head_dim`` and an
``attention_impl``, a function of (q, k, v, ...) leaves whose output is differentiated.

- ``hici_shift_g``: the broadcast of the default mode (``causal_shift_g``): 4 segments, a prefix of K = 4 global
  slots, none for segment 0. ``hici_none``: the released mode, prefix [G, L_i] of 4 + 8 slots for every segment.
- ``s2_no_wrap`` / ``s2_roll``: S²-Attn, group 1/4, half the heads shifted. ``local``: 4 segments, nothing crosses.
"""
from __future__ import annotations

import torch

from lightning_modules.hici.hici_attention import segment_attention
from lightning_modules.hici.s2attn import LocalCore, s2_attention


def _qkv(n, heads, head_dim, dtype, device, extra=()):
    g = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)  # noqa: E731
    return [make(1, heads, n, head_dim) for _ in range(3)] + [make(*shape) for shape in extra]


def _hici(prefix: int, shifted: bool):
    def build(n, impl, heads=8, head_dim=64, dtype=torch.float32, device="cpu"):
        s = 4
        valid = torch.tensor([not shifted] + [True] * (s - 1), device=device)
        inputs = _qkv(n, heads, head_dim, dtype, device, [(1, s, heads, prefix, head_dim)] * 2)
        return (lambda q, k, v, pk, pv: segment_attention(q, k, v, pk, pv, valid, s, attention_impl=impl)), inputs
    return build


def _s2(shift: str):
    def build(n, impl, heads=8, head_dim=64, dtype=torch.float32, device="cpu"):
        return (lambda q, k, v: s2_attention(q, k, v, 0.25, shift, impl)), _qkv(n, heads, head_dim, dtype, device)
    return build


def _local(n, impl, heads=8, head_dim=64, dtype=torch.float32, device="cpu"):
    core = LocalCore(4, impl)
    return (lambda q, k, v: core(None, None, q, k, v)), _qkv(n, heads, head_dim, dtype, device)


CASES = {"hici_shift_g": _hici(4, True), "hici_none": _hici(12, False), "s2_no_wrap": _s2("no_wrap"),
         "s2_roll": _s2("roll"), "local": _local}
