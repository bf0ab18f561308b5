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
        if mode == "paper_sum":  # ours: ceil
            assert (mask.sum(1) >= max(1, math.ceil(fl * H))).all()
            assert mask.sum() >= math.ceil(fg * L * H)
        else:                    # the release's int floors (its global top-up only draws on the processed domains)
            assert (mask.sum(1) >= max(1, int(fl * H))).all()
        assert info["pruned_fraction"] == pytest.approx(1 - mask.double().mean().item())


def _top(score, n):
    m = torch.zeros(score.numel(), dtype=torch.bool)
    m[score.flatten().argsort(descending=True)[:n]] = True
    return m.reshape(score.shape)


def test_paper_sum_counts_follow_the_readme():
    g = torch.Generator().manual_seed(0)
    L, H, K = 4, 8, 3
    imp = torch.rand(L, H, K, generator=g, dtype=torch.float64)
    kw = dict(eta=0.4, floor_layer=0.0, floor_global=0.0)      # the >= 1 head per layer floor always holds
    floors = lambda m, score: apply_floors(m, score, 0.0, 0.0)  # noqa: E731
    # s = (0.6, 0.35, 0.05) renormalised over the valid (>= 0.1) domains, s_eff = s^1.5
    probs2 = torch.tensor([[0.6, 0.35, 0.05]]).expand(L, K)
    s = probs2[0].double() / probs2[0].double().sum()
    keep2 = 0.1 + 0.4 * breadth(probs2[0].double())
    s_eff = torch.zeros(K, dtype=torch.float64)
    s_eff[:2] = (s[:2] / s[:2].sum()) ** 1.5
    # paper_sum: the top floor(keep * L * H) of sum_k s_eff,k I_k
    mask3, _ = compile_mask(probs2, imp, None, mode="paper_sum", **kw)
    score = (imp * s_eff).sum(-1)
    assert torch.equal(mask3, floors(_top(score, math.floor(keep2 * L * H)), score))
    # every s_k < sim_min (K = 12, uniform): the fallback (mean importance x 0.3), breadth 1
    imp12 = torch.rand(L, H, 12, generator=g, dtype=torch.float64)
    m4, info = compile_mask(torch.full((L, 12), 0.5), imp12, None, mode="paper_sum", **kw)
    assert info["fallback"]
    assert torch.equal(m4, floors(_top(imp12.mean(-1), math.floor(0.5 * L * H)), imp12.mean(-1)))


def test_bisect_eta_matches_a_target_pruned_fraction():
    g = torch.Generator().manual_seed(1)
    imp = torch.rand(6, 8, 3, generator=g)
    probs = torch.tensor([[0.5, 0.3, 0.2]]).expand(6, 3)
    for target in (0.1, 0.3, 0.5):   # paper_sum reaches any fraction to one head (plus the per-layer floor)
        eta, mask, info = bisect_eta(lambda e: compile_mask(probs, imp, None, eta=e, mode="paper_sum"), target)
        assert abs(info["pruned_fraction"] - target) <= 1 / 48 + 1e-9


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
    probes = train_probes(x, torch.nn.functional.one_hot(labels, K).double(), epochs=60, lr=0.05, batch_size=64,
                          features="standardised")  # ours: conditioned; the release's raw default is tested below
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


def test_single_turn_scenarios_are_scored(tmp_path):
    """CommonsenseQA / NQ / ARC come as single-turn scenarios (data.source=files); issue 37: only later turns were
    scored, so they reported perplexity 1.0 and Recall 0 dense and pruned alike. Their one turn is scored now (the
    mask from its prompt alone), beside a two-turn scenario scored on its second turn."""
    import json
    import math

    from lightning_modules.subspace_path.method import recall

    words = {"alpha": "socket host port connect server client address packet send receive buffer stream",
             "beta": "decimal fraction number divide rational round digit precision exponent integer float sum"}
    pools = {}
    for d, w in words.items():
        w = w.split()
        pools[d] = tmp_path / f"{d}.jsonl"
        pools[d].write_text("".join(json.dumps({"text": " ".join(w[(i + j) % len(w)] for j in range(24))}) + "\n"
                                    for i in range(14)))
    scenarios = [
        {"split": "csqa", "domains": [], "turns": [{"prompt": "Question: where does a socket send a packet? Options: "
                                                              "(A) port (B) fraction (C) digit Answer:",
                                                    "answer": "A", "choices": ["port", "fraction", "digit"]}]},
        {"split": "nq", "domains": [], "turns": [{"prompt": "Question: what does a decimal round to? Answer:",
                                                  "answer": "the nearest integer digit"}]},
        {"split": "selected", "domains": ["alpha"], "turns": [{"prompt": "socket host", "answer": "port connect"},
                                                              {"prompt": "server client", "answer": "address packet"}]},
    ]
    (tmp_path / "scenarios.jsonl").write_text("".join(json.dumps(x) + "\n" for x in scenarios))
    files = f"{{pools: {{alpha: {pools['alpha']}, beta: {pools['beta']}}}, scenarios: {tmp_path / 'scenarios.jsonl'}}}"
    _, metrics = run_experiment("subspace_path_tiny", tmp_path / "run", overrides=SMOKE + [
        "data.source=files", "data.domains=[alpha,beta]", "data.ood_domains=[]", f"data.files={files}",
        "trainer.limit_test_batches=3", "model.whitelist.test=none"])
    m, rows = metrics["final"], metrics["results"]["scenarios"]
    assert [len(r["dense"]) for r in rows] == [1, 1, 1] == [len(r["pruned"]) for r in rows]
    for split, row, sc in zip(("csqa", "nq", "selected"), rows, scenarios):
        turn = sc["turns"][-1]
        for which in ("dense", "pruned"):
            ppl = m[f"test/{split}/ppl_{which}"]
            assert math.isfinite(ppl) and ppl > 1, (split, which, ppl)
            t = row[which][0]
            assert t["tokens"] > 0 and t["recall"] == recall(t["prediction"], turn["answer"], turn.get("choices"))
            assert m[f"test/{split}/recall_{which}"] == pytest.approx(100 * t["recall"])


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
def _module(tokenizer, layers=3, heads=4, **kw):
    """A tiny random Llama as SubspacePathModule with a random offline state (probes, importance), K = 3 domains."""
    from lightning_modules.subspace_path.method import Probes
    from lightning_modules.subspace_path.module import SubspacePathModule

    d = 8 * heads
    spec = {"family": "llama", "config": {"vocab_size": len(tokenizer), "hidden_size": d, "intermediate_size": 64,
                                          "num_hidden_layers": layers, "num_attention_heads": heads,
                                          "num_key_value_heads": heads // 2}}
    torch.manual_seed(0)
    module = SubspacePathModule(spec, **kw)
    module.configure_model()
    g = torch.Generator().manual_seed(1)
    probes = Probes(torch.randn(layers, 3, d, generator=g, dtype=torch.float64),
                    torch.zeros(layers, 3, dtype=torch.float64))
    module.state = {"probes": {"single": probes}, "whitelist": None, "domains": ["a", "b", "c"],
                    "importance": torch.rand(layers, heads, 3, generator=g, dtype=torch.float64)}
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


def _release_budget(p, I, white, eta, rho_min=0.1):
    """The release's SessionPruner budget rewritten here as a plain-Python reference (lists, dicts, loops):
    DomainInference with its defaults, max-over-layers similarities, the double min-max ^1.5 map, the union, then
    the three int floors in its order. Returns the kept (layer, head) set."""
    import numpy as np

    p, I = np.asarray(p, dtype=float), np.asarray(I, dtype=float)
    L, H, K = I.shape
    q = p.mean(0)
    qn = q / q.sum()
    c = float(-(qn * np.log(qn + 1e-8)).sum() / np.log(K))
    base = min(rho_min + eta * c, 1.0)
    # domain inference
    shares = [row / row.sum() if row.sum() > 0 else row for row in p]
    score = {}
    for k in range(K):
        col = [float(s[k]) for s in shares]
        top5 = float(np.mean(sorted(col, reverse=True)[:min(5, len(col))]))
        conc = 1.0 / (sum(1 for x in col if x > 0.05) + 1)
        score[k] = (top5 * 0.6 + max(col) * 0.4) * (1 + conc * 0.3)
    kept = {k: v for k, v in score.items() if v >= 0.05}
    if not kept:
        inferred = [max(score.items(), key=lambda x: x[1])[0]]
    else:
        high = [k for k, v in kept.items() if v >= 0.15]
        inferred = sorted(high, key=lambda k: kept[k], reverse=True) if len(high) > 1 else [max(kept.items(), key=lambda x: x[1])[0]]
    sim = p.max(0)
    low = sim.max() < 0.1
    valid = [s for s in sim if s >= 0.1]
    mx, mn = (max(valid), min(valid)) if valid else (sim.max(), 0.1)

    def head_scores(k):
        return (max(sim[k], 0.3) * I.mean(-1)) if low else sim[k] * I[:, :, k]

    chosen = set()
    for k in inferred:
        if sim[k] < 0.1 and not low:
            continue
        if low:
            eff = max(sim[k], 0.3)
        elif mx > mn:
            eff = mn + ((sim[k] - mn) / (mx - mn)) ** 1.5 * (mx - mn)
        else:
            eff = sim[k]
        if mx > mn and eff >= mn:
            eff = mn + ((eff - mn) / (mx - mn)) ** 1.5 * (mx - mn)
        ranked = sorted([(l, h, head_scores(k)[l, h]) for l in range(L) for h in range(H)], key=lambda x: x[2], reverse=True)
        chosen |= {(l, h) for l, h, _ in ranked[:max(1, int(L * H * min(base * eff, 1.0)))]}
    keep = {l: sorted({h for (ll, h) in chosen if ll == l} | {h for h in range(H) if white[l][h]}) for l in range(L)}
    used = [k for k in inferred if low or sim[k] >= 0.1]

    def layer_best(l):
        best = {}
        for k in used:
            for h, s in enumerate(head_scores(k)[l]):
                best[h] = max(best.get(h, -1e9), s)
        return best

    for l in range(L):
        if not keep[l]:
            best = layer_best(l)
            keep[l].append(max(best.items(), key=lambda x: x[1])[0] if best else 0)
    need = max(int(L * H * 0.05), L)
    if sum(map(len, keep.values())) < need:
        cands = sorted([(l, h, head_scores(k)[l, h]) for l in range(L) for k in used for h in range(H) if not white[l][h]],
                       key=lambda x: x[2], reverse=True)
        n = sum(map(len, keep.values()))
        for l, h, _ in cands:
            if n >= need:
                break
            if h not in keep[l]:
                keep[l].append(h)
                n += 1
    per = max(int(H * 0.1), 1)
    for l in range(L):
        if len(keep[l]) < per:
            best = layer_best(l)
            free = sorted([(h, best.get(h, 0.0)) for h in range(H) if h not in keep[l]], key=lambda x: x[1], reverse=True)
            keep[l] += [h for h, _ in free[:per - len(keep[l])]]
    return {(l, h) for l in range(L) for h in keep[l]}


def test_release_union_is_the_release_s_budget():
    """budget.mode=release_union equals the release's budget on clean, cross-domain, flat, noisy and all-low probe
    outputs, with whitelists and floors (the old reading pruned flat scenarios ~75% where the release prunes ~1%)."""
    from lightning_modules.subspace_path.method import release_union_mask

    cases = 0
    for seed in range(120):
        g = torch.Generator().manual_seed(seed)
        L, H, K = 2 + seed % 6, 4 + seed % 9, 3 + seed % 4
        kind = seed % 5
        if kind == 0:    # clean single domain
            p = torch.full((L, K), 0.02).index_fill_(1, torch.tensor([seed % K]), 0.95)
        elif kind == 1:  # cross-domain: two or three strong domains
            p = torch.full((L, K), 0.03)
            p[:, :2 + seed % 2] = 0.5 + 0.4 * torch.rand(L, 2 + seed % 2, generator=g)
        elif kind == 2:  # flat
            p = torch.full((L, K), 0.5) + 0.01 * torch.rand(L, K, generator=g)
        elif kind == 3:  # noisy
            p = torch.rand(L, K, generator=g)
        else:            # all below 0.1
            p = 0.09 * torch.rand(L, K, generator=g)
        I = torch.rand(L, H, K, generator=g, dtype=torch.float64) ** 2
        white = torch.rand(L, H, generator=g) < 0.1
        eta = float(torch.rand(1, generator=g)) * 0.8
        mask, info = release_union_mask(p, I, white, eta)
        want = _release_budget(p.double().numpy(), I.numpy(), white.tolist(), eta)
        assert {tuple(x) for x in mask.nonzero().tolist()} == want, (seed, kind)
        cases += 1
    assert cases == 120
    flat = torch.full((8, 6), 0.5)
    I = torch.rand(8, 16, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert compile_mask(flat, I, None, eta=0.5)[1]["pruned_fraction"] < 0.2   # broad scenario, broad budget (was 0.75)


def test_probe_training_is_the_release_s():
    """Defaults as released: Adam lr 1e-3, batch 32, raw features. From zero weights one full-batch Adam step moves
    each weight by lr against the sign of its gradient on the raw activations (BCE at logit 0: sum_n (1/2 - y) x);
    standardised features (ours, a switch) would move it by lr / sd instead."""
    g = torch.Generator().manual_seed(0)
    N, L, d, K = 32, 2, 5, 3
    x = torch.randn(N, L, d, generator=g, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1, 3.0, 0.5]) + 2.0
    y = torch.nn.functional.one_hot(torch.arange(N) % K, K).double()
    grad = torch.einsum("nk,nld->lkd", 0.5 - y, x)
    probes = train_probes(x, y, epochs=1)
    torch.testing.assert_close(probes.weight, -1e-3 * grad.sign(), rtol=1e-6, atol=1e-9)
    z = train_probes(x, y, epochs=1, features="standardised")
    assert not torch.allclose(z.weight, probes.weight)
    cfg = compose("subspace_path_tiny").model.probe
    assert (cfg.lr, cfg.batch_size, cfg.features, cfg.epochs) == (1e-3, 32, "raw", 20)


def test_probe_site_post_attn_by_default_release_attn_out_as_switch(tiny_tokenizer):
    """probe.site=post_attn (the spec's, default) pools h + attn(h); attn_out (the release's hook in effect) pools
    attn(h) alone: the two differ by the pooled block input."""
    from lightning_modules.common.activations import capture

    text = "sockets bind a port and accept connections"
    feats = {site: _module(tiny_tokenizer, probe={"site": site}).pooled(tiny_tokenizer, text)
             for site in ("post_attn", "attn_out")}
    module = _module(tiny_tokenizer)
    ids = module._ids(tiny_tokenizer, text)
    with torch.no_grad(), capture(module.model, ("embed", "block_out")) as acts:
        module.model(input_ids=ids, use_cache=False)
    block_in = [acts["embed"][0]] + [acts["block_out"][l] for l in range(2)]
    for l in range(3):
        torch.testing.assert_close(feats["post_attn"][l] - feats["attn_out"][l], block_in[l][0].double().mean(0).cpu())
    assert compose("subspace_path_tiny").model.probe.site == "post_attn"


def test_the_run_is_calibrated_to_the_paper_s_pruning(tiny_tokenizer):
    """budget.target_prune with target_scope=run (the paper-scale configs: 0.3): one eta bisected before the first
    scenario so that the run's mean pruned fraction is the target; each scenario keeps its own breadth-dependent
    budget at that eta (the fractions differ), unlike eta = 0.5, which pins no fraction."""
    from types import SimpleNamespace

    module = _module(tiny_tokenizer, layers=4, heads=8, budget={"target_prune": 0.3})
    words = ["sockets bind ports", "matrix rounding floats", "strings split join", "threads lock queues",
             "files open paths", "sockets and threads", "floats in strings files", "lock ports paths"]
    scenarios = [{"turns": [{"prompt": w + " " + v, "answer": "x"}]} for w in words for v in ("now", "later please")]
    dm = SimpleNamespace(tokenizer=tiny_tokenizer, scenario=lambda i: scenarios[i], n_total=lambda: len(scenarios))
    eta = module.calibrate_eta(dm)
    fr = [module.compile(module.scenario_probs(tiny_tokenizer, s))[1]["pruned_fraction"] for s in scenarios]
    assert module.eta == eta and abs(sum(fr) / len(fr) - 0.3) <= 1 / 32
    assert len(set(fr)) > 1
    for name in ("subspace_path_llama2_13b", "subspace_path_qwen25_14b"):
        b = compose(name).model.budget
        assert (b.target_prune, b.target_scope) == (0.3, "run")


def test_kv_saving_counts_whole_groups_only(tiny_tokenizer):
    """The KV memory a mask saves: only KV groups with every head pruned. One head pruned per group: half the heads
    gone, no cache saved; a whole group pruned: its share saved. Each compiled mask reports it."""
    from lightning_modules.subspace_path.method import kv_saved_fraction

    one_per_group = torch.tensor([[True, False, True, False], [False, True, True, False]])   # 2 layers, 2 groups of 2
    assert 1 - one_per_group.double().mean() == 0.5 and kv_saved_fraction(one_per_group, 2) == 0.0
    whole = torch.tensor([[True, True, False, False], [True, True, True, True]])
    assert kv_saved_fraction(whole, 2) == 0.25
    module = _module(tiny_tokenizer, layers=4, heads=8)
    mask, info = module.compile(module.scenario_probs(tiny_tokenizer, {"turns": [{"prompt": "sockets bind"}]}))
    assert info["kv_saved_fraction"] == kv_saved_fraction(mask, 4) <= info["pruned_fraction"]
