"""The packed 4-bit weight format: two codes per byte, a scale and a zero per group of input features.

A weight W (out × in, y = x Wᵀ) is stored as
- ``qweight``: uint8, out × in/2; byte j of a row holds code 2j in its low nibble and code 2j+1 in its high nibble;
- ``scales``, ``zeros``: out × in/G floats (fp16, bf16 or fp32), one pair per group of G consecutive input features;
and it stands for  W[n, k] = (code[n, k] − zeros[n, k // G]) · scales[n, k // G],  computed in fp32.

The zero is a float, not a 4-bit integer, so every uniform grid of at most 16 levels packs exactly: the asymmetric
min-max grid (integer zero), the symmetric grid with a zero level (codes q + 8, zero 8) and the mid-rise grid without
one (q + ½ steps: zero 7.5). G divides ``in`` (G = in: one group per row, the per-row grids of the common RTN/GPTQ).
At G = 128 with fp16 scales and zeros the format costs 4 + 32/128 = 4.25 bits per weight.

``quantize_rtn`` puts a float weight on the same 4-bit grids as ``fake_quant.py`` (per-group min-max or absmax,
round-half-to-even), so its packed dequantization equals ``fake_quant_reference`` bit for bit in fp32.
The matmul that reads this format (``w4a16.py``) and its layer (``PackedLinear``) live beside it.
"""
from __future__ import annotations

import torch

from callbacks.kernels.fake_quant import EPS

BITS = 4
LEVELS = 2 ** BITS


def check_shapes(out_features: int, in_features: int, group_size: int) -> int:
    """The number of groups per row; one line naming the fix when the shapes do not fit the format."""
    if in_features % 2:
        raise ValueError(f"in_features={in_features} is odd: the packed int4 format holds two codes per byte, "
                         "so the input dimension must be even")
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"group_size={group_size} does not divide in_features={in_features}: choose a divisor "
                         f"(or group_size={in_features}: one group per row)")
    return in_features // group_size


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """out × in integer codes in 0..15 -> out × in/2 uint8 (low nibble: even column, high nibble: odd column)."""
    if codes.dim() != 2 or codes.shape[1] % 2:
        raise ValueError(f"codes of shape {tuple(codes.shape)}: pack a 2-D out × in tensor with an even in")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= LEVELS):
        raise ValueError(f"codes span {int(codes.min())}..{int(codes.max())}: a 4-bit code holds 0..15")
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_int4``: out × in/2 uint8 -> out × in uint8 codes."""
    if qweight.dtype != torch.uint8:
        raise ValueError(f"qweight has dtype {qweight.dtype}: the packed format is uint8")
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The fp32 out × in weight the packed tensors stand for: (code − zero) · scale per group."""
    codes = unpack_int4(qweight)
    out, n = codes.shape
    if scales.shape != zeros.shape or scales.shape[0] != out or n % scales.shape[1]:
        raise ValueError(f"scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not fit a packed weight of "
                         f"{out} × {n}: each needs out × (in / group_size)")
    g = n // scales.shape[1]
    s = scales.float().repeat_interleave(g, dim=1)
    z = zeros.float().repeat_interleave(g, dim=1)
    return (codes.float() - z) * s


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, symmetric: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8, scales fp32, zeros fp32) of per-group round-to-nearest on ``fake_quant``'s 4-bit grids:
    asymmetric (default): s = (max − min)/15, z = round(−min/s), code = clamp(round(w/s) + z, 0, 15);
    symmetric: s = absmax/7, code = clamp(round(w/s), −7, 7) + 8, zero 8 (code 0 unused)."""
    out, n = weight.shape
    groups = check_shapes(out, n, group_size)
    wg = weight.detach().float().reshape(out, groups, group_size)
    if symmetric:
        s = (wg.abs().amax(-1, keepdim=True) / 7).clamp_min(EPS)
        z = torch.full_like(s, 8.0)
        codes = torch.clamp(torch.round(wg / s), -7, 7) + 8
    else:
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        s = ((hi - lo) / (LEVELS - 1)).clamp_min(EPS)
        z = torch.round(-lo / s)
        codes = torch.clamp(torch.round(wg / s) + z, 0, LEVELS - 1)
    return codes.reshape(out, n).to(torch.uint8), s.squeeze(-1), z.squeeze(-1)
