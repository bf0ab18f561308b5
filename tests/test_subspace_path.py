"""SubspacePath Pruner: the importance formula, breadth, the mask compiler's whitelist / floors / budgets, probes on
planted domain shifts, the quasi-orthogonal basis, Recall, bad input, and the tiny experiment end to end."""
import math
import re

import pytest
import torch

from lightning_modules.subspace_path.method import (apply_floors, bisect_eta, breadth, compile_mask, importance_terms,
                                                    quasi_orthogonal, recall, train_probes, whitelist)
from tests.helpers import compose, run_experiment


def test_importance_is_cos_squared_between_write_and_axis():
    d = 16
    u = torch.nn.functional.normalize(torch.randn(2, d, dtype=torch.float64), dim=-1)
    ortho = torch.randn(d, dtype=torch.float64)
    ortho -= (ortho @ u[0]) * u[0]
    theta = 0.7
    v = torch.nn.functional.normalize(ortho, dim=0)
    writes = torch.stack([3.0 * u[0], ortho, 2.5 * (math.cos(theta) * u[0] + math.sin(theta) * v)])   # (H=3, d)
    I = importance_terms(writes, u, eps=0.0)[:, 0]
    torch.testing.assert_close(I, torch.tensor([1.0, 0.0, math.cos(theta) ** 2], dtype=torch.float64))
    # eps damps small writes: (u·w)^2 / (|w|^2 + eps)
    small = importance_terms(0.1 * u[:1], u[:1], eps=0.01)
    torch.testing.assert_close(small, torch.tensor([[0.01 / 0.02]], dtype=torch.float64))


def test_breadth_is_zero_for_one_hot_and_one_for_uniform():
    assert breadth(torch.tensor([0.0, 1.0, 0.0, 0.0])) == pytest.approx(0.0, abs=1e-12)
    assert breadth(torch.full((6,), 0.37)) == pytest.approx(1.0)
    q = torch.tensor([0.5, 0.25, 0.25])
    assert breadth(q) == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)) / math.log(3))


@pytest.mark.parametrize("mode", ["release_union", "paper_sum"])
def test_masks_always_hold_whitelist_and_floors(mode):
    for seed in range(60):
        g = torch.Generator().manual_seed(seed)
        L, H, K = 1 + seed % 5, 2 + seed % 7, 2 + seed % 11
        imp = torch.rand(L, H, K, generator=g) ** 3
        probs = torch.rand(L, K, generator=g) ** 4
        white = torch.rand(L, H, generator=g) < 0.15
        fl, fg = float(torch.rand(1, generator=g)) * 0.5, float(torch.rand(1, generator=g)) * 0.5
        mask, info = compile_mask(probs, imp, white, eta=float(torch.rand(1, generator=g)) * 2, mode=mode,
                                  floor_layer=fl, floor_global=fg)
        assert mask[white].all()
        assert (mask.sum(1) >= max(1, math.ceil(fl * H))).all()
        assert mask.sum() >= math.ceil(fg * L * H)
        assert info["pruned_fraction"] == pytest.approx(1 - mask.double().mean().item())


def _top(score, n):
    m = torch.zeros(score.numel(), dtype=torch.bool)
    m[score.flatten().argsort(descending=True)[:n]] = True
    return m.reshape(score.shape)


def test_budget_counts_follow_the_release_and_the_readme():
    g = torch.Generator().manual_seed(0)
    L, H, K = 4, 8, 3
    imp = torch.rand(L, H, K, generator=g, dtype=torch.float64)
    kw = dict(eta=0.4, floor_layer=0.0, floor_global=0.0)      # the >= 1 head per layer floor always holds
    floors = lambda m, score: apply_floors(m, score, 0.0, 0.0)  # noqa: E731
    # s = (0.9, 0.04, 0.06): only domain 0 valid, s_eff = 1^1.5: the top floor(keep * L * H) heads by I_0
    probs = torch.tensor([[0.9, 0.04, 0.06]]).expand(L, K)
    keep = 0.1 + 0.4 * breadth(probs[0].double())
    mask, info = compile_mask(probs, imp, None, mode="release_union", **kw)
    assert info["keep_ratio"] == pytest.approx(keep)
    s_eff1 = torch.tensor([1.0, 0, 0], dtype=torch.float64)
    assert torch.equal(mask, floors(_top(imp[..., 0], math.floor(keep * L * H)), (imp * s_eff1).amax(-1)))
    # two valid domains: per-domain counts floor(keep * s_eff,k * L * H), s_eff = renormalised s^1.5, then union
    probs2 = torch.tensor([[0.6, 0.35, 0.05]]).expand(L, K)
    s = probs2[0].double() / probs2[0].double().sum()
    keep2 = 0.1 + 0.4 * breadth(probs2[0].double())
    s_eff = torch.zeros(K, dtype=torch.float64)
    s_eff[:2] = (s[:2] / s[:2].sum()) ** 1.5
    want = torch.zeros(L, H, dtype=torch.bool)
    for k in range(2):
        want |= _top(imp[..., k] * s_eff[k], math.floor(keep2 * s_eff[k] * L * H))
    mask2, _ = compile_mask(probs2, imp, None, mode="release_union", **kw)
    assert torch.equal(mask2, floors(want, (imp * s_eff).amax(-1)))
    # paper_sum: the top floor(keep * L * H) of sum_k s_eff,k I_k
    mask3, _ = compile_mask(probs2, imp, None, mode="paper_sum", **kw)
    score = (imp * s_eff).sum(-1)
    assert torch.equal(mask3, floors(_top(score, math.floor(keep2 * L * H)), score))
    # every s_k < sim_min (K = 12, uniform): the fallback (mean importance, s_eff = 0.3), breadth 1
    imp12 = torch.rand(L, H, 12, generator=g, dtype=torch.float64)
    m4, info = compile_mask(torch.full((L, 12), 0.5), imp12, None, mode="release_union", **kw)
    assert info["fallback"]
    assert torch.equal(m4, floors(_top(imp12.mean(-1), math.floor(0.5 * 0.3 * L * H)), imp12.mean(-1)))


def test_bisect_eta_matches_a_target_pruned_fraction():
    g = torch.Generator().manual_seed(1)
    imp = torch.rand(6, 8, 3, generator=g)
    probs = torch.tensor([[0.5, 0.3, 0.2]]).expand(6, 3)
    for target in (0.1, 0.3, 0.5):   # paper_sum reaches any fraction to one head (plus the per-layer floor)
        eta, mask, info = bisect_eta(lambda e: compile_mask(probs, imp, None, eta=e, mode="paper_sum"), target)
        assert abs(info["pruned_fraction"] - target) <= 1 / 48 + 1e-9
    # release_union keeps at most sum_k floor(s_eff,k L H) heads (s_eff = s^1.5 sums below 1): the closest is returned
    _, _, info = bisect_eta(lambda e: compile_mask(probs, imp, None, eta=e), 0.1)
    s = torch.tensor([0.5, 0.3, 0.2]) ** 1.5
    assert info["pruned_fraction"] >= 1 - float(s.sum()) - 6 / 48


def test_floors_add_best_heads_per_layer():
    score = torch.tensor([[0.1, 0.9, 0.5, 0.2], [0.3, 0.2, 0.8, 0.7]])
    mask = apply_floors(torch.zeros(2, 4, dtype=torch.bool), score, floor_layer=0.5, floor_global=0.0)
    assert mask.tolist() == [[False, True, True, False], [False, False, True, True]]


def test_probes_recover_planted_domain_shifts():
    g = torch.Generator().manual_seed(0)
    N, L, d, K = 600, 2, 24, 3
    dirs = torch.nn.functional.normalize(torch.randn(L, K, d, generator=g, dtype=torch.float64), dim=-1)
    labels = torch.arange(N) % K
    x = torch.randn(N, L, d, generator=g, dtype=torch.float64) + 2.0 * dirs[:, labels].transpose(0, 1) + 5.0
    probes = train_probes(x, torch.nn.functional.one_hot(labels, K).double(), epochs=60, lr=0.05)
    for l in range(L):
        for k in range(K):   # one-vs-rest: the planted contrast mu_k - mu_rest (isotropic noise)
            contrast = x[labels == k, l].mean(0) - x[labels != k, l].mean(0)
            cos = torch.nn.functional.cosine_similarity(probes.axes()[l, k], contrast, dim=0)
            assert cos > 0.95
    acc = (probes.logits(x).argmax(-1) == labels[:, None]).double().mean()
    assert acc > 0.8


def test_quasi_orthogonal_avoids_aligned_candidates():
    e = torch.eye(4, dtype=torch.float64)
    cands = torch.stack([e[0], e[0] + 0.1 * e[1], e[1], e[1] + e[2] * 0.2, e[2], e[3] + 0.05 * e[0]])
    chosen = quasi_orthogonal(cands, 4)
    assert sorted(chosen) == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="2 <= K"):
        quasi_orthogonal(cands, 7)


def test_whitelist_keeps_backbone_heads_and_drops_domain_specific_ones():
    g = torch.Generator().manual_seed(0)
    L, H, K, N = 2, 5, 3, 40
    samples = []
    for k in range(K):
        s = 0.05 * torch.rand(N, L, H, generator=g, dtype=torch.float64)
        s += 0.3 * torch.rand(1, L, H, generator=g, dtype=torch.float64)   # domain-dependent background
        s[:, 0, 0] = 0.9 + 0.05 * torch.rand(N, generator=g, dtype=torch.float64)
        s[:, 1, 2] += 0.9 if k == 0 else 0.0  # domain-0 specialist: high mean, high variance
        # (0, 0) is the backbone head: high for every domain
        samples.append(s)
    white = whitelist(samples, mean_quantile=0.8, var_quantile=0.5, test="anova")
    assert white[0, 0] and not white[1, 2]
    # ANOVA rejects a head whose small mean difference across domains is significant
    for k in range(K):
        samples[k][:, 0, 0] += 0.02 * k
    assert not whitelist(samples, mean_quantile=0.8, var_quantile=0.9, test="anova")[0, 0]
    assert whitelist(samples, mean_quantile=0.8, var_quantile=0.9, test="none")[0, 0]


def test_recall_is_keyword_overlap_and_letter_match():
    assert recall("the socket is closed by the server", "The server closes the socket") == pytest.approx(2 / 3)
    assert recall("Answer: B", "B", choices=["x", "y", "z"]) == 1.0
    assert recall("A is wrong", "B", choices=["x", "y"]) == 0.0


def test_head_writes_sum_to_the_o_proj_output():
    from lightning_modules.common.activations import capture, decoder_layers
    from lightning_modules.common.backbone import build_backbone

    torch.manual_seed(0)
    model = build_backbone({"family": "llama", "dtype": "float64", "attn_implementation": "eager",
                            "config": dict(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2)}).eval()
    outs = {}
    hooks = [b.self_attn.o_proj.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o))
             for i, b in enumerate(decoder_layers(model))]
    with torch.no_grad(), capture(model, ("head_write",)) as acts:
        model(torch.randint(0, 50, (1, 7)))
    for h in hooks:
        h.remove()
    for i in outs:
        torch.testing.assert_close(acts["head_write"][i].sum(-2), outs[i], rtol=0, atol=1e-12)


@pytest.mark.parametrize("override, match", [
    ("data.domains=[networking,astrology]", "astrology"),
    ("data.domains=[networking]", "at least 2"),
    ("data.passage_words=4000", "passages"),
    ("model.basis=pca", "basis"),
    ("model.budget.mode=max", "budget.mode"),
    ("model.execution=fused", "execution"),
    ("model.pruning_strength=-0.1", "pruning_strength"),
    ("model.budget.floor_layer=1.5", "floor_layer"),
    ("model.budget.floor_global=-0.1", "floor_global"),
])
def test_bad_input_is_one_line_before_the_model(override, match):
    from hydra.utils import instantiate

    cfg = compose("subspace_path_tiny", [override])
    with pytest.raises(Exception) as info:
        instantiate(cfg.data, _convert_="all")
        instantiate(cfg.model, _convert_="all")
    cause = info.value.__cause__ or info.value  # Hydra wraps errors raised in a constructor
    assert isinstance(cause, ValueError) and re.search(match, str(cause)) and "\n" not in str(cause)


# debug=smoke keeps 2 scenarios; the pools (6 passages a domain), probe epochs and generated tokens are shrunk here
SMOKE = ["debug=smoke", "data.pool_size=6", "model.probe.epochs=3", "model.eval.max_new_tokens=4"]


def test_subspace_path_tiny_runs_end_to_end(tmp_path):
    value, metrics = run_experiment("subspace_path_tiny", tmp_path, overrides=SMOKE)
    m = metrics["final"]
    assert 0 < m["test/pruned_fraction"] < 1
    assert m["test/selected/ppl_dense"] > 1 and m["test/selected/ppl_pruned"] > 1
    assert value == pytest.approx(m["test/ppl_ratio"])


@pytest.mark.slow
def test_subspace_path_tiny_slice_matches_mask_and_other_switches(tmp_path):
    base = SMOKE + ["model.budget.target_prune=0.3"]
    _, mask = run_experiment("subspace_path_tiny", tmp_path / "mask", overrides=base)
    _, sl = run_experiment("subspace_path_tiny", tmp_path / "slice", overrides=base + ["model.execution=slice"])
    get = lambda m, k: m["final"][k]  # noqa: E731
    # tiny-lm is GQA (2 KV heads): slice widens masks to whole groups, so compare the dense side exactly
    assert get(mask, "test/selected/ppl_dense") == pytest.approx(get(sl, "test/selected/ppl_dense"), rel=1e-6)
    pruned_heads = get(sl, "test/pruned_fraction") * 16 * 2       # 2 scenarios x 16 heads, whole groups of 2
    assert pruned_heads == pytest.approx(round(pruned_heads)) and round(pruned_heads) % 2 == 0
    run_experiment("subspace_path_tiny", tmp_path / "qo", overrides=SMOKE + [
        "model.basis=quasi_orthogonal", "model.n_domains=3", "model.calib.enabled=true", "model.importance.mode=multi",
        "model.importance.pool=per_token", "model.budget.mode=paper_sum", "model.whitelist.test=none"])


def test_embedded_documents_by_source_are_the_corpus_with_their_modules():
    from datamodules.common.corpus import embedded_documents, embedded_documents_by_source
    from lightning_modules.subspace_path.data import family_of

    pairs = embedded_documents_by_source()
    assert [t for _, t in pairs] == embedded_documents()
    sources = dict(pairs)
    assert "socket" in sources and "socket" in sources["socket"].lower()
    assert any(s.startswith("reference.") for s in sources) and any(s.startswith("asyncio.") for s in sources)
    assert family_of("asyncio.tasks") == "concurrency" and family_of("reference.if") == "reference"


def test_max_abs_cosine():
    from lightning_modules.common.embedding import max_abs_cosine

    assert max_abs_cosine(torch.eye(3)) == pytest.approx(0.0)
    assert max_abs_cosine(torch.tensor([[1.0, 0.0], [-1.0, 0.2], [0.0, 1.0]])) == pytest.approx(1 / math.sqrt(1.04))


# --- the release's online procedure (issue 39) -----------------------------------------------------------------------
def _module(tokenizer, **kw):
    """A tiny random Llama as SubspacePathModule with a random offline state (probes, importance), K = 3 domains."""
    from lightning_modules.subspace_path.method import Probes
    from lightning_modules.subspace_path.module import SubspacePathModule

    spec = {"family": "llama", "config": {"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                                          "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}}
    torch.manual_seed(0)
    module = SubspacePathModule(spec, **kw)
    module.configure_model()
    g = torch.Generator().manual_seed(1)
    probes = Probes(torch.randn(3, 3, 32, generator=g, dtype=torch.float64), torch.zeros(3, 3, dtype=torch.float64))
    module.state = {"probes": {"single": probes}, "importance": torch.rand(3, 4, 3, generator=g, dtype=torch.float64),
                    "whitelist": None, "domains": ["a", "b", "c"]}
    return module


def test_routing_reads_the_prompt_never_the_answer(tiny_tokenizer):
    """The mask is compiled from the first prompt alone (the release's session description): a different gold
    answer leaves the probe outputs and the mask unchanged."""
    module = _module(tiny_tokenizer)
    turns = [{"prompt": "How do sockets bind a port on the server?", "answer": "bind listen accept"}]
    other = [{"prompt": turns[0]["prompt"], "answer": "Matrices multiply rows by columns; floating point rounding."}]
    p1 = module.scenario_probs(tiny_tokenizer, {"turns": turns})
    p2 = module.scenario_probs(tiny_tokenizer, {"turns": other})
    assert torch.equal(p1, p2)
    assert torch.equal(module.compile(p1)[0], module.compile(p2)[0])
