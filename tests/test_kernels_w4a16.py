"""The packed int4 format round-trips exactly, and the Triton W4A16 kernel equals dequantize-then-matmul
(Triton's CPU interpreter, fp32)."""
import os

import pytest
import torch

import triton  # noqa: F401  - the test extra installs it (triton==3.7.1); a missing kernel must fail, not skip

from callbacks.kernels.fake_quant import fake_quant_reference
from callbacks.kernels.w4a16 import (PackedLinear, _use_triton, dequantize, pack_int4, quantize_rtn, unpack_int4,
                                     w4a16_linear, w4a16_reference, w4a16_triton)


def _packed(n, k, g, seed, exact=True):
    """Random codes, scales and zeros; ``exact``: powers of two and half-integers, so every product and partial sum
    of the matmul is exact in fp32 and any summation order gives the same bits."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    if exact:
        scales = 2.0 ** torch.randint(-3, 2, (n, k // g), generator=gen).float()
        zeros = torch.randint(0, 31, (n, k // g), generator=gen).float() / 2  # integers and half-integers (7.5)
    else:
        scales = torch.rand(n, k // g, generator=gen) / 8 + 1e-3
        zeros = torch.rand(n, k // g, generator=gen) * 15
    return codes, scales, zeros


CASES = [  # (M, N, K, G): M not a multiple of any block, N past one block, K a multiple of G, one group per row
    (1, 24, 64, 16),
    (37, 80, 256, 64),
    (70, 48, 128, 128),
    (5, 33, 96, 32),      # odd N, K not a multiple of the kernel's BLOCK_K
    (17, 64, 384, 384),   # tiny-lm's down_proj shape: one group per row, as the per-row RTN/GPTQ grids export
]


def test_interpreter_is_on():
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/conftest.py before any kernel import


def test_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (7, 38), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 19)
    assert torch.equal(unpack_int4(packed), codes)
    assert int(pack_int4(torch.tensor([[3, 12]]))) == 3 + 12 * 16  # even column low nibble, odd column high
    every = torch.arange(256, dtype=torch.uint8).reshape(1, 256)  # every byte value unpacks and packs back
    assert torch.equal(pack_int4(unpack_int4(every)), every)


@pytest.mark.parametrize("bad,match", [(torch.full((2, 4), 16), "0..15"), (torch.zeros(2, 3), "even in"),
                                       (torch.full((2, 4), -1), "0..15")])
def test_pack_refuses_what_it_cannot_hold(bad, match):
    with pytest.raises(ValueError, match=match):
        pack_int4(bad)


def test_dequantize_is_the_group_formula():
    codes, scales, zeros = _packed(6, 40, 8, seed=1, exact=False)
    w = dequantize(pack_int4(codes), scales, zeros)
    for n in range(6):
        for k in (0, 7, 8, 39):
            assert w[n, k] == (codes[n, k].float() - zeros[n, k // 8]) * scales[n, k // 8]
    with pytest.raises(ValueError, match="group_size"):
        dequantize(pack_int4(codes), scales[:, :3], zeros[:, :3])


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [8, 32, 64])
def test_packed_rtn_equals_fake_quant_bitwise(symmetric, group):
    """The packed format holds fake_quant's 4-bit grids exactly (asymmetric zero, symmetric zero 8)."""
    w = torch.randn(12, 64, generator=torch.Generator().manual_seed(group)) * 0.05
    codes, scales, zeros = quantize_rtn(w, group, symmetric)
    assert torch.equal(dequantize(pack_int4(codes), scales, zeros), fake_quant_reference(w, 4, group, symmetric)[0])


@pytest.mark.parametrize("m,n,k,g", CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_reference_bitwise_on_exact_inputs(m, n, k, g, bias):
    codes, scales, zeros = _packed(n, k, g, seed=m + n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randint(-4, 5, (m, k), generator=gen).float()
    b = torch.randint(-8, 8, (n,), generator=gen).float() if bias else None
    qw = pack_int4(codes)
    ref = w4a16_reference(x, qw, scales, zeros, b)
    assert torch.equal(ref, x @ ((codes.float() - zeros.repeat_interleave(g, 1)) * scales.repeat_interleave(g, 1)).T
                       + (0 if b is None else b))
    assert torch.equal(w4a16_triton(x, qw, scales, zeros, b), ref)


@pytest.mark.parametrize("m,n,k,g", CASES[:3])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_reference_on_random_inputs(m, n, k, g, scale_dtype):
    """Real-valued inputs: equal up to fp32 summation order (relative 1e-6); 3-D activations; every scale dtype."""
    codes, scales, zeros = _packed(n, k, g, seed=m, exact=False)
    scales, zeros = scales.to(scale_dtype), zeros.to(scale_dtype)
    x = torch.randn(2, m, k, generator=torch.Generator().manual_seed(n))
    qw = pack_int4(codes)
    ref = w4a16_reference(x, qw, scales, zeros)
    out = w4a16_triton(x, qw, scales, zeros)
    assert out.shape == (2, m, n)
    assert (out - ref).abs().max() <= 1e-6 * ref.abs().max()


def test_gradient_through_the_kernel_is_the_reference():
    codes, scales, zeros = _packed(40, 64, 16, seed=3, exact=False)
    layer = PackedLinear.from_codes(codes, scales, zeros, bias=torch.randn(40), scale_dtype=torch.float32)
    x = torch.randn(9, 64)
    gy = torch.randn(9, 40)
    grads = []
    for impl in ("torch", "triton"):
        layer.impl = impl
        xi = x.clone().requires_grad_(True)
        layer(xi).backward(gy)
        grads.append(xi.grad)
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=1e-6 * grads[0].abs().max())
    assert torch.allclose(grads[0], gy @ layer.dequantize())


def test_packed_linear_is_four_bit_and_round_trips_its_state_dict(tmp_path):
    from safetensors.torch import load_file, save_file

    codes, scales, zeros = _packed(48, 128, 32, seed=4, exact=False)
    s_in = torch.rand(128) + 0.5
    layer = PackedLinear.from_codes(codes, scales, zeros, input_scale=s_in)
    assert layer.qweight.dtype == torch.uint8 and layer.qweight.numel() == 48 * 64
    nbytes = sum(t.numel() * t.element_size() for t in layer.state_dict().values())
    assert nbytes == 48 * 64 + 2 * 48 * 4 * 2 + 128 * 4  # codes + fp16 scales and zeros + fp32 input scale
    save_file(layer.state_dict(), tmp_path / "layer.safetensors")
    again = PackedLinear(128, 48, group_size=32, input_scale=True)
    again.load_state_dict(load_file(tmp_path / "layer.safetensors"))
    x = torch.randn(3, 128)
    assert torch.equal(again(x), layer(x))
    assert torch.allclose(layer(x), (x / s_in) @ dequantize(pack_int4(codes), scales.half(), zeros.half()).T)


def test_auto_is_torch_on_cpu_and_bad_shapes_fail_with_one_line():
    assert _use_triton(torch.zeros(2), "auto") is False and _use_triton(torch.zeros(2), "triton") is True
    with pytest.raises(ValueError, match="use auto"):
        _use_triton(torch.zeros(2), "cuda")
    codes, scales, zeros = _packed(8, 32, 16, seed=5)
    x = torch.randn(2, 32)
    qw = pack_int4(codes)
    assert torch.equal(w4a16_linear(x, qw, scales, zeros), w4a16_reference(x, qw, scales, zeros))
    with pytest.raises(ValueError, match="input features"):
        w4a16_triton(torch.randn(2, 30), qw, scales, zeros)
    with pytest.raises(ValueError, match="does not divide"):
        PackedLinear(96, 8, group_size=64)
    with pytest.raises(ValueError, match="odd"):
        PackedLinear(33, 8, group_size=33)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_on_cuda_matches_reference(dtype):
    codes, scales, zeros = _packed(4096, 4096, 128, seed=6, exact=False)
    qw, scales, zeros = pack_int4(codes).cuda(), scales.cuda().to(dtype), zeros.cuda().to(dtype)
    x = torch.randn(333, 4096, device="cuda", dtype=dtype)
    ref = w4a16_reference(x, qw, scales, zeros).float()
    out = w4a16_linear(x, qw, scales, zeros)
    assert (out.float() - ref).abs().max() <= 2e-2 * ref.abs().max()
