"""The fused Triton fake-quant kernel equals its PyTorch reference (Triton's CPU interpreter, fp32)."""
import os

import pytest
import torch

import triton  # noqa: F401  - the test extra installs it (triton==3.7.1); a missing kernel must fail, not skip

from callbacks.kernels.fake_quant import _use_triton, fake_quant, fake_quant_reference, fake_quant_triton

CASES = [  # (shape, bits, group_size, symmetric, clip_ratio): odd shapes, partial blocks, every grid
    ((3, 7, 40), 4, 8, True, 1.0),
    ((13, 96), 4, 32, False, 1.0),
    ((5, 33), 4, -1, True, 1.0),        # one group per row, not a power of two
    ((1, 24), 3, 24, False, 0.7),        # clipping: some entries fall outside the grid
    ((67, 48), 8, 16, True, 0.6),        # more rows than one program's block
    ((2, 3, 5, 12), 2, 6, False, 1.0),
]


def test_interpreter_is_on():
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by tests/conftest.py before any kernel import


@pytest.mark.parametrize("shape,bits,group,sym,clip", CASES)
def test_kernel_equals_reference_bitwise(shape, bits, group, sym, clip):
    torch.manual_seed(hash((shape, bits, group)) % 1000)
    x = torch.randn(*shape) * 3
    x.view(-1)[::7] *= 20  # outliers
    y_ref, m_ref = fake_quant_reference(x, bits, group, sym, clip)
    y_tri, m_tri = fake_quant_triton(x, bits, group, sym, clip)
    assert torch.equal(y_tri, y_ref)
    assert torch.equal(m_tri, m_ref)
    if clip < 1:
        assert (~m_ref).any()  # the clip mask is exercised


def test_kernel_gradient_is_the_reference_ste():
    torch.manual_seed(5)
    x = torch.randn(9, 40)
    g = torch.randn(9, 40)
    grads = []
    for impl in ("torch", "triton"):
        xi = x.clone().requires_grad_(True)
        fake_quant(xi, 4, 8, symmetric=True, clip_ratio=0.5, impl=impl).backward(g)
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1])
    assert (grads[0] == 0).any() and (grads[0] == g).any()


def test_auto_selects_triton_on_cuda_only():
    assert _use_triton(torch.zeros(2), "auto") is False
    assert _use_triton(torch.zeros(2), "triton") is True
    with pytest.raises(ValueError, match="use auto"):
        _use_triton(torch.zeros(2), "cuda")


@pytest.mark.gpu
def test_kernel_on_cuda_matches_reference():
    x = torch.randn(4096, 1024, device="cuda")
    y_ref, m_ref = fake_quant_reference(x, 4, 128, True)
    y = fake_quant(x, 4, 128)
    assert _use_triton(x, "auto")
    assert torch.equal(y, y_ref)
