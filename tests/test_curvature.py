"""Curvature vs entropy (issue 14): the measures against formulas and planted truths, the perturbations' geometry,
the regulariser against transformers' own hidden states, bad input, and both tiny experiments end to end."""
import math

import pytest
import torch

from helpers import run_experiment
from lightning_modules.common.backbone import check_revision
from lightning_modules.curvature import CurvatureLM
from lightning_modules.curvature.analysis import (contextual_curvature, pairwise_angles, partial_corr, pearson,
                                                  second_diff, soft_angles, spearman, token_entropy)
from lightning_modules.curvature.perturb import angle_at, directions, top_pcs

TINY = {"family": "llama", "dtype": "float32", "attn_implementation": "eager",
        "config": dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2)}


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --- the measure ------------------------------------------------------------------------------------------------
def test_collinear_points_have_zero_curvature_and_a_right_angle_zigzag_pi_over_2():
    line = torch.linspace(0, 1, 7)[:, None] * torch.tensor([1.0, 2.0, -0.5])
    assert pairwise_angles(line).abs().max() < 1e-3          # arccos near 1 loses ~sqrt(eps) in float32
    zigzag = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [2.0, 1.0], [2.0, 2.0], [3.0, 2.0]])
    torch.testing.assert_close(pairwise_angles(zigzag), torch.full((4,), math.pi / 2))
    torch.testing.assert_close(contextual_curvature(zigzag, 4)[3:], torch.full((3,), math.pi / 2))


def test_curvature_is_invariant_to_translation_scaling_and_rotation():
    h = torch.randn(12, 8, generator=_gen(), dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(8, 8, generator=_gen(1), dtype=torch.float64))
    k = contextual_curvature(h, 4)
    for moved in (h + torch.randn(8, generator=_gen(2), dtype=torch.float64), 3.7 * h, h @ q.T):
        torch.testing.assert_close(contextual_curvature(moved, 4), k, equal_nan=True)


def test_window_three_is_the_single_angle_and_the_whole_window_the_mean_angle():
    h = torch.randn(2, 9, 5, generator=_gen(3), dtype=torch.float64)
    theta = pairwise_angles(h)
    k3 = contextual_curvature(h, 3)
    assert torch.isnan(k3[:, :2]).all()
    torch.testing.assert_close(k3[:, 2:], theta)
    # theta at t is the angle of (h_{t-2}, h_{t-1}, h_t) between v_{t-2} and v_{t-1}
    torch.testing.assert_close(k3[:, 5], angle_at(h[:, 3], h[:, 4], h[:, 5]))
    whole = contextual_curvature(h, 9)
    torch.testing.assert_close(whole[:, -1], theta.mean(-1))
    assert torch.isnan(whole[:, :-1]).all()


def test_entropy_is_log_v_for_uniform_logits_and_zero_for_one_hot():
    torch.testing.assert_close(token_entropy(torch.zeros(3, 50)), torch.full((3,), math.log(50)))
    one_hot = torch.full((2, 50), -1e4)
    one_hot[:, 7] = 0
    torch.testing.assert_close(token_entropy(one_hot), torch.zeros(2), atol=1e-6, rtol=0)
    assert token_entropy(torch.zeros(4, dtype=torch.bfloat16)).dtype == torch.float32


def test_correlations_match_references_and_partial_r_removes_a_planted_confound():
    g = _gen(4)
    x, y = torch.randn(500, generator=g, dtype=torch.float64), torch.randn(500, generator=g, dtype=torch.float64)
    assert pearson(x, x + y) == pytest.approx(torch.corrcoef(torch.stack([x, x + y]))[0, 1].item(), abs=1e-12)
    ties = torch.tensor([1.0, 2.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    # Spearman = Pearson of average ranks: ties (2,2) -> 2.5, (5,5,5) -> 6
    assert spearman(ties, ties.exp()) == pytest.approx(1.0)
    assert spearman(torch.arange(6.0), -torch.arange(6.0) ** 3) == pytest.approx(-1.0)
    # planted confound: both curvature and entropy are driven by position, independent given it
    pos = torch.arange(4000, dtype=torch.float64) % 200
    kappa = 0.01 * pos + 0.3 * torch.randn(4000, generator=g, dtype=torch.float64)
    H = 0.02 * pos + 0.5 * torch.randn(4000, generator=g, dtype=torch.float64)
    assert pearson(kappa, H) > 0.5
    assert abs(partial_corr(kappa, H, pos[:, None])) < 0.05
    # against the precision-matrix formula for partial correlation
    z = torch.stack([kappa, H, pos, torch.randn(4000, generator=g, dtype=torch.float64)], 1)
    P = torch.linalg.inv(torch.cov(z.T))
    ref = -P[0, 1] / (P[0, 0] * P[1, 1]).sqrt()
    assert partial_corr(kappa, H, z[:, 2:]) == pytest.approx(ref.item(), abs=1e-9)


# --- the regulariser --------------------------------------------------------------------------------------------
def test_soft_angle_has_finite_gradients_at_collinearity_and_passes_gradcheck():
    line = (torch.linspace(0, 1, 6)[:, None] * torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
    line = (line + 1e-9 * torch.randn(6, 3, generator=_gen(5), dtype=torch.float64)).requires_grad_(True)
    soft_angles(line).sum().backward()
    assert torch.isfinite(line.grad).all()
    h = torch.randn(7, 4, generator=_gen(6), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: soft_angles(x), (h,))
    torch.testing.assert_close(soft_angles(h), pairwise_angles(h), atol=1e-6, rtol=0)
    torch.testing.assert_close(second_diff(h), (h[2:] - 2 * h[1:-1] + h[:-2]).norm(dim=-1))


def _one_minus_cos(h):
    v = h[1:] - h[:-1] if h.dim() == 2 else h[:, 1:] - h[:, :-1]
    a, b = v[..., :-1, :], v[..., 1:, :]
    return 1 - (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


@pytest.mark.parametrize("form", ["angle", "one_minus_cos", "second_diff"])
def test_regularised_loss_is_ce_plus_lambda_times_the_rescaled_penalty(form):
    torch.manual_seed(0)
    module = CurvatureLM(TINY, window=4, reg={"lambda": 0.3, "layers": [0, 2, 3], "form": form})
    module.configure_model()
    ids = torch.randint(0, 61, (2, 12), generator=_gen(7))
    batch = {"input_ids": ids, "labels": ids}
    out = module.model(input_ids=ids, labels=ids, output_hidden_states=True)
    hs = out.hidden_states                                   # transformers' own (k < L: before the final norm)
    by_form = {"angle": soft_angles, "one_minus_cos": _one_minus_cos, "second_diff": second_diff}
    per = [by_form[form](hs[k]) for k in (0, 2, 3)]
    penalty = torch.stack([contextual_curvature_from(v, 4) for v in per]).mean()
    scale = 10.0 ** (math.floor(math.log10(out.loss.item())) - math.floor(math.log10(penalty.item())))
    loss = module.compute_loss(batch)
    assert loss.item() == pytest.approx(out.loss.item() + 0.3 * scale * penalty.item(), rel=1e-5)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in module.model.parameters() if p.grad is not None)


def test_match_order_off_and_delay_steps():
    ids = torch.randint(0, 61, (2, 12), generator=_gen(12))
    batch = {"input_ids": ids, "labels": ids}
    torch.manual_seed(0)
    delayed = CurvatureLM(TINY, reg={"lambda": 0.3, "delay_steps": 5})
    delayed.configure_model()
    ce = delayed.model(input_ids=ids, labels=ids).loss
    assert delayed.compute_loss(batch).item() == pytest.approx(ce.item(), rel=1e-6)  # step 0 < 5: CE only
    raw = CurvatureLM(TINY, reg={"lambda": 0.3, "match_order": False})
    raw.model = delayed.model
    hs = raw.model(input_ids=ids, output_hidden_states=True).hidden_states
    penalty = torch.stack([contextual_curvature_from(soft_angles(hs[k]), 3) for k in raw.reg["layers"]]).mean()
    assert raw.compute_loss(batch).item() == pytest.approx(ce.item() + 0.3 * penalty.item(), rel=1e-5)


def contextual_curvature_from(values, window):
    """Mean over t >= w-1 of the window means of per-triple values, written out as loops (the reference)."""
    k, T = window - 2, values.shape[-1] + 2
    return torch.stack([values[..., t - 2 - k + 1: t - 1].mean(-1) for t in range(window - 1, T)], -1).mean()


@pytest.mark.parametrize("last_state", ["post_norm", "pre_norm"])
def test_last_state_reads_the_final_norm_as_asked(last_state):
    """Issue 40: index L is read after the final norm (transformers' hidden_states[-1], the precursor's) by default,
    before it with last_state=pre_norm; the analysis and the regulariser alike."""
    torch.manual_seed(0)
    kw = {} if last_state == "post_norm" else {"last_state": last_state}
    module = CurvatureLM(TINY, reg={"lambda": 0.3, "layers": [4], "match_order": False}, **kw)
    module.configure_model()
    ids = torch.randint(0, 61, (2, 12), generator=_gen(13))
    seen = {}
    last = module.model.model.layers[-1]
    hook = last.register_forward_hook(lambda m, a, o: seen.update(pre=o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        out = module.model(input_ids=ids, labels=ids, output_hidden_states=True)
    hook.remove()
    h = out.hidden_states[-1] if last_state == "post_norm" else seen["pre"]
    assert not torch.allclose(out.hidden_states[-1], seen["pre"])  # the norm does change the state
    rec = module.analyse_batch(ids)[0]
    want = contextual_curvature(h.float(), 3)[:, 2:].reshape(-1)
    torch.testing.assert_close(rec["kappa"][:, -1], want)
    penalty = contextual_curvature_from(soft_angles(h.float()), 3)
    assert module.compute_loss({"input_ids": ids, "labels": ids}).item() == pytest.approx(
        out.loss.item() + 0.3 * penalty.item(), rel=1e-5)


def test_default_layers_are_the_middle_half_and_the_middle_perturbation_layer():
    m = CurvatureLM({**TINY, "config": {**TINY["config"], "num_hidden_layers": 8}})
    assert m.reg["layers"] == [3, 4, 5, 6] and m.perturb["layer"] == 4 and m.layers == list(range(9))


# --- perturbations ----------------------------------------------------------------------------------------------
def _triples(B=16, D=24, seed=8):
    g = _gen(seed)
    return tuple(torch.randn(B, D, generator=g, dtype=torch.float64) for _ in range(3))


def test_extrapolation_to_the_linear_prediction_makes_the_angle_zero():
    h2, h1, h0 = _triples()
    target = (2 * h1 - h2) - h0
    scale = target.norm(dim=-1, keepdim=True) / (h0 - h1).norm(dim=-1, keepdim=True)
    d = directions(h2, h1, h0, "extrapolation", 1.0)["extrapolation"]
    torch.testing.assert_close(d / d.norm(dim=-1, keepdim=True), target / target.norm(dim=-1, keepdim=True))
    assert angle_at(h2, h1, h0 + d * scale).abs().max() < 1e-6
    assert (angle_at(h2, h1, h0 + 0.5 * d) < angle_at(h2, h1, h0)).all()


def test_orthogonal_and_random_have_the_asked_norm_and_orthogonal_is_perpendicular_to_the_span():
    h2, h1, h0 = _triples()
    want = 0.5 * (h0 - h1).norm(dim=-1)
    d = directions(h2, h1, h0, "orthogonal", 0.5, generator=_gen(9))["orthogonal"]
    torch.testing.assert_close(d.norm(dim=-1), want)
    for v in (h1 - h2, (2 * h1 - h2) - h0):
        assert ((d * v).sum(-1) / (d.norm(dim=-1) * v.norm(dim=-1))).abs().max() < 1e-6
    r = directions(h2, h1, h0, "random", 0.5, generator=_gen(9))["random"]
    torch.testing.assert_close(r.norm(dim=-1), want)


def test_pca_sampled_picks_the_straightest_and_curviest_candidate_inside_the_pcs():
    h2, h1, h0 = _triples(B=8, D=24)
    acts = torch.randn(300, 24, generator=_gen(10), dtype=torch.float64) * torch.linspace(3, 0.1, 24)
    pcs = top_pcs(acts, 5)
    torch.testing.assert_close(pcs @ pcs.T, torch.eye(5, dtype=torch.float64))
    out = directions(h2, h1, h0, "pca_sampled", 0.5, pcs=pcs, n_candidates=32, generator=_gen(11))
    g = _gen(11)  # the same candidates, re-drawn, to check the choice is their min and max
    coeff = torch.randn(8, 32, 5, generator=g, dtype=torch.float64)
    cand = coeff @ pcs
    cand = 0.5 * (h0 - h1).norm(dim=-1)[:, None, None] * cand / cand.norm(dim=-1, keepdim=True)
    theta = angle_at(h2[:, None], h1[:, None], h0[:, None] + cand)
    torch.testing.assert_close(angle_at(h2, h1, h0 + out["straight"]), theta.min(1).values)
    torch.testing.assert_close(angle_at(h2, h1, h0 + out["curvy"]), theta.max(1).values)
    inside = out["straight"] @ pcs.T @ pcs
    torch.testing.assert_close(inside, out["straight"])


def test_scale_sweep_scales_the_same_directions_and_reports_slopes_and_paired_differences(monkeypatch):
    """Issue 40: every s of perturb.scale perturbs the same tokens along the same drawn directions; per s ΔH and the
    paired aligned - misaligned differences, per condition the slope ΔH/s at the smallest s."""
    import lightning_modules.curvature.perturb as perturb_mod

    torch.manual_seed(0)
    module = CurvatureLM(TINY, perturb={"kind": ["pca_sampled", "extrapolation", "orthogonal", "random"],
                                        "scale": [0.1, 0.01], "n_positions": 12, "positions_per_sequence": 2,
                                        "n_candidates": 8, "pcs": 3})
    module.configure_model()
    assert module.perturb["scale"] == [0.01, 0.1]
    drawn, real = [], perturb_mod.directions
    monkeypatch.setattr(perturb_mod, "directions",
                        lambda *a, **kw: drawn.append((a[4], real(*a, **kw))) or drawn[-1][1])
    module._start()
    module._add(torch.randint(0, 61, (6, 16), generator=_gen(14)), perturb=True)
    # two position draws x two scales x four kinds, in that order
    assert [s for s, _ in drawn] == [0.01] * 4 + [0.1] * 4 + [0.01] * 4 + [0.1] * 4
    for i in (0, 8):
        for small, large in zip(drawn[i:i + 4], drawn[i + 4:i + 8]):
            for cond in small[1]:
                if cond in ("orthogonal", "random", "extrapolation"):
                    torch.testing.assert_close(small[1][cond] / 0.01, large[1][cond] / 0.1)
    out = module.summarize("test")
    rec = module._records["perturb"]
    dH = {key: torch.cat(v["dH"]).double() for key, v in rec.items()}
    assert out["test/perturb/n"] == 12 and len(dH[0.01, "orthogonal"]) == 12
    for s in (0.01, 0.1):
        for cond in ("straight", "curvy", "extrapolation", "orthogonal", "random"):
            assert out[f"test/perturb/s{s:g}/{cond}/dH"] == pytest.approx(dH[s, cond].mean().item())
        for a, b in (("extrapolation", "orthogonal"), ("straight", "curvy"), ("straight", "random")):
            diff = dH[s, a] - dH[s, b]
            assert out[f"test/perturb/s{s:g}/{a}_minus_{b}/dH"] == pytest.approx(diff.mean().item())
            half = 1.959964 * diff.std().item() / math.sqrt(12)
            assert out[f"test/perturb/s{s:g}/{a}_minus_{b}/dH_hi"] == pytest.approx(diff.mean().item() + half)
    for cond in ("straight", "orthogonal"):
        assert out[f"test/perturb/{cond}/slope"] == pytest.approx(dH[0.01, cond].mean().item() / 0.01)


def test_paper_scale_perturbs_with_the_orthogonal_control_over_the_scale_sweep():
    from benchmarks.tables import composed

    for experiment in ("curvature_gpt2_xl", "curvature_pythia_2p8b"):
        p = composed(experiment).model.perturb
        assert "orthogonal" in p.kind and list(p.scale) == [0.02, 0.05, 0.1, 0.5]
    assert CurvatureLM(TINY).perturb["kind"] == ["pca_sampled", "extrapolation", "orthogonal"]


# --- bad input --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"window": 2}, "window >= 3"),
    ({"perturb": {"layer": 5}}, r"perturb.layer=5 is beyond the model's depth: hidden-state indices 1..4"),
    ({"reg": {"lambda": 0.1, "layers": [2, 9]}}, r"reg.layers \[9\] beyond the model's depth"),
    ({"reg": {"lambda": 0.1, "layers": []}}, "lambda > 0 with empty model.reg.layers"),
    ({"perturb": {"kind": "aligned"}}, "perturb.kind='aligned'"),
    ({"perturb": {"scale": [0.1, 0.0]}}, r"perturb.scale=\[0.1, 0.0\]: one s > 0"),
    ({"perturb": {"layer": 4}}, "perturb.layer=4 with model.last_state=post_norm"),
    ({"last_state": "final"}, "last_state='final'"),
    ({"reg": {"form": "cosine"}}, "reg.form='cosine'"),
])
def test_bad_input_is_one_line_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CurvatureLM(TINY, **kwargs)


@pytest.mark.parametrize("pretrained", ["tiny-lm", "/data/pythia-2.8b", None])
def test_revision_needs_a_hub_id(pretrained):
    with pytest.raises(ValueError, match="backbone.revision='step0' needs a hub id"):
        CurvatureLM({**TINY, "pretrained": pretrained, "revision": "step0"})
    check_revision({"pretrained": "EleutherAI/pythia-2.8b", "revision": "step0"})  # fine


def test_revision_reaches_from_pretrained(monkeypatch):
    import transformers

    from lightning_modules.common.backbone import build_backbone

    seen = {}
    monkeypatch.setattr("datamodules.common.errors._offline", lambda: False)  # a hub (faked below), not HF_HUB_OFFLINE
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda location, **kw: seen.update(location=location, **kw) or torch.nn.Linear(1, 1))
    build_backbone({**TINY, "pretrained": "EleutherAI/pythia-2.8b", "revision": "step1000"})
    assert seen["location"] == "EleutherAI/pythia-2.8b" and seen["revision"] == "step1000"
    seen.clear()
    build_backbone({**TINY, "pretrained": "EleutherAI/pythia-2.8b", "revision": None})
    assert "revision" not in seen                              # null: transformers' default (main)


# --- end to end -------------------------------------------------------------------------------------------------
def test_curvature_tiny_runs_the_analysis_and_the_perturbation(tmp_path):
    # debug=smoke leaves the perturbation's size alone: 64 tokens, 4 a sequence, 16 candidates
    _, metrics = run_experiment("curvature_tiny", tmp_path, overrides=[
        "debug=smoke", "model.perturb.n_positions=64", "model.perturb.positions_per_sequence=4",
        "model.perturb.n_candidates=16"])
    final = metrics["final"]
    assert metrics["status"] == "ok" and final["test/perturb/n"] == 64
    assert all(0 < final[f"test/kappa/L{k}"] < math.pi for k in range(5))
    assert all(-1 <= final[f"test/r/L{k}"] <= 1 for k in range(5))
    # the straightest candidate bends less than the curviest, by construction, at every s
    for s in (0.02, 0.05, 0.1, 0.5):
        assert final[f"test/perturb/s{s:g}/straight/dtheta"] < final[f"test/perturb/s{s:g}/curvy/dtheta"]
    assert math.isfinite(final["test/perturb/orthogonal/slope"])
    assert math.isfinite(final["test/perturb/s0.02/extrapolation_minus_orthogonal/dH"])
    assert [row["layer"] for row in metrics["results"]["test_layers"]] == [0, 1, 2, 3, 4]


def test_curvature_reg_tiny_trains_with_the_regulariser_and_records_emergence_from_step_0(tmp_path):
    _, metrics = run_experiment("curvature_reg_tiny", tmp_path)
    assert metrics["status"] == "ok" and math.isfinite(metrics["final"]["val/loss"])
    steps = [e["step"] for e in metrics["results"]["emergence"]]
    assert steps[0] == 0 and steps[1:] == [10, 20]
    assert math.isfinite(metrics["final"]["val/kappa_reg"])
