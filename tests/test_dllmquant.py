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


def test_awq_at_zero_is_rtn_and_never_worse():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=g, dtype=torch.float64)
    s_mask, _ = _two_populations()
    stats = LayerStats(s_mask)
    rtn = RTN().quantize(w, stats, 4)
    a0 = AWQ(grid=1).quantize(w, stats, 4)
    assert a0.info["awq_a"] == 0.0 and torch.equal(a0.weight, rtn.weight) and torch.equal(a0.codes, rtn.codes)
    full = AWQ().quantize(w, stats, 4)
    assert stats.output_error(w, full.weight) <= stats.output_error(w, rtn.weight)


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
    assert 4 < q["bits"] < 4 + 16 / 128 + 1e-9  # 16 levels + a 16-bit row scale over 128 or 384 inputs


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
