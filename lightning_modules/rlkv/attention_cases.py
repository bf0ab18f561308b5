"""RLKV's gated mixed attention as cases of the shared attention benchmark (``benchmarks/attention.py``, which finds
this module by its name): one layer's ``MixedAttention.core`` (every gate 0.5, so both the full causal and the
streaming softmax run), sink 128 + recent 256 keys (the training window), ``token`` or ``block`` (128) windows."""
from __future__ import annotations

import torch

from lightning_modules.rlkv.mixed_attention import MixedAttention


def _rlkv(window: str):
    def build(n, impl, heads=8, head_dim=64, dtype=torch.float32, device="cpu"):
        mixed = MixedAttention(1, heads, sink=128, recent=256, window=window, block=128, init=0.5,
                               attention_impl=impl).to(device=device, dtype=dtype)

        class Layer:
            scaling, layer_idx = head_dim ** -0.5, 0

        g = torch.Generator(device="cpu").manual_seed(0)
        inputs = [torch.randn(1, heads, n, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(3)]
        return (lambda q, k, v: mixed.core(Layer, None, q, k, v, None)), inputs
    return build


CASES = {"rlkv_token": _rlkv("token"), "rlkv_block": _rlkv("block")}
