"""The shared quantization package: rate accounting, the R(D) limit, RTN/GPTQ, and the driver on a tiny backbone."""
import math

import pytest
import torch

from lightning_modules.common.quantize import GPTQ, RTN, LayerStats, column_entropy_bits, entropy_bits
from lightning_modules.common.quantize.limits import (SPACE_FILLING_GAP, distortion_rate, rate_distortion,
                                                      whitened_eigenvalues)
from lightning_modules.common.quantize.rate import RateReport, row_and_column_side_bits


def _spread_sigma(n, seed=0, lo=-3.0, hi=0.0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.logspace(lo, hi, n, dtype=torch.float64)) @ q.T


def test_entropy_helpers():
    assert entropy_bits(torch.tensor([0, 1] * 50)) == pytest.approx(1.0)
    assert entropy_bits(torch.tensor([0, 1, 2, 3] * 25)) == pytest.approx(2.0)
    assert entropy_bits(torch.full((77,), 5)) == 0.0
    # per-column entropy: column 0 uniform on 4 symbols (2 bits), column 1 constant (0 bits) -> mean 1 bit,
    # while the pooled histogram (5/8 of the mass on one symbol) gives a different figure
    codes = torch.stack([torch.tensor([0, 1, 2, 3] * 4), torch.zeros(16, dtype=torch.long)], 1)
    assert column_entropy_bits(codes) == pytest.approx(1.0)
    p = torch.tensor([5 / 8, 1 / 8, 1 / 8, 1 / 8])
    assert entropy_bits(codes) == pytest.approx(float(-(p * p.log2()).sum()))


def test_rate_report_side_information():
    # WaterSIC: a=64 rows, n=32 columns of which 4 dead; H = 2 bits per live code
    r = RateReport(rows=64, cols=32, live_cols=28, entropy_pooled=2.0, entropy_column=1.5,
                   side_bits=row_and_column_side_bits(64, 28, 4))
    assert r.bits == pytest.approx((2.0 * 64 * 28 + 16 * 64 + 16 * 28 + 16 * 4) / (64 * 32))
    assert r.bits_column == pytest.approx((1.5 * 64 * 28 + 16 * (64 + 32)) / (64 * 32))


def test_limit_matches_closed_form_at_identity():
    lam = whitened_eigenvalues(torch.eye(16, dtype=torch.float64), 2.0)  # S_w = 2I
    for d in (0.5, 0.1, 0.01):
        assert rate_distortion(lam, d) == pytest.approx(0.5 * math.log2(2.0 / d), abs=1e-9)
    assert rate_distortion(lam, 3.0) == 0.0
    assert distortion_rate(lam, 3.0) == pytest.approx(2.0 * 2 ** -6, rel=1e-9)
    assert SPACE_FILLING_GAP == pytest.approx(0.2546, abs=1e-4)


def test_limit_reverse_waterfilling_on_spread_spectrum():
    # two components λ = (4, 0.01): at D = 0.5·(θ + 0.01) with θ = 1 only the big one is coded
    lam = torch.tensor([4.0, 0.01], dtype=torch.float64)
    d = 0.5 * (1.0 + 0.01)
    assert rate_distortion(lam, d) == pytest.approx(0.5 * 0.5 * math.log2(4.0), abs=1e-9)
    # R(D) and D(R) are inverses
    lam = whitened_eigenvalues(_spread_sigma(24), 1.0)
    assert rate_distortion(lam, distortion_rate(lam, 2.5)) == pytest.approx(2.5, abs=1e-6)


def test_gptq_equals_rtn_at_identity_and_without_feedback():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 48, generator=g, dtype=torch.float64)
    eye = LayerStats(torch.eye(48, dtype=torch.float64))
    spread = LayerStats(_spread_sigma(48, seed=2))
    for bits in (2, 3):
        rtn = RTN().quantize(w, None, bits)
        assert torch.equal(GPTQ().quantize(w, eye, bits).weight, rtn.weight)
        assert torch.equal(GPTQ(error_feedback=False).quantize(w, spread, bits).weight, rtn.weight)


def test_gptq_output_error_below_rtn_on_correlated_sigma():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 64, generator=g, dtype=torch.float64)
    stats = LayerStats(_spread_sigma(64, seed=4))
    for bits in (2, 3, 4):
        e_gptq = stats.output_error(w, GPTQ().quantize(w, stats, bits).weight)
        e_rtn = stats.output_error(w, RTN().quantize(w, stats, bits).weight)
        assert e_gptq < 0.8 * e_rtn


def test_rtn_grid_levels_and_rates():
    w = torch.randn(8, 40, dtype=torch.float64)
    res = RTN().quantize(w, None, 2)
    assert res.codes.unique().numel() <= 4 and res.info["levels"] == 4
    assert res.rate.bits == pytest.approx(2 + 16 / 40)  # log-cardinality + one fp16 scale per row
    # every row's extreme value is reproduced in magnitude by the mid-rise grid's outermost level
    assert torch.allclose(res.weight.abs().amax(1), w.abs().amax(1))
    huff = GPTQ(extra_bit=True).quantize(w, LayerStats(torch.eye(40, dtype=torch.float64)), 2)
    assert huff.info["levels"] == 7 and huff.rate.accounting == "pooled"
    assert huff.rate.bits == pytest.approx(entropy_bits(huff.codes) + 16 / 40)
