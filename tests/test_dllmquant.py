"""DLLMQuant: token-weighted statistics (CGQ) on the shared driver, TMAS, IA-AQ, AWQ, W4A4 plumbing, and the tiny run."""
import pytest
import torch
from torch import nn

from callbacks.kernels.fake_quant import fake_quant_reference
from lightning_modules.common import fake_quant
from lightning_modules.common.quantize import GPTQ, RTN, LayerStats
from lightning_modules.common.quantize.calibration import MomentCollector
from lightning_modules.common.quantize.driver import quantize_model
from lightning_modules.dllmquant import cgq, iaaq, tmas
from lightning_modules.dllmquant.awq import AWQ
from tests.helpers import run_experiment


class _Toy(nn.Module):
    """Embedding + one residual MLP block in a ModuleList (what the driver quantizes)."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(40, 16)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))])

    def forward(self, input_ids):
        h = self.emb(input_ids)
        for blk in self.layers:
            h = h + blk(h)
        return h


def _batches(weights=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(3):
        b = {"input_ids": torch.randint(0, 40, (4, 12), generator=g)}
        if weights is not None:
            b["token_weight"] = weights(b["input_ids"])
        out.append(b)
    return out


def _quantized(batches, quantizer=None):
    model = _Toy()
    quantize_model(model, quantizer or GPTQ(percdamp=0.01), batches, 3, with_limit=False, log=None)
    return [m.weight.detach().clone() for m in model.layers[0] if isinstance(m, nn.Linear)]


def test_weighted_moments_match_the_formula_and_ones_reproduce_the_plain_mean():
    lin = nn.Linear(6, 3)
    x = torch.randn(2, 5, 6)
    c = torch.rand(2, 5, dtype=torch.float64) + 0.1
    flat, cf = x.reshape(-1, 6).double(), c.reshape(-1)
    want = sum(cf[j] * torch.outer(flat[j], flat[j]) for j in range(10)) / cf.sum()
    runs = {}
    for name, w in (("weighted", c), ("ones", torch.ones(2, 5)), ("plain", None)):
        with MomentCollector({"l": lin}) as col:
            col.weight = w
            lin(x)
        runs[name] = col.moments()["l"]
        assert col.counts["l"] == 10
    torch.testing.assert_close(runs["weighted"], want)
    assert torch.equal(runs["ones"], runs["plain"])  # exactly the old statistics
    torch.testing.assert_close(runs["plain"], flat.T @ flat / 10)


def test_cgq_with_unit_or_constant_weights_is_gptq():
    plain = _quantized(_batches())
    ones = _quantized(_batches(lambda ids: torch.ones(ids.shape, dtype=torch.float64)))
    scaled = _quantized(_batches(lambda ids: torch.full(ids.shape, 3.7, dtype=torch.float64)))
    for p, o, s in zip(plain, ones, scaled):
        assert torch.equal(p, o)  # all c_j = 1: GPTQ's codes exactly
        torch.testing.assert_close(p, s, rtol=0, atol=1e-6)  # H scale invariance
    varied = _quantized(_batches(lambda ids: (ids % 2).double() * 0.3 + 0.7))
    assert any(not torch.equal(p, v) for p, v in zip(plain, varied))  # the weights do reach the statistics


def _two_populations(n=32, seed=0):
    """Σ of masked and of unmasked tokens with different dominant input directions."""
    g = torch.Generator().manual_seed(seed)
    def sig(scale):
        q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        return (q * scale) @ q.T
    return sig(torch.logspace(-2, 1, n, dtype=torch.float64)), sig(torch.logspace(1, -2, n, dtype=torch.float64))


def test_gptq_beats_rtn_and_cgq_trades_unmasked_for_masked_error():
    s_mask, s_unmask = _two_populations()
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    plain = LayerStats((s_mask + s_unmask) / 2)                    # half the tokens masked, c_j = 1
    weighted = LayerStats((1.0 * s_mask + 0.7 * s_unmask) / 1.7)   # CGQ: c = 1 masked, 0.7 unmasked
    gq = GPTQ(percdamp=0.01).quantize(w, plain, 3).weight
    cq = GPTQ(percdamp=0.01).quantize(w, weighted, 3).weight
    rq = RTN().quantize(w, plain, 3).weight
    assert plain.output_error(w, gq) < plain.output_error(w, rq)
    on_mask, on_unmask = LayerStats(s_mask), LayerStats(s_unmask)
    assert on_mask.output_error(w, cq) < on_mask.output_error(w, gq)
    assert on_unmask.output_error(w, cq) > on_unmask.output_error(w, gq)


def test_cgq_token_weights():
    ids = torch.tensor([[5, 2, 2, 7]])
    torch.testing.assert_close(cgq.token_weights(ids, 2), torch.tensor([[0.7, 1.0, 1.0, 0.7]], dtype=torch.float64))
    logits = torch.zeros(1, 4, 3)
    logits[0, 1, 0] = 10.0
    c = cgq.token_weights(ids, 2, score_fn="confidence", logits=logits)
    top = torch.softmax(logits.double(), -1).amax(-1)
    torch.testing.assert_close(c, torch.tensor([[0.7, 1.0, 1.0, 0.7]], dtype=torch.float64) * top)


@pytest.mark.parametrize("n", [0, 1, 3, 7, 10, 33, 101])
def test_tmas_counts_follow_the_proportions(n):
    counts = tmas.largest_remainder(n, tmas.PROPORTIONS)
    assert sum(counts) == n
    assert all(abs(c - n * p) < 1 for c, p in zip(counts, tmas.PROPORTIONS))


def _tiny_dlm():
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_modules.common.diffusion import MaskedDiffusionLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64)
    return MaskedDiffusionLM(LlamaForCausalLM(cfg).eval(), mask_token_id=2)


def test_tmas_draws_real_trajectory_states_by_stage():
    dlm = _tiny_dlm()
    states = tmas.record_trajectory(dlm, [[5, 6, 7], [8, 9]], gen_length=8, steps=8)
    for prompt_len in (3, 2):
        run = [s for s in states if s["prompt_len"] == prompt_len]
        ratios = [s["mask_ratio"] for s in run]
        assert ratios[0] == 1.0 and ratios[-1] == 0.0
        assert all(a >= b for a, b in zip(ratios, ratios[1:]))  # non-increasing along the steps
        final = run[-1]["ids"]
        for s in run:  # every decoded token stays as the final sequence has it
            keep = s["ids"] != 2
            assert torch.equal(s["ids"][keep], final[keep])
    for n in (5, 10, 13):
        drawn = tmas.draw(states, n, stage_by="mask_ratio", seed=1)
        assert [sum(d["stage"] == k for d in drawn) for k in range(4)] == tmas.largest_remainder(n, tmas.PROPORTIONS)
        for d in drawn:
            assert any(torch.equal(d["ids"], s["ids"]) for s in states)
            assert min(3, int((1 - d["mask_ratio"]) * 4)) == d["stage"]
    by_step = tmas.draw(states, 10, stage_by="step", steps=8, seed=2)  # stages = 4 runs of steps (start = step -1)
    assert [sum(d["stage"] == k for d in by_step) for k in range(4)] == tmas.largest_remainder(10, tmas.PROPORTIONS)
    assert all(d["stage"] == (d["step"] + 1) * 4 // 9 for d in by_step)
    with pytest.raises(ValueError, match="four non-negative stage shares"):
        tmas.draw(states, 4, [0.5, 0.5])


def test_iaaq_uniform_importance_is_the_plain_mse_search():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(2, 2, 10, 8, generator=g)
    grid = iaaq.clip_grid(40, 0.05)
    plain = torch.tensor([float(((v.double() - fake_quant_reference(v, 4, -1, True, r)[0].double()) ** 2).sum())
                          for r in grid.tolist()], dtype=torch.float64)
    got = iaaq.clip_errors(v, grid, 4, "v", weight=torch.ones(2, 10))
    torch.testing.assert_close(got, plain)
    assert int(got.argmin()) == int(plain.argmin())


def test_iaaq_weighted_search_protects_heavily_attended_outliers():
    g = torch.Generator().manual_seed(0)
    n, d, out = 64, 16, [0, 1, 2]
    v = torch.randn(1, 1, n, d, generator=g)
    v[0, 0, out] = 0.05 * torch.randn(len(out), d, generator=g)
    v[0, 0, out, 0] = 6.0  # spiky rows: clipping their absmax costs them dearly
    w = torch.ones(1, n)
    w[0, out] = 200.0      # the tokens every query attends to
    grid = iaaq.clip_grid()
    a_plain = float(grid[int(iaaq.clip_errors(v, grid, 4, "v").argmin())])
    a_weighted = float(grid[int(iaaq.clip_errors(v, grid, 4, "v", weight=w).argmin())])
    err = lambda a: float(((v - iaaq.quantize_values(v, 4, a))[0, 0, out] ** 2).sum())  # noqa: E731
    assert a_weighted > a_plain
    assert err(a_weighted) < err(a_plain)


def test_iaaq_output_objective_and_the_recorder():
    dlm = _tiny_dlm()
    ids = torch.tensor([[5, 2, 7, 2, 9, 11]])
    rec = iaaq.ValueRecorder(iaaq.clip_grid(5), 4, "output")
    iaaq.install(dlm.model, rec)
    with_rec = dlm.logits(ids)
    iaaq.install(dlm.model, None)
    torch.testing.assert_close(with_rec, dlm.logits(ids))  # the recorder leaves V alone
    assert set(rec.ratios()) == {0} and rec.errors[0].shape == (5,)
    iaaq.install(dlm.model, iaaq.ValueQuantizer({0: 1.0}, 16))
    torch.testing.assert_close(dlm.logits(ids), with_rec)  # 16-bit V is the identity
    iaaq.install(dlm.model, None)
    with pytest.raises(ValueError, match="objective"):
        iaaq.check_objective("attn")


@pytest.mark.parametrize("grid", ["absmax_row", "minmax_group"])
def test_awq_layer_search_at_zero_is_rtn_and_never_worse(grid):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=g, dtype=torch.float64)
    s_mask, _ = _two_populations()
    stats = LayerStats(s_mask)
    rtn = RTN(grid=grid, group_size=16).quantize(w, stats, 4)
    a0 = AWQ(search="layer", n_grid=1, grid=grid, group_size=16).quantize(w, stats, 4)
    if grid == "absmax_row":  # the minmax grids differ in the range rule (GPTQ's holds 0, AWQ's does not)
        assert torch.equal(a0.weight, rtn.weight) and torch.equal(a0.codes, rtn.codes)
    assert a0.info["awq_a"] == 0.0
    full = AWQ(search="layer", grid=grid, group_size=16).quantize(w, stats, 4)
    assert stats.output_error(w, full.weight) <= stats.output_error(w, a0.weight)


# --- the standard grids (issue 40) ------------------------------------------------------------------------------
def _affine_by_hand(x, bits, include_zero):
    """One group (rows × g) on the releases' asymmetric grid, written from their formulas."""
    maxq = 2 ** bits - 1
    lo, hi = x.min(1, keepdim=True).values, x.max(1, keepdim=True).values
    if include_zero:  # IST-DASLab gptq Quantizer.find_params (sym=False)
        lo, hi = torch.minimum(lo, torch.zeros_like(lo)), torch.maximum(hi, torch.zeros_like(hi))
        z0 = (lo == 0) & (hi == 0)
        lo[z0], hi[z0] = -1.0, 1.0
        scale = (hi - lo) / maxq
        zero = torch.round(-lo / scale)
    else:  # llm-awq pseudo_quantize_tensor (zero_point=True)
        scale = (hi - lo).clamp(min=1e-5) / maxq
        zero = (-torch.round(lo / scale)).clamp(0, maxq)
    return (torch.clamp(torch.round(x / scale) + zero, 0, maxq) - zero) * scale


def test_minmax_group_rtn_is_the_release_grid():
    from lightning_modules.dllmquant.awq import pseudo_quantize

    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    w[0, :16] = 0.0  # an all-zero group
    w[1] = w[1].abs() + 0.1  # all positive: GPTQ's range still holds 0, AWQ's does not
    res = RTN(grid="minmax_group", group_size=16).quantize(w, None, 3)
    want = torch.cat([_affine_by_hand(w[:, i:i + 16], 3, True) for i in (0, 16, 32)], 1)
    torch.testing.assert_close(res.weight, want, rtol=0, atol=1e-12)
    assert res.codes.min() >= 0 and res.codes.max() <= 7 and res.info["grid"].scale.shape == (6, 3)
    assert res.rate.bits_cardinality == pytest.approx(3 + 3 * (16 + 3) / 40)  # fp16 step + 3-bit zero per group
    awq_want = torch.cat([_affine_by_hand(w[:, i:i + 16], 3, False) for i in (0, 16, 32)], 1)
    torch.testing.assert_close(pseudo_quantize(w, 8, 16), awq_want, rtol=0, atol=1e-12)
    assert not torch.allclose(awq_want[1], want[1])


def _gptq_groups_by_hand(w, sigma, bits, group, percdamp=0.01):
    """Column-by-column GPTQ (no lazy batches) with a group's grid found from the updated weights at its first column."""
    w, h = w.clone(), sigma.clone()
    n = w.shape[1]
    h += percdamp * torch.diagonal(h).mean() * torch.eye(n, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    out = torch.zeros_like(w)
    for j in range(n):
        if j % group == 0:
            grid = lambda col, g=w[:, j:j + group].clone(): _affine_on(g, col, bits)  # noqa: E731
        q = grid(w[:, j:j + 1])[:, 0]
        out[:, j] = q
        w[:, j:] -= ((w[:, j] - q) / u[j, j])[:, None] * u[j, j:][None]
    return out


def _affine_on(group, col, bits):
    maxq = 2 ** bits - 1
    lo = torch.minimum(group.min(1, keepdim=True).values, torch.zeros(len(group), 1, dtype=group.dtype))
    hi = torch.maximum(group.max(1, keepdim=True).values, torch.zeros(len(group), 1, dtype=group.dtype))
    scale = (hi - lo) / maxq
    zero = torch.round(-lo / scale)
    return (torch.clamp(torch.round(col / scale) + zero, 0, maxq) - zero) * scale


def test_gptq_minmax_group_matches_column_by_column_gptq():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(12, 64, generator=g, dtype=torch.float64)
    x = torch.randn(500, 64, generator=g, dtype=torch.float64) @ torch.randn(64, 64, generator=g, dtype=torch.float64)
    sigma = x.T @ x / 500
    res = GPTQ(percdamp=0.01, blocksize=16, grid="minmax_group", group_size=16).quantize(w, LayerStats(sigma), 4)
    torch.testing.assert_close(res.weight, _gptq_groups_by_hand(w, sigma, 4, 16), rtol=0, atol=1e-9)
    assert res.info["grid"].zero.shape == (12, 4)
    rtn = RTN(grid="minmax_group", group_size=16).quantize(w, None, 4)
    stats = LayerStats(sigma)
    assert stats.output_error(w, res.weight) < stats.output_error(w, rtn.weight)


def test_dllmquant_baselines_default_to_the_release_grids():
    from benchmarks.tables import composed

    for experiment in ("gptq_llada_8b", "dllmquant_llada_8b", "awq_llada_8b"):
        q = composed(experiment).model.quantizer
        assert q.grid == "minmax_group" and q.group_size == 128, experiment
    assert composed("awq_llada_8b").model.quantizer.search == "block"


# --- AWQ as released: scale search on the block's outputs (issue 40) --------------------------------------------
def _tiny_llama(seed=0, kv_heads=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, attn_implementation="eager")
    return LlamaForCausalLM(cfg).double().eval()


def _llama_batches(seed=2):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 50, (2, 9), generator=g)} for _ in range(2)]


def test_awq_block_scaling_keeps_the_function_and_picks_the_release_ratio():
    model = _tiny_llama()
    batches = _llama_batches()
    ids = batches[0]["input_ids"]
    before = model(input_ids=ids).logits
    blk = model.model.layers[1]
    seen = {}
    hook = blk.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("x", []).append(a[0].clone()))
    for b in batches:
        model(input_ids=b["input_ids"])
    hook.remove()
    w_down = blk.mlp.down_proj.weight.detach().clone()
    awq = AWQ(clip=False, group_size=16)
    report = awq.prepare(model, batches, 3, log=None)
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=1e-9)  # the fold is exact
    assert set(report) == {f"{i}.{g}" for i in (0, 1) for g in ("qkv", "o", "gate_up", "down")}
    # down_proj by hand: s = mean|x|^a normalised, output error of Q(W·s)/s on the captured inputs
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in seen["x"]])
    m = x.abs().mean(0)
    errs = []
    for i in range(20):
        s = m.pow(i / 20).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        q = _affine_groups(w_down * s, 3, 16) / s
        errs.append(float(((x @ (w_down - q).T) ** 2).mean()))
    assert report["1.down"] == errs.index(min(errs)) / 20
    with pytest.raises(ValueError, match="AWQ.prepare"):
        AWQ().quantize(w_down, LayerStats(torch.eye(64, dtype=torch.float64)), 3)


def _affine_groups(w, bits, group):
    return torch.cat([_affine_by_hand(w[:, i:i + group], bits, False) for i in range(0, w.shape[1], group)], 1)


def test_awq_block_skips_v_to_o_under_grouped_query_attention_and_clips_all_but_q_k():
    model = _tiny_llama(kv_heads=2)
    q0 = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    report = AWQ(group_size=16).prepare(model, _llama_batches(), 3, log=None)
    assert "0.o" not in report and {"0.v.clip", "0.o.clip", "0.down.clip"} <= set(report)
    assert "0.q.clip" not in report and "0.k.clip" not in report
    assert all(0 <= report[k] <= 0.5 for k in report if k.endswith(".clip"))
    s = q0 / model.model.layers[0].self_attn.q_proj.weight.detach()  # q only scaled: one s per input column
    torch.testing.assert_close(s, s[:1].expand_as(s))


def test_awq_clip_minimises_the_group_output_error():
    lin = nn.Linear(32, 5, bias=False).double()
    g = torch.Generator().manual_seed(7)
    lin.weight.data = torch.randn(5, 32, generator=g, dtype=torch.float64) ** 3  # heavy tails: clipping pays
    x = torch.randn(3, 40, 32, generator=g, dtype=torch.float64)
    c = torch.rand(3, 40, generator=g, dtype=torch.float64)
    w = lin.weight.detach().clone()
    AWQ(group_size=16)._clip(lin, [x], [c], 8)
    xf, cf = x.reshape(-1, 32), c.reshape(-1)
    for i in (0, 16):
        wg, sig = w[:, i:i + 16], (xf[:, i:i + 16] * cf[:, None]).T @ xf[:, i:i + 16] / cf.sum()
        org = wg.abs().amax(1, keepdim=True)
        cand = [org * (1 - k / 20) for k in range(10)]
        errs = torch.stack([(((_affine_by_hand(wg.clamp(-mx, mx), 3, False) - wg) @ sig) * (
            _affine_by_hand(wg.clamp(-mx, mx), 3, False) - wg)).sum(1) for mx in cand], 1)
        best = torch.stack(cand, 1)[torch.arange(5), errs.argmin(1), 0]
        torch.testing.assert_close(lin.weight[:, i:i + 16], wg.clamp(-best[:, None], best[:, None]))


def test_input_scale_keeps_the_product_and_16_16_is_the_identity():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    model = nn.Sequential(lin)
    assert fake_quant.quantize_model(model, {"w_bits": 16, "a_bits": 16}) == {}  # 16/16: nothing swapped
    layers = fake_quant.quantize_model(model, {"w_bits": 16, "a_bits": 4, "group_size": -1, "impl": "torch"})
    s = torch.rand(8) + 0.5
    fake_quant.set_input_scales(layers, {"0": s})
    layers["0"].a_bits = 16
    torch.testing.assert_close(model(x), x @ lin.weight.T + lin.bias)  # (W·diag s)(x/s) = Wx
    layers["0"].a_bits = 4
    want = fake_quant_reference(x / s, 4, -1)[0] @ (lin.weight * s).T + lin.bias
    torch.testing.assert_close(model(x), want)  # the activation grid sees x/s


def _module(**kw):
    from lightning_modules.dllmquant.module import DLLMQuantModule

    return DLLMQuantModule(backbone={"family": "llama", "diffusion": {"mask_token_id": 2}}, **kw)


@pytest.mark.parametrize("kw, match", [
    ({"backbone": {"family": "llama"}}, "masked-diffusion backbone: backbone.pretrained=tiny-mdlm"),
    ({"tmas": {"proportions": [0.5, 0.5, 0.1, 0.1]}}, "four non-negative stage shares summing to 1"),
    ({"calib": "pile"}, "model.calib"),
    ({"cgq": {"score_fn": "entropy"}}, "model.cgq.score_fn"),
    ({"iaaq": {"objective": "attn"}}, "model.iaaq.objective"),
])
def test_bad_input_is_one_line(kw, match):
    from lightning_modules.dllmquant.module import DLLMQuantModule

    if "backbone" in kw:
        with pytest.raises(ValueError, match=match):
            DLLMQuantModule(**kw)
    else:
        with pytest.raises(ValueError, match=match):
            _module(**kw)


def test_dllmquant_tiny_awq_smoke(tmp_path):
    """AWQ as released inside the W4A4 pipeline on tiny-mdlm (GQA: v -> o is skipped), then the test loop."""
    _, metrics = run_experiment("dllmquant_tiny", tmp_path, ["debug=smoke", "model/quantizer=awq", "model.calib=text",
                                                            "model.cgq.enabled=false", "model.iaaq.enabled=false",
                                                            "model.n_calib=4", "model.n_test=1", "model.n_traj=1",
                                                            "model.sampler.steps=4", "model.quantizer.n_grid=4"])
    assert metrics["status"] == "ok"
    awq = metrics["results"]["quantization"]["awq"]
    assert set(awq) >= {"0.qkv", "0.gate_up", "0.down", "3.down.clip"} and "0.o" not in awq


def test_dllmquant_tiny_smoke(tmp_path):
    # debug=smoke does not shrink these: calibration states, trajectory prompts, test problems, denoising steps,
    # and the clip and AWQ grids
    value, metrics = run_experiment("dllmquant_tiny", tmp_path, ["debug=smoke", "model.n_calib=8", "model.n_prompts=2",
                                                                "model.n_test=2", "model.n_traj=1",
                                                                "model.sampler.steps=8",
                                                                "model.iaaq.grid=8"])
    assert metrics["status"] == "ok"
    final, q = metrics["final"], metrics["results"]["quantization"]
    assert value == final["test/kl_bits/r0.9"] >= 0
    assert 0 <= final["test/accuracy"] <= 100 and 0 <= final["test/accuracy_fp"] <= 100
    for r in ("0.5", "0.1"):
        assert final[f"test/kl_bits/r{r}"] >= 0
    assert (q["calib"], q["cgq"], q["iaaq"], q["a_bits"], q["v_bits"]) == ("tmas", True, True, 4, 4)
    assert set(q["clip_ratios"]) == {"0", "1", "2", "3"}  # one α per layer (json keys)
    assert q["packed_bytes"] == pytest.approx(q["bits"] * q["n_weights"] / 8)
    assert q["bits"] == pytest.approx(4 + (16 + 4) / 128)  # 16 codes + an fp16 step and a 4-bit zero per 128 inputs


def test_final_answer_reads_the_gsm8k_mark():
    from lightning_modules.dllmquant.module import final_answer

    assert final_answer("12 + 34 = 46 \n # # # # 46") == "46"
    assert final_answer("so 1,200 in all\n#### 1,200") == "1200"
    assert final_answer("no mark 7") is None


def test_cgq_weights_export_packed_and_reload_as_the_diffusion_lm(tmp_path):
    """W4A16 CGQ (GPTQ on token-weighted Σ, 16 levels) packs to 4 bits through the module's export (the backbone
    inside the diffusion wrapper); the reloaded backbone, wrapped again as the masked diffusion LM, gives the
    fake-quantized model's logits."""
    from callbacks.kernels.w4a16 import PackedLinear
    from lightning_modules.common.diffusion import MaskedDiffusionLM
    from lightning_modules.common.quantize.export import load_packed
    from lightning_modules.dllmquant.module import DLLMQuantModule

    torch.manual_seed(0)
    spec = {"family": "llama", "dtype": "float32", "diffusion": {"mask_token_id": 3},
            "config": {"vocab_size": 40, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}}
    module = DLLMQuantModule(spec, quantizer=GPTQ(percdamp=0.01), a_bits=16, export_packed=str(tmp_path / "packed"))
    module.configure_model()
    dlm = module.model.eval()
    batches = _batches(lambda ids: cgq.token_weights(ids, 3))
    for b in batches:
        b["input_ids"][:, ::3] = 3  # some masked positions, so c_j takes both values
    report = quantize_model(module.quantized_backbone(), module.quantizer, batches, 4, with_limit=False, log=None)
    ids = batches[0]["input_ids"]
    with torch.no_grad():
        want = dlm.logits(ids)
        sizes = module.export(report)
        again = MaskedDiffusionLM(load_packed(tmp_path / "packed"), mask_token_id=3)
        got = again.logits(ids)
    assert sizes["layers"] == 14 and isinstance(dlm.model.model.layers[1].mlp.down_proj, PackedLinear)
    assert sizes["bytes_memory"] < sizes["bytes_memory_fp"] and sizes["bytes_disk"] > sizes["bytes_memory"]
    assert isinstance(again.model.model.layers[1].mlp.down_proj, PackedLinear)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()


# --- calibration: no padding, generic text, GSM8K's splits (issue 40) --------------------------------------------
class _CharTok:
    """A character tokenizer (ids 3..22) with EOS 1: enough for the module's problem and window plumbing."""
    eos_token_id = 1

    def __call__(self, s, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 20 for c in s]}


def _task_module(monkeypatch, **kw):
    m = _module(**kw)
    monkeypatch.setattr(m, "_tokenizer", lambda: _CharTok())
    return m


def test_calibration_rows_see_no_pads(monkeypatch):
    """A row's statistics are those of the row alone (old: EOS-padded to the batch's longest, real tokens attended
    to the pads under the mask-free bidirectional attention)."""
    dlm = _tiny_dlm().double()
    m = _task_module(monkeypatch, calib="text", n_calib=5, calib_batch_size=4, sampler={"gen_length": 4, "steps": 4})
    probs = [{"prompt": [3 + i] * (2 + 3 * i), "solution": [5, 6]} for i in range(5)]  # five prompt lengths
    monkeypatch.setattr(m, "problems", lambda split, n: probs[:n])
    m.model = dlm
    batches = m.calibration_batches()
    q = dlm.model.model.layers[0].mlp.down_proj  # after the attention (layer 0's q/k/v read embeddings alone)

    def sigma(bs):
        with MomentCollector({"q": q}) as col:
            for b in bs:
                col.weight = b["token_weight"]
                dlm.model(input_ids=b["input_ids"])
        return col.sums["q"] / col.totals["q"]

    alone = [{"input_ids": torch.tensor([m._answer_region(p).tolist()]),
              "token_weight": torch.ones(1, len(m._answer_region(p)), dtype=torch.float64)} for p in probs]
    torch.testing.assert_close(sigma(batches), sigma(alone), rtol=1e-9, atol=1e-12)
    assert all(bool((b["token_weight"] > 0).all()) for b in batches)


def _gsm8k(path, n, tag):
    import json

    path.write_text("".join(json.dumps({"question": f"{tag} {i}?", "answer": f"{i} #### {i}"}) + "\n"
                            for i in range(n)))
    return str(path)


def test_text_calibration_reads_generic_text_and_test_reads_every_record(monkeypatch, tmp_path):
    test_file = _gsm8k(tmp_path / "test.jsonl", 10, "t")
    text = tmp_path / "wiki.txt"
    text.write_text("\n".join(f"line {i} of generic text" for i in range(50)) + "\n")
    m = _task_module(monkeypatch, calib="text", n_calib=3, calib_seq_len=16, task_files=test_file, n_test=None,
                     calib_text_files=str(text))
    joined = _CharTok()("\n\n".join(f"line {i} of generic text" for i in range(50)))["input_ids"]
    wins = m.text_windows(3)
    assert len(wins) == 3 and all(len(w) == 16 for w in wins)
    hay = ",".join(map(str, joined))
    assert all(",".join(map(str, w.tolist())) in hay for w in wins)  # contiguous windows of the text
    assert len(m.problems("test", None)) == 10  # calibration does not take half of the evaluation set
    m2 = _task_module(monkeypatch, calib="tmas", task_files=test_file, n_test=None,
                      calib_files=_gsm8k(tmp_path / "train.jsonl", 6, "c"))
    assert len(m2.problems("test", None)) == 10 and len(m2.problems("calib", 4)) == 4
    enc = lambda s: _CharTok()(s)["input_ids"]  # noqa: E731
    assert {tuple(p["prompt"]) for p in m2.problems("calib", None)} == {tuple(enc(f"c {i}?\n")) for i in range(6)}
    with pytest.raises(ValueError, match="model.n_test=null"):
        _module(n_test=None)


def test_paper_scale_calibration_is_not_the_evaluation_set():
    from benchmarks.tables import composed

    for experiment in ("gptq_llada_8b", "awq_llada_8b", "dllmquant_llada_8b"):
        mc = composed(experiment).model
        assert mc.n_test is None and mc.task_files.endswith("gsm8k/test.jsonl"), experiment
        assert mc.calib_files.endswith("gsm8k/train.jsonl") and mc.calib_text_files.endswith("wiki.train.txt")
