"""Fake quantization: bit-exact grids on hand-made inputs, the STE gradient, layers and per-module overrides."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from callbacks.kernels.fake_quant import fake_quant, fake_quant_reference, grid_bounds
from lightning_modules.common.fake_quant import FakeQuantLinear, QuantSpec, quantize_model


def test_grid_bounds():
    assert grid_bounds(4, True) == (-7, 7)
    assert grid_bounds(4, False) == (0, 15)
    assert grid_bounds(8, True) == (-127, 127)
    with pytest.raises(ValueError, match="at least 2 bits"):
        grid_bounds(1, True)


def test_symmetric_levels_bit_exact():
    # group 1: absmax 7 -> s = 7/7 = 1; group 2: absmax 14 -> s = 2. round is half-to-even.
    x = torch.tensor([[-7.0, -2.5, 0.0, 1.5, 3.49, 7.0, 0.5, -6.6],
                      [14.0, 3.0, -5.0, 1.0, -14.0, 2.9, 9.0, 0.0]])
    y = fake_quant(x, bits=4, group_size=8, symmetric=True)
    expected = torch.tensor([[-7.0, -2.0, 0.0, 2.0, 3.0, 7.0, 0.0, -7.0],
                             [14.0, 4.0, -4.0, 0.0, -14.0, 2.0, 8.0, 0.0]])  # 9/2 = 4.5 -> 4
    assert torch.equal(y, expected)
    # groups of 4 along the row, each with its own scale: [-7, -2.5, 0, 1.5] (s = 1), [3.49, 7, .5, -6.6] (s = 1),
    # [14, 3, -5, 1] (s = 2), [-14, 2.9, 9, 0] (s = 2)
    y4 = fake_quant(x, bits=4, group_size=4, symmetric=True)
    assert torch.equal(y4, expected)
    # a group whose absmax is 3.5 has s = 0.5: levels are multiples of 0.5
    y5 = fake_quant(torch.tensor([[3.5, 0.3, -1.2, 0.75]]), bits=4, group_size=4)
    assert torch.equal(y5, torch.tensor([[3.5, 0.5, -1.0, 1.0]]))  # 0.6 -> 1, -2.4 -> -2, 1.5 -> 2


def test_asymmetric_levels_bit_exact():
    # min -3, max 12 -> s = 15/15 = 1, z = round(3) = 3; q = clamp(round(x) + 3, 0, 15); x̂ = q - 3
    x = torch.tensor([[-3.0, 12.0, 0.5, 4.4, 1.5, -2.5, 2.5, 11.6]])
    y = fake_quant(x, bits=4, group_size=8, symmetric=False)
    assert torch.equal(y, torch.tensor([[-3.0, 12.0, 0.0, 4.0, 2.0, -2.0, 2.0, 12.0]]))
    # 2 bits, min -1 max 2 -> s = 1, z = 1: levels {-1, 0, 1, 2}
    y2 = fake_quant(torch.tensor([[-1.0, 0.4, 0.6, 2.0]]), bits=2, group_size=4, symmetric=False)
    assert torch.equal(y2, torch.tensor([[-1.0, 0.0, 1.0, 2.0]]))
    # the zero-point is rounded: min 0.25, max 3.25 at 2 bits -> s = 1, z = round(-0.25) = 0
    y3 = fake_quant(torch.tensor([[0.25, 3.25, 1.6, 2.4]]), bits=2, group_size=4, symmetric=False)
    assert torch.equal(y3, torch.tensor([[0.0, 3.0, 2.0, 2.0]]))


def test_all_zero_group_stays_zero_and_g1_is_lossless():
    z = torch.zeros(2, 8)
    assert torch.equal(fake_quant(z, 4, 4), z)
    x = torch.randn(5, 16)
    # one value per group: it is its own absmax, so it sits exactly on the grid's top level
    assert torch.allclose(fake_quant(x, 4, 1, symmetric=True), x, rtol=1e-6, atol=0)


def test_ste_gradient_identity_inside_zero_where_clipped():
    torch.manual_seed(0)
    x = (torch.randn(4, 32) * 2).requires_grad_(True)
    upstream = torch.randn(4, 32)
    fake_quant(x, 4, 16, symmetric=True).backward(upstream)
    assert torch.equal(x.grad, upstream)  # clip_ratio 1: nothing clips, the gradient passes unchanged
    # clip at half the absmax: entries whose rounded level falls outside [-7, 7] get zero gradient
    x.grad = None
    y = fake_quant(x, 4, 16, symmetric=True, clip_ratio=0.5)
    y.backward(upstream)
    xg = x.detach().reshape(-1, 16)
    s = xg.abs().amax(1, keepdim=True) * 0.5 / 7
    inside = (torch.round(xg / s).abs() <= 7).reshape(4, 32)
    assert (~inside).sum() > 10 and inside.sum() > 10
    assert torch.equal(x.grad, upstream * inside)
    # clipped entries sit on the extreme level ±7·s
    top = (7 * s).expand(-1, 16).reshape(4, 32)
    assert torch.allclose(y.detach().abs()[~inside], top[~inside])
    # the scale is detached: a gradient that is constant per group does not change with the scale
    x2 = torch.tensor([[1.0, -3.0, 2.0, 0.5]], requires_grad=True)
    fake_quant(x2, 4, 4, symmetric=False).sum().backward()
    assert torch.equal(x2.grad, torch.ones_like(x2))


def test_activation_groups_are_per_token():
    torch.manual_seed(1)
    x = torch.randn(2, 3, 8)
    x[0, 0] *= 100  # an outlier token must not change the other tokens' scales
    y = fake_quant(x, 4, 4)
    for b in range(2):
        for t in range(3):
            for g in range(2):
                part = x[b, t, 4 * g:4 * g + 4].reshape(1, 4)
                assert torch.equal(y[b, t, 4 * g:4 * g + 4], fake_quant(part, 4, 4)[0])


def test_sixteen_bits_is_identity_and_bad_group_is_one_clear_error():
    x = torch.randn(3, 8)
    assert fake_quant(x, 16, 4) is x
    with pytest.raises(ValueError, match="group_size=3 does not divide"):
        fake_quant(x, 4, 3)
    with pytest.raises(ValueError, match="does not divide in_features=10"):
        FakeQuantLinear(10, 4, w_group_size=4, a_group_size=4)


def test_fake_quant_linear_matches_manual_computation():
    torch.manual_seed(2)
    lin = nn.Linear(16, 6)
    layer = FakeQuantLinear.from_linear(lin, QuantSpec(w_bits=4, a_bits=8, group_size=8, a_symmetric=False))
    assert layer.weight is lin.weight  # shares the parameter, no copy
    x = torch.randn(3, 5, 16)
    wq, _ = fake_quant_reference(lin.weight, 4, 8, True)
    xq, _ = fake_quant_reference(x, 8, 8, False)
    assert torch.equal(layer(x), F.linear(xq, wq, lin.bias))
    # weight groups run along the input dimension: rows of W are quantized independently in blocks of G
    w = lin.weight.detach()
    assert torch.equal(wq[2, 8:], fake_quant(w[2:3, 8:], 4, 8)[0])


def test_quantize_model_swaps_linears_keeps_embeddings_and_head_and_applies_overrides():
    from lightning_modules.common.backbone import build_backbone

    spec = {"family": "llama", "dtype": "float32", "config": dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)}
    torch.manual_seed(3)
    model = build_backbone(spec)
    ids = torch.randint(0, 64, (2, 12))
    before = model(input_ids=ids).logits
    replaced = quantize_model(model, {"w_bits": 4, "a_bits": 4, "group_size": 16,
                                      "overrides": {"*down_proj": {"a_bits": 8}}})
    names = sorted(replaced)
    assert len(names) == 2 * 7 and all(n.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj") for n in names)
    assert type(model.lm_head) is nn.Linear and isinstance(model.model.embed_tokens, nn.Embedding)
    assert all(m.a_bits == (8 if n.endswith("down_proj") else 4) and m.w_bits == 4 for n, m in replaced.items())
    after = model(input_ids=ids).logits
    assert not torch.allclose(before, after) and torch.isfinite(after).all()
    with pytest.raises(ValueError, match="unknown fields"):
        quantize_model(build_backbone(spec), {"overrides": {"*": {"bitz": 3}}})


def test_planted_outlier_channel_drives_a4_error_and_a8_removes_it():
    """The paper's FC2 finding as a mechanism: one large-magnitude input channel inflates every per-token group
    scale it sits in, so 4-bit activations lose the other channels; 8 bits on that layer keeps them."""
    torch.manual_seed(4)
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    x_out = x.clone()
    x_out[:, 5] *= 60.0  # an outlier channel, as in the FC2 (down-projection) input
    rest = x_out.clone()
    rest[:, 5] = 0
    scale_plain, scale_rest = lin(x).norm(), lin(rest).norm()  # the output carried by the ordinary channels

    def err(a_bits, inp, norm):
        layer = FakeQuantLinear.from_linear(lin, QuantSpec(w_bits=16, a_bits=a_bits, group_size=64))
        with torch.no_grad():
            return float((layer(inp) - lin(inp)).norm() / norm)

    e4_plain, e4_out, e8_out = err(4, x, scale_plain), err(4, x_out, scale_rest), err(8, x_out, scale_rest)
    assert e4_out > 0.6 and e4_plain < 0.2  # the outlier costs the ordinary channels most of their signal
    assert e8_out < e4_out / 5 and e8_out < 2 * e4_plain  # FC2-A8: back to the outlier-free A4 level
    xq4 = fake_quant(x_out, 4, 64)          # most ordinary channels round to zero under the outlier's scale
    assert torch.count_nonzero(xq4[:, torch.arange(64) != 5]) < 0.3 * 16 * 63
