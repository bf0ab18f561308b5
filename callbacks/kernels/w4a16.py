"""Packed 4-bit weights and the W4A16 matmul that reads them: fp16 / bf16 (or fp32) activations, fp32 accumulation.

The format. A weight W (out × in, y = x Wᵀ) is stored as
- ``qweight``: uint8, out × in/2; byte j of a row holds code 2j in its low nibble and code 2j+1 in its high nibble;
- ``scales``, ``zeros``: out × in/G floats (fp16, bf16 or fp32), one pair per group of G consecutive input features;
and it stands for  W[n, k] = (code[n, k] − zeros[n, k // G]) · scales[n, k // G],  computed in fp32.
The zero is a float, not a 4-bit integer, so every uniform grid of at most 16 levels packs exactly: the asymmetric
min-max grid (integer zero), the symmetric grid with a zero level (codes q + 8, zero 8) and the mid-rise grid without
one (q + ½ steps: zero 7.5). G divides ``in`` (G = in: one group per row, the per-row grids of the common RTN/GPTQ).
At G = 128 with fp16 scales and zeros the format costs 4 + 32/128 = 4.25 bits per weight. ``quantize_rtn`` puts a
float weight on ``fake_quant.py``'s 4-bit grids, so its packed dequantization equals ``fake_quant_reference`` bit for
bit in fp32.

The matmul, y = x · Wᵀ (+ bias), two implementations:
- ``w4a16_reference``: plain PyTorch, the definition: unpack, dequantize in fp32, cast W to x's dtype, ``F.linear``;
- ``w4a16_triton``: one Triton kernel that reads the packed bytes (each once), dequantizes each (BLOCK_K × BLOCK_N)
  tile in fp32 in registers, casts it to x's dtype and accumulates ``tl.dot`` in fp32, so the full-precision W never
  exists in memory. fp32 inputs use an IEEE fp32 dot (no TF32), and so does Triton's CPU interpreter for every dtype
  (its bf16 ``tl.dot`` is wrong, ENVIRONMENT.md): there the kernel equals the reference up to summation order, and
  bit for bit whenever every product and partial sum is exact (the tests' integer-valued inputs).
``w4a16_linear(..., impl=auto|triton|torch)`` picks Triton for CUDA tensors when Triton is installed. The weight is
frozen (buffers); the input's gradient, dx = dy · W, exists on both paths (the Triton path's backward dequantizes
with the reference). ``PackedLinear`` is the ``nn.Linear`` replacement that holds the packed buffers.

This module imports nothing of the project (``callbacks/kernels`` is a leaf), so the Triton import and the
auto-selection repeat ``fake_quant.py``'s few lines.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

try:  # optional: `pip install -c constraints.txt triton==3.7.1` (the test extra)
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU installs without the extra
    triton = tl = None
    HAS_TRITON = False

BITS = 4
LEVELS = 2 ** BITS
EPS = 1e-8  # the floor on a scale, as in fake_quant.py (an all-zero group stays zero)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _use_triton(x: torch.Tensor, impl: str) -> bool:
    """auto: Triton for CUDA tensors (when installed); triton: always (CPU needs TRITON_INTERPRET=1); torch: never."""
    if impl == "auto":
        return HAS_TRITON and x.is_cuda
    if impl == "triton":
        return True
    if impl == "torch":
        return False
    raise ValueError(f"impl={impl!r}: use auto | triton | torch")


# --- the format ------------------------------------------------------------------------------------------------------
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


# --- the matmul ------------------------------------------------------------------------------------------------------
def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize (fp32), cast to x's dtype, matmul: the definition the kernel must equal."""
    w = dequantize(qweight, scales, zeros).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


if HAS_TRITON:

    @triton.jit
    def _w4a16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, G, n_groups,
                      stride_xm, stride_ym, HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, ALIGNED: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        rb = tl.arange(0, BLOCK_K // 2)
        in_m, in_n = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            in_k = k < K
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                        mask=in_m[:, None] & in_k[None, :], other=0.0)
            # each byte once: (BLOCK_N, BLOCK_K / 2) bytes -> low and high nibbles interleaved along k -> Wᵀ tile
            b = k0 // 2 + rb
            byte = tl.load(qw_ptr + rn[:, None].to(tl.int64) * (K // 2) + b[None, :],
                           mask=in_n[:, None] & (b < K // 2)[None, :], other=0).to(tl.int32)
            code = tl.trans(tl.interleave(byte & 0xF, byte >> 4)).to(tl.float32)  # (BLOCK_K, BLOCK_N)
            if ALIGNED:  # BLOCK_K divides G: one scale and zero per column of the tile
                g = rn.to(tl.int64) * n_groups + k0 // G
                s = tl.load(s_ptr + g, mask=in_n, other=0.0).to(tl.float32)[None, :]
                z = tl.load(z_ptr + g, mask=in_n, other=0.0).to(tl.float32)[None, :]
            else:
                g = rn[None, :].to(tl.int64) * n_groups + (k // G)[:, None]
                gmask = in_k[:, None] & in_n[None, :]
                s = tl.load(s_ptr + g, mask=gmask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g, mask=gmask, other=0.0).to(tl.float32)
            w = (code - z) * s
            if DOT_FP32:
                acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=in_n, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=in_m[:, None] & in_n[None, :])


def _blocks(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): a short M (decoding) gets the smallest tile tl.dot takes."""
    return (16 if m <= 16 else 32 if m <= 32 else 64), 64, 64


def w4a16_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel; same contract as ``w4a16_reference``. CUDA tensors, or CPU under TRITON_INTERPRET=1."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton W4A16 kernel needs triton: pip install -c constraints.txt triton==3.7.1")
    n, half = qweight.shape
    k = 2 * half
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the packed weight {k}")
    n_groups = scales.shape[1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk = _blocks(m)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if m:
        _w4a16_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, qweight.contiguous(), scales.contiguous(), zeros.contiguous(), bias if bias is not None else scales,
            y, m, n, k, k // n_groups, n_groups, x2.stride(0), y.stride(0), HAS_BIAS=bias is not None,
            DOT_FP32=interpret or x.dtype == torch.float32, ALIGNED=(k // n_groups) % bk == 0,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return y.reshape(*x.shape[:-1], n)


class _W4A16(torch.autograd.Function):
    """The kernel forward; backward dx = dy · W with W dequantized by the reference (the weight is frozen)."""

    @staticmethod
    def forward(ctx, x, qweight, scales, zeros, bias):
        ctx.save_for_backward(qweight, scales, zeros)
        return w4a16_triton(x, qweight, scales, zeros, bias)

    @staticmethod
    def backward(ctx, grad):
        qweight, scales, zeros = ctx.saved_tensors
        return grad @ dequantize(qweight, scales, zeros).to(grad.dtype), None, None, None, None


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """y = x · Wᵀ + bias for the packed W; ``impl``: auto (Triton on CUDA, else PyTorch) | triton | torch."""
    if _use_triton(x, impl):
        return _W4A16.apply(x, qweight, scales, zeros, bias)
    return w4a16_reference(x, qweight, scales, zeros, bias)


class PackedLinear(nn.Module):
    """A frozen linear layer whose weight is stored in the packed 4-bit format (module doc), really 4-bit in memory
    and in its state dict (buffers ``qweight`` uint8, ``scales``, ``zeros``, optional ``bias`` and ``input_scale``).

    ``input_scale`` (per input feature, AWQ's s): the layer computes (x / s) · Wᵀ, W the packed Q(W·diag s), so it
    equals a fake-quantized weight Q(W·diag s)·diag(1/s). ``impl``: auto | triton | torch (``w4a16_linear``).
    """

    def __init__(self, in_features: int, out_features: int, group_size: int = 128, bias: bool = False,
                 input_scale: bool = False, scale_dtype: torch.dtype = torch.float16, dtype: torch.dtype | None = None,
                 device=None, impl: str = "auto"):
        super().__init__()
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={scale_dtype}: use one of {SCALE_DTYPES}")
        groups = check_shapes(out_features, in_features, group_size)
        self.in_features, self.out_features, self.group_size, self.impl = in_features, out_features, group_size, impl
        dtype = dtype or torch.get_default_dtype()
        self.register_buffer("qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(out_features, groups, dtype=scale_dtype, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=scale_dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self.register_buffer("input_scale",
                             torch.ones(in_features, dtype=dtype, device=device) if input_scale else None)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                   bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                   scale_dtype: torch.dtype = torch.float16, dtype: torch.dtype | None = None,
                   impl: str = "auto") -> "PackedLinear":
        """Pack out × in codes (0..15) with out × groups scales and zeros (stored in ``scale_dtype``); ``bias`` and
        ``input_scale`` are kept in ``dtype`` (default: the bias's, else torch's default dtype)."""
        out, n = codes.shape
        groups = scales.shape[1]
        if n % max(groups, 1):
            raise ValueError(f"{groups} groups do not divide in_features={n}")
        dtype = dtype or (bias.dtype if bias is not None else None)
        layer = cls(n, out, n // groups, bias is not None, input_scale is not None, scale_dtype, dtype,
                    device=codes.device, impl=impl)
        layer.qweight.copy_(pack_int4(codes))
        layer.scales.copy_(scales)
        layer.zeros.copy_(zeros)
        if bias is not None:
            layer.bias.copy_(bias)
        if input_scale is not None:
            layer.input_scale.copy_(input_scale)
        return layer

    def dequantize(self) -> torch.Tensor:
        """The fp32 out × in weight this layer applies to its (scaled) input."""
        return dequantize(self.qweight, self.scales, self.zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x / self.input_scale.to(x.dtype)
        return w4a16_linear(x, self.qweight, self.scales, self.zeros, self.bias, self.impl)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"scales={str(self.scales.dtype)[6:]}, bias={self.bias is not None}, "
                f"input_scale={self.input_scale is not None}")
