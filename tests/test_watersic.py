"""WaterSIC against the spec: step identity, the gap to R(D), rate targeting, dead columns, rescalers, GPTQ."""
import math

import pytest
import torch

from lightning_modules.common.quantize import GPTQ, HuffmanGPTQ, LayerStats
from lightning_modules.common.quantize.limits import rate_distortion, whitened_eigenvalues
from lightning_modules.watersic import WaterSIC
from lightning_modules.watersic.quantizer import entropy_target, secant_search, sic, watersic_step


def _spread_sigma(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.logspace(-3, 0, n, dtype=torch.float64)) @ q.T


@pytest.fixture(scope="module")
def gaussian():
    return torch.randn(4096, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_step_identity_alpha_times_ljj_is_c():
    w = torch.randn(256, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    chol = torch.linalg.cholesky(_spread_sigma(32))
    c, alpha = watersic_step(w, chol, 3.0)
    assert torch.allclose(alpha * torch.diagonal(chol), torch.full((32,), c, dtype=torch.float64), rtol=0, atol=1e-14 * c)
    # c follows the formula sqrt(12·geomean(s_j L_jj²))·2^{-R}
    s = (w ** 2).mean(0)
    geo = math.exp(float(torch.log(s * torch.diagonal(chol) ** 2).mean()))
    assert c == pytest.approx(math.sqrt(12 * geo) * 2 ** -3, rel=1e-12)
    res = WaterSIC(target_rate=False, rescalers=False).quantize(w, LayerStats(_spread_sigma(32)), 3.0)
    assert torch.allclose(res.info["alpha"] * res.info["chol_diag"], torch.full((32,), res.info["c"], dtype=torch.float64))


@pytest.mark.parametrize("rate", [3.0, 4.0])
def test_gap_to_rate_distortion_at_identity(gaussian, rate):
    """Σ = I, iid N(0,1) weights: entropy (no side information) − R(D) ≈ ½log₂(πe/6) = 0.2546 bit."""
    stats = LayerStats(torch.eye(64, dtype=torch.float64))
    lam = whitened_eigenvalues(stats.sigma, 1.0)
    for rescalers in (False, True):
        res = WaterSIC(rescalers=rescalers).quantize(gaussian, stats, rate)
        gap = res.rate.entropy_pooled - rate_distortion(lam, stats.output_error(gaussian, res.weight))
        assert 0.235 <= gap <= 0.27, (rescalers, gap)


def test_sic_returned_reconstruction_is_rounding_plus_lmmse_in_whitened_domain(gaussian):
    """On the Ŵ that ``sic`` returns: column j of the whitened error E = (W − Ŵ)L is y_j − γ_j c z_j, where y_j is
    what SIC saw and z_j = round(y_j/c). So (a) E_j ⟂ z_j (the LMMSE gain) and (b) |E_j − (1 − γ_j) c z_j| ≤ c/2
    (the rounding). Wrong feedback, steps or gains break one of them."""
    sigma = _spread_sigma(64, seed=5)
    chol = torch.linalg.cholesky(sigma)
    w = gaussian[:512]
    c, alpha = watersic_step(w, chol, 3.0)
    z, w_hat, gamma = sic(w @ chol, chol, c, alpha, block=16)  # several blocks: the lazy updates are covered
    assert torch.equal(z, torch.round(z)) and float(z.abs().max()) > 4  # integer codes, no clipping to 2^R levels
    assert torch.allclose(w_hat, gamma * alpha * z, rtol=0, atol=1e-12)  # Ŵ_j = γ_j α_j z_j
    err = (w - w_hat) @ chol
    assert float((z * err).sum(0).abs().max()) < 1e-9 * float((w @ chol).abs().sum())
    assert float((err - (1 - gamma) * c * z).abs().max()) <= c / 2 + 1e-9
    assert float(err.abs().max()) > c / 2  # the gains moved the error off the rounding cell: (b) is not vacuous
    assert 0.9 < float(gamma.mean()) < 1.0  # LMMSE gains shrink slightly
    # without feedback (chol diagonal only) the same codes would not come out: the cancellation matters
    z_nofb, _, _ = sic(w @ chol, torch.diag(torch.diagonal(chol)), c, alpha)
    assert not torch.equal(z_nofb, z)


@pytest.mark.parametrize("powers,min_rows", [("all", 128), ("sample", 0)])
def test_rate_targeting_lands_on_the_whole_layer(powers, min_rows):
    """The search runs on ~10% of the rows; the tolerance must hold for the whole layer's reported rate."""
    w = torch.randn(2048, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    stats = LayerStats(_spread_sigma(64, seed=3))
    for rate in (1.5, 3.25):
        q = WaterSIC(rescalers=False, search_column_powers=powers, search_min_rows=min_rows)
        res = q.quantize(w, stats, rate)
        assert abs(res.rate.bits - rate) < 0.005, (rate, res.rate.bits)
        assert abs(res.info["landing"]) < 0.005 and len(res.info["secant"]) <= 6
        # the landing is measured on the whole layer: the reported entropy is the one the check saw
        assert res.info["landing"] == pytest.approx(res.rate.entropy_pooled - entropy_target(rate, 2048, 64, 64))
    # the loop itself on a known smooth map: H(r) = 0.9 r + 0.3 sin(r), target 2.2, from H* or from a given start
    for start in (None, 5.0):
        r, h, evals = secant_search(lambda r: 0.9 * r + 0.3 * math.sin(r), 2.2, start=start)
        assert abs(h - 2.2) < 0.005 and len(evals) <= 6 and evals[0][0] == (2.2 if start is None else start)


def test_release_search_switches_reproduce_the_released_search():
    """search_min_rows=0, search_column_powers=sample, full_layer_search=false: the secant on int(0.1·a) rows (a = 2047:
    204, not 205) with the sampled rows' column powers, then one whole-layer pass at its r, nothing more. The spec's
    steps composed by hand give the same codes."""
    from lightning_modules.common.quantize.rate import entropy_bits

    a, n, rate = 2047, 48, 2.5
    w = torch.randn(a, n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    sigma = _spread_sigma(n, seed=6)
    q = WaterSIC(rescalers=False, search_min_rows=0, search_column_powers="sample", full_layer_search=False, seed=7)
    res = q.quantize(w, LayerStats(sigma), rate)
    assert res.info["search_rows"] == 204 and "secant_full" not in res.info
    # by hand: the same 204 rows, s_j from them, fp32 search, then one fp64 pass over the whole layer at that r
    chol = torch.linalg.cholesky(sigma + 1e-4 * float(torch.diagonal(sigma).mean()) * torch.eye(n, dtype=torch.float64))
    target = w @ chol + 0.0  # plain mode: (WΣ + μW) L^{-T} = W L
    rows = torch.randperm(a, generator=torch.Generator().manual_seed(7))[:204]
    h_star = entropy_target(rate, a, n, n)

    def sample_entropy(r):
        c, al = watersic_step(w[rows], chol, r)
        return entropy_bits(sic(target[rows].float(), chol.float(), c, al.float())[0])

    r, _, evals = secant_search(sample_entropy, h_star)
    c, al = watersic_step(w, chol, r)
    z = sic(target, chol, c, al)[0]
    assert res.info["r"] == r and res.info["secant"] == evals
    assert torch.equal(res.codes, z.to(torch.int64))
    assert res.info["landing"] == pytest.approx(entropy_bits(z) - h_star)
    # ours on the same layer: 204 rows too (at least 128), and the whole layer's rate is within the tolerance
    ours = WaterSIC(rescalers=False, seed=7).quantize(w, LayerStats(sigma), rate)
    assert ours.info["search_rows"] == 204 and abs(ours.info["landing"]) < 0.005


def test_entropy_target_inverts_the_accounting():
    # no dead columns: H* = R − 16/a − 16/n either way
    for inflate in (True, False):
        assert entropy_target(3.0, 128, 64, 64, inflate) == pytest.approx(3.0 - 16 / 128 - 16 / 64)
    # 4 dead of 32 columns: inflated, the live codes pay for the dead ones and the total is R
    h = entropy_target(3.0, 64, 32, 28)
    assert (h * 64 * 28 + 16 * (64 + 28 + 4)) / (64 * 32) == pytest.approx(3.0)
    assert entropy_target(3.0, 64, 32, 28, inflate_dead=False) == pytest.approx(3.0 - 16 / 64 - 16 / 32)


@pytest.mark.parametrize("rate_control,expected", [(False, 3.0), (True, 2.806122)])
def test_dead_columns_inflate_the_target_only_without_rate_control(rate_control, expected):
    """8 dead columns of a 112×112 layer at 3 bits. Without global rate control the live codes pay for the dead
    columns (the layer lands on 3 bits); under rate control the target is R − 16/a − 16/n as released, so the layer
    spends ((3 − 2·16/112)·112·104 + 16·(112 + 104 + 8))/112² = 2.8061 bits and the later layers get the rest."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(4000, 112, generator=g, dtype=torch.float64)
    x[:, :8] = 0.0
    w = torch.randn(112, 112, generator=g, dtype=torch.float64)
    res = WaterSIC().quantize(w, LayerStats(x.T @ x / x.shape[0]), 3.0, rate_control=rate_control)
    assert res.info["dead_columns"] == 8
    assert res.rate.bits == pytest.approx(expected, abs=0.005)
    assert res.rate.bits == pytest.approx((res.rate.entropy_pooled * 112 * 104 + 16 * (112 + 104 + 8)) / 112 ** 2)


def test_dead_columns_come_back_as_zeros_and_are_charged():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2000, 40, generator=g, dtype=torch.float64)
    x[:, [3, 17]] = 0.0          # never active
    x[:, 25] *= 1e-3             # Σ_jj ~ 1e-6 < 1e-3 · median
    sigma = x.T @ x / x.shape[0]
    w = torch.randn(128, 40, generator=g, dtype=torch.float64)
    res = WaterSIC(target_rate=False).quantize(w, LayerStats(sigma), 3.0)
    assert res.info["dead_columns"] == 3
    assert torch.all(res.weight[:, [3, 17, 25]] == 0) and torch.all(res.codes[:, [3, 17, 25]] == 0)
    live = [j for j in range(40) if j not in (3, 17, 25)]
    from lightning_modules.common.quantize import entropy_bits

    h = entropy_bits(res.codes[:, live])
    assert res.rate.bits == pytest.approx((h * 128 * 37 + 16 * 128 + 16 * 37 + 16 * 3) / (128 * 40))


def test_rescalers_never_increase_the_output_error():
    w = torch.randn(256, 48, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    stats = LayerStats(_spread_sigma(48, seed=7))
    plain = WaterSIC(target_rate=False, rescalers=False).quantize(w, stats, 2.0)
    resc = WaterSIC(target_rate=False, rescalers=True).quantize(w, stats, 2.0)
    assert torch.equal(plain.codes, resc.codes)  # rescalers change scales only, so the rate is unchanged
    assert stats.output_error(w, resc.weight) <= stats.output_error(w, plain.weight) * (1 + 1e-9)


def test_watersic_beats_huffman_gptq_at_equal_rate_on_spread_sigma():
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    stats = LayerStats(_spread_sigma(64, seed=9))
    huff = HuffmanGPTQ().quantize(w, stats, 3.0)
    ws = WaterSIC(search_fraction=1.0).quantize(w, stats, huff.rate.bits)  # same rate, side info included
    assert abs(ws.rate.bits - huff.rate.bits) < 0.01
    assert stats.output_error(w, ws.weight) < stats.output_error(w, huff.weight)
    assert GPTQ(extra_bit=True).name == "huffman_gptq"


def test_sequential_target_reduces_to_plain_when_inputs_are_exact():
    w = torch.randn(128, 32, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    sigma = _spread_sigma(32, seed=11)
    a = WaterSIC(target_rate=False).quantize(w, LayerStats(sigma), 2.5)
    b = WaterSIC(target_rate=False).quantize(w, LayerStats(sigma, cross=sigma.clone(), sigma_x=sigma.clone()), 2.5)
    assert torch.equal(a.codes, b.codes)
    assert torch.allclose(a.weight, b.weight, atol=1e-10)


def test_qronos_target_reaches_the_least_squares_map_at_high_rate():
    """Sequential mode minimises E‖Wx − Ŵx̂‖²: at a high rate Ŵ → W Σ_{XX̂} Σ_X̂⁻¹, not W (planted input error)."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(20000, 16, generator=g, dtype=torch.float64)
    mix = torch.eye(16, dtype=torch.float64) + 0.2 * torch.randn(16, 16, generator=g, dtype=torch.float64)
    xh = x @ mix + 0.05 * torch.randn(20000, 16, generator=g, dtype=torch.float64)  # the quantized model's inputs
    n = x.shape[0]
    stats = LayerStats(xh.T @ xh / n, cross=x.T @ xh / n, sigma_x=x.T @ x / n)
    w = torch.randn(64, 16, generator=g, dtype=torch.float64)
    res = WaterSIC(target_rate=False, rescalers=False, percdamp=0.0).quantize(w, stats, 14.0)
    ls = w @ stats.cross @ torch.linalg.inv(stats.sigma)
    assert torch.allclose(res.weight, ls, atol=1e-3 * float(ls.abs().max()))
    assert stats.output_error(w, res.weight) < 0.05 * stats.output_error(w, w)


def test_rate_targeted_huffman_gptq_lands_on_the_entropy_rate_and_keeps_the_nominal_grid():
    """The fair baseline at the same entropy rate: reported rate within tol of any target; at an integer r the
    continuous grid is the nominal 2^{r+1}−1-level grid (identical codes)."""
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    stats = LayerStats(_spread_sigma(64, seed=13))
    for target in (1.7, 2.5, 3.0):
        res = HuffmanGPTQ(target_rate=True).quantize(w, stats, target)
        assert abs(res.rate.bits - target) < 0.005, (target, res.rate.bits, res.info["secant"])
    from lightning_modules.common.quantize.gptq import gptq_quantize
    from lightning_modules.common.quantize.rtn import levels_for_rate

    absmax = w.abs().amax(1, keepdim=True)
    _, nominal = gptq_quantize(w, stats.sigma, levels_for_rate(3, extra_bit=True), 0.01)
    _, cont = gptq_quantize(w, stats.sigma, 2 * 7 + 1, 0.01, scale=absmax / (2.0 ** 3 - 1))
    assert torch.equal(nominal, cont)
    with pytest.raises(ValueError, match="huffman_gptq"):
        GPTQ(target_rate=True)


def test_residual_compensation_reaches_the_least_squares_solution_at_high_rate():
    """Planted truth: inputs x̂ = x + noise, residual error ΔR = M·x̂ + noise. At a high rate WaterSIC's Ŵ tends to
    the minimiser of E‖Wx + ΔR − Ŵx̂‖², (WΣ_XX̂ + Σ_ΔR,X̂)Σ_X̂⁻¹, which is far from the uncompensated one."""
    g = torch.Generator().manual_seed(14)
    a, n, t = 48, 16, 20000
    x = torch.randn(t, n, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(_spread_sigma(n, seed=15)).T
    xh = x + 0.1 * torch.randn(t, n, generator=g, dtype=torch.float64)
    w = torch.randn(a, n, generator=g, dtype=torch.float64)
    m = 0.3 * torch.randn(a, n, generator=g, dtype=torch.float64)
    dr = xh @ m.T + 0.05 * torch.randn(t, a, generator=g, dtype=torch.float64)
    base = LayerStats(xh.T @ xh / t, x.T @ xh / t, x.T @ x / t)
    comp = LayerStats(base.sigma, base.cross, base.sigma_x, residual_cross=dr.T @ xh / t)
    best = (w @ comp.cross + comp.residual_cross) @ torch.linalg.inv(comp.sigma)
    q = WaterSIC(target_rate=False, percdamp=0.0)
    hat = q.quantize(w, comp, 12.0).weight
    assert float((hat - best).norm() / best.norm()) < 1e-3
    plain = q.quantize(w, base, 12.0).weight
    assert float((plain - best).norm() / best.norm()) > 0.1
    obj = lambda wh: float(((x @ w.T + dr - xh @ wh.T) ** 2).mean())
    assert obj(hat) < 0.5 * obj(plain)


def test_zero_out_rows_quantizes_the_rest_alone_and_charges_the_layer():
    from lightning_modules.common.quantize.driver import quantize_rows

    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    stats = LayerStats(_spread_sigma(32, seed=17))
    q = WaterSIC(target_rate=False)
    hat, rep = quantize_rows(q, w, stats, 3.0, False, [3, 40])
    keep = [i for i in range(64) if i not in (3, 40)]
    alone = q.quantize(w[keep], stats, 3.0)
    assert torch.equal(hat[[3, 40]], torch.zeros(2, 32, dtype=torch.float64)) and torch.equal(hat[keep], alone.weight)
    assert rep["bits"] == pytest.approx(alone.rate.bits * 62 / 64, rel=1e-12)
    with pytest.raises(ValueError, match="zero_out_rows"):
        quantize_rows(q, w, stats, 3.0, False, [64])


def test_zero_out_rows_of_the_release_readme_reach_the_qwen3_experiment():
    """The release README's Qwen3-8B string, as watersic_qwen3_8b carries it, picks exactly those rows of exactly
    the gate and up projections of blocks 6 and 16 (not 26 or 36: the block index is matched whole)."""
    from hydra.utils import instantiate

    from lightning_modules.watersic.module import parse_zero_out_rows
    from runner import compose

    readme = "6.w1:5723,8518;6.w3:5723,8518;16.w1:2271,1875;16.w3:2271,1875"
    rows = {"layers.6.mlp.gate_proj": [5723, 8518], "layers.6.mlp.up_proj": [5723, 8518],
            "layers.16.mlp.gate_proj": [2271, 1875], "layers.16.mlp.up_proj": [2271, 1875]}
    assert parse_zero_out_rows(readme) == parse_zero_out_rows(readme.replace(";", "; ")) == rows
    assert parse_zero_out_rows("3.wq:1; 3.wq:2; 0.w2:7") == {"layers.3.self_attn.q_proj": [1, 2],
                                                            "layers.0.mlp.down_proj": [7]}
    for bad in ("6.w4:1", "6w1:1", "6.w1:", "6.w1:1,x"):
        with pytest.raises(ValueError, match=r"model.zero_out_rows entry .*<block>.<matrix>:<row>,<row>"):
            parse_zero_out_rows(bad)
    module = instantiate(compose("watersic_qwen3_8b").model)
    assert module.extras["zero_out_rows"] == rows
    names = [f"model.layers.{i}.{m}" for i in range(36) for m in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj",
                                                                  "mlp.down_proj")]
    picked = {n: sorted({r for k, v in rows.items() if k in n for r in v}) for n in names}  # the driver's matching
    assert {n: r for n, r in picked.items() if r} == {
        "model.layers.6.mlp.gate_proj": [5723, 8518], "model.layers.6.mlp.up_proj": [5723, 8518],
        "model.layers.16.mlp.gate_proj": [1875, 2271], "model.layers.16.mlp.up_proj": [1875, 2271]}


def test_golden_section_finds_the_minimum():
    from lightning_modules.common.quantize.driver import golden_section

    calls = []
    arg, val = golden_section(lambda v: calls.append(v) or (v - 0.3) ** 2 + 1, 0.0, 1.0, 10)
    assert abs(arg - 0.3) < 0.618 ** 10 and val == pytest.approx(1 + (arg - 0.3) ** 2) and len(calls) == 12
