"""Per-group fake quantization (quantize, then dequantize) with a straight-through backward.

One op, two implementations that agree bit for bit in fp32:

- ``fake_quant_reference``: plain PyTorch, the definition;
- ``fake_quant_triton``: one fused Triton kernel (group reduction, scale, round, clamp, dequantize and the
  clip mask in one pass), picked automatically for CUDA tensors when Triton is installed.

The grids (x is split into groups of ``group_size`` along its last dimension; ``clip_ratio`` scales the range):

- symmetric: s = clip·absmax / (2^(b−1) − 1), q = clamp(round(x/s), −(2^(b−1) − 1), 2^(b−1) − 1), x̂ = q·s;
- asymmetric: s = clip·(max − min) / (2^b − 1), z = round(−clip·min / s),
  q = clamp(round(x/s) + z, 0, 2^b − 1), x̂ = (q − z)·s.

``round`` is round-half-to-even (``torch.round``); s is floored at 1e-8 so an all-zero group stays zero.
The scale is detached (pure STE): the gradient passes to x unchanged where the clamp is inactive and is zero
where it clips (round(x/s) + z outside the grid). With ``clip_ratio = 1`` nothing clips but exact ties.
"""
from __future__ import annotations

import torch

EPS = 1e-8

try:  # optional: `pip install -c constraints.txt triton==3.7.1` (the test extra)
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - CPU installs without the extra
    triton = tl = None
    HAS_TRITON = False


def grid_bounds(bits: int, symmetric: bool) -> tuple[int, int]:
    """(qmin, qmax) of the integer grid."""
    if bits < 2:
        raise ValueError(f"bits={bits}: fake quantization needs at least 2 bits")
    if symmetric:
        return -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    return 0, 2 ** bits - 1


def _groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    n = x.shape[-1]
    g = n if group_size is None or group_size <= 0 else group_size
    if n % g:
        raise ValueError(f"group_size={g} does not divide the last dimension ({n}) of a tensor of shape "
                         f"{tuple(x.shape)}: choose a group size that divides it (or -1 for one group per row)")
    return x.reshape(-1, g), g


def fake_quant_reference(x: torch.Tensor, bits: int, group_size: int, symmetric: bool = True,
                         clip_ratio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x̂ in x's dtype, clip mask: True where the gradient passes). The definition the kernel must equal."""
    qmin, qmax = grid_bounds(bits, symmetric)
    xg, _ = _groups(x.detach(), group_size)
    xf = xg.float()
    if symmetric:
        s = (xf.abs().amax(dim=1, keepdim=True) * clip_ratio / qmax).clamp_min(EPS)
        z = torch.zeros_like(s)
    else:
        lo = xf.amin(dim=1, keepdim=True) * clip_ratio
        hi = xf.amax(dim=1, keepdim=True) * clip_ratio
        s = ((hi - lo) / (qmax - qmin)).clamp_min(EPS)
        z = torch.round(-lo / s)
    r = torch.round(xf / s) + z
    q = r.clamp(qmin, qmax)
    y = (q - z) * s
    mask = r == q
    return y.to(x.dtype).reshape(x.shape), mask.reshape(x.shape)


if HAS_TRITON:

    @triton.jit
    def _round_half_even(v):
        fl = tl.floor(v)
        f = v - fl  # exact for |v| < 2^23
        odd = fl - 2.0 * tl.floor(fl * 0.5)
        up = (f > 0.5) | ((f == 0.5) & (odd == 1.0))
        return tl.where(up, fl + 1.0, fl)

    @triton.jit
    def _fake_quant_kernel(x_ptr, y_ptr, m_ptr, n_rows, G, qmin, qmax, clip_ratio, eps,
                           SYMMETRIC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_G)
        inside = (rows[:, None] < n_rows) & (cols[None, :] < G)
        offs = rows[:, None].to(tl.int64) * G + cols[None, :]
        x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        if SYMMETRIC:
            amax = tl.max(tl.where(inside, tl.abs(x), 0.0), axis=1) * clip_ratio
            s = tl.maximum(tl.math.div_rn(amax, qmax), eps)
            z = tl.zeros_like(s)
        else:
            lo = tl.min(tl.where(inside, x, float("inf")), axis=1) * clip_ratio
            hi = tl.max(tl.where(inside, x, float("-inf")), axis=1) * clip_ratio
            live = rows < n_rows  # rows past the end would carry +-inf into the arithmetic
            lo = tl.where(live, lo, 0.0)
            hi = tl.where(live, hi, 0.0)
            s = tl.maximum(tl.math.div_rn(hi - lo, qmax - qmin), eps)
            z = _round_half_even(tl.math.div_rn(-lo, s))
        r = _round_half_even(tl.math.div_rn(x, s[:, None])) + z[:, None]
        q = tl.minimum(tl.maximum(r, qmin), qmax)
        y = (q - z[:, None]) * s[:, None]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)
        tl.store(m_ptr + offs, (r == q).to(tl.int8), mask=inside)


def fake_quant_triton(x: torch.Tensor, bits: int, group_size: int, symmetric: bool = True,
                      clip_ratio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel; same contract as ``fake_quant_reference``. CUDA tensors, or CPU under TRITON_INTERPRET=1."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton fake-quant kernel needs triton: pip install -c constraints.txt triton==3.7.1")
    qmin, qmax = grid_bounds(bits, symmetric)
    xg, g = _groups(x.detach().contiguous(), group_size)
    n_rows = xg.shape[0]
    y = torch.empty_like(xg)
    m = torch.empty(xg.shape, dtype=torch.int8, device=x.device)
    block_g = triton.next_power_of_2(g)
    block_r = max(1, min(64, 8192 // block_g))
    if n_rows:
        _fake_quant_kernel[(triton.cdiv(n_rows, block_r),)](
            xg, y, m, n_rows, g, float(qmin), float(qmax), float(clip_ratio), EPS,
            SYMMETRIC=bool(symmetric), BLOCK_R=block_r, BLOCK_G=block_g)
    return y.reshape(x.shape), m.bool().reshape(x.shape)


def _use_triton(x: torch.Tensor, impl: str) -> bool:
    if impl == "auto":
        return HAS_TRITON and x.is_cuda
    if impl == "triton":
        return True
    if impl == "torch":
        return False
    raise ValueError(f"impl={impl!r}: use auto | triton | torch")


class _FakeQuantSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bits, group_size, symmetric, clip_ratio, use_triton):
        fn = fake_quant_triton if use_triton else fake_quant_reference
        y, mask = fn(x, bits, group_size, symmetric, clip_ratio)
        ctx.save_for_backward(mask)
        return y

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask.to(grad.dtype), None, None, None, None, None


def fake_quant(x: torch.Tensor, bits: int, group_size: int = -1, symmetric: bool = True,
               clip_ratio: float = 1.0, impl: str = "auto") -> torch.Tensor:
    """Fake-quantize ``x`` per group along its last dimension, with the straight-through gradient.

    ``bits >= 16`` is full precision (identity). ``impl``: auto (Triton on CUDA, else PyTorch) | triton | torch.
    """
    if bits >= 16:
        return x
    return _FakeQuantSTE.apply(x, int(bits), int(group_size), bool(symmetric), float(clip_ratio), _use_triton(x, impl))
