"""The shared KV-cache press interface (lightning_modules/common/kv_press.py): the cache contract, every scorer's
ranking semantics against planted ground truth, and every scorer x wrapper on one tiny backbone."""
from types import SimpleNamespace

import pytest
import torch

from lightning_modules.common.kv_press import (SCORERS, AdaKV, Block, KeyDiff, KNorm, ManifoldKV, Random, SnapKV,
                                               StreamingLLM, WindowedManifoldKV, build_press, prefill_and_answer)

L_CTX = 40


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, 97, (1, L_CTX), generator=g), torch.randint(2, 97, (6,), generator=g)


def prefill(model, context, press):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with press(model), torch.no_grad():
        model(input_ids=context, cache=cache, use_cache=True)
    return cache


def greedy_reference(model, ids, n):
    seq = ids.view(1, -1)
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(input_ids=seq).logits[0, -1].argmax())
            out.append(tok)
            seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)
    return out


@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5, 0.9])
def test_compression_keeps_exactly_int_L_1_minus_r_keys_per_head(model, ids, ratio):
    context, _ = ids
    full = prefill(model, context, KNorm(0.0))
    cache = prefill(model, context, KNorm(ratio))
    n_kept = int(L_CTX * (1 - ratio))
    for full_layer, layer in zip(full.layers, cache.layers):
        assert layer.keys.shape == (1, 2, n_kept, 16) and layer.values.shape == (1, 2, n_kept, 16)
        # what is kept is a subset of the original entries, in position order, keys and values together
        for h in range(2):
            match = (layer.keys[0, h, :, None] == full_layer.keys[0, h, None]).all(-1)
            pos = match.float().argmax(-1)
            assert match.any(-1).all() and (pos.diff() > 0).all()
            torch.testing.assert_close(layer.values[0, h], full_layer.values[0, h, pos])


def test_ratio_zero_is_identity(model, ids):
    from transformers import DynamicCache

    context, _ = ids
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=context, cache=ref, use_cache=True)
    for press in (ManifoldKV(0.0), AdaKV(press=KeyDiff(0.0)), Block(press=SnapKV(0.0))):
        cache = prefill(model, context, press)
        for a, b in zip(ref.layers, cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_question_appended_after_compression_decodes_at_the_right_positions(model, ids):
    context, question = ids
    # uncompressed: identical to greedy decoding of context + question as one sequence (positions continue at L)
    out = prefill_and_answer(model, ManifoldKV(0.0), context, [question, question], max_new_tokens=5)
    expected = greedy_reference(model, torch.cat([context[0], question]), 5)
    assert out.answers == [expected, expected]  # the cache was cropped back between the two questions
    # compressed: the question runs on the shortened cache, one compressed context serves both questions
    out = prefill_and_answer(model, ManifoldKV(0.5), context, [question, question[:3]], max_new_tokens=4,
                             gold=[question[:2], question[:2]])
    assert [len(a) for a in out.answers] == [4, 4]
    assert out.summary["kv_kept_fraction"] == pytest.approx(int(L_CTX * 0.5) / L_CTX)
    assert all(torch.isfinite(torch.tensor(x)) for x in out.answer_nll)


def _score(press, keys):
    return press.score(SimpleNamespace(layer_idx=0), None, keys, keys, {})


def test_manifoldkv_ranks_exactly_opposite_to_knorm_on_plus_minus_pairs():
    g = torch.Generator().manual_seed(0)
    half = torch.randn(1, 2, 16, 8, generator=g) * torch.linspace(0.5, 3, 16).view(1, 1, 16, 1)
    keys = torch.cat([half, -half], dim=2)  # centroid exactly 0 in every head
    m, k = _score(ManifoldKV(0.5), keys), _score(KNorm(0.5), keys)
    torch.testing.assert_close(m, keys.norm(dim=-1))
    torch.testing.assert_close(m, -k)
    keep_m = set(m[0, 0].topk(16).indices.tolist())
    keep_k = set(k[0, 0].topk(16).indices.tolist())
    assert keep_m.isdisjoint(keep_k) and len(keep_m | keep_k) == 32  # complementary halves


def test_radial_outlier_kept_by_manifoldkv_and_evicted_by_keydiff():
    g = torch.Generator().manual_seed(0)
    d, n = 16, 64
    mu = torch.randn(d, generator=g)
    mu = mu / mu.norm() * 2
    perp = torch.randn(d, generator=g)
    perp = perp - (perp @ mu) / (mu @ mu) * mu
    cluster = mu + 0.05 * torch.randn(n, d, generator=g)
    radial, angular = 10 * mu, mu + perp / perp.norm()
    keys = torch.cat([cluster, radial[None], angular[None]]).view(1, 1, n + 2, d)
    m, kd = _score(ManifoldKV(0.5), keys)[0, 0], _score(KeyDiff(0.5), keys)[0, 0]
    assert set(m.topk(2).indices.tolist()) == {n, n + 1}  # both outliers on top for L2
    assert int(kd.argmin()) == n                           # cosine sees 10*mu as the most typical key
    assert int(kd.argmax()) == n + 1                       # but it does see the angular one
    n_kept = int((n + 2) * 0.5)
    assert n in m.topk(n_kept).indices.tolist() and n not in kd.topk(n_kept).indices.tolist()


def test_windowed_manifoldkv_finds_each_topic_outlier_and_reduces_to_global():
    g = torch.Generator().manual_seed(0)
    d, half = 16, 32
    axis = torch.zeros(d)
    axis[0] = 1.0
    mu_a, mu_b = -5 * axis, 5 * axis
    a = mu_a + torch.randn(half, d, generator=g) * torch.tensor([0.1] + [0.05] * (d - 1))
    b = mu_b + torch.randn(half, d, generator=g) * torch.tensor([0.1] + [0.05] * (d - 1))
    off = torch.zeros(d)
    off[3] = 1.0
    a[7], b[20] = mu_a + off, mu_b - off  # one mild outlier per topic, off the topic axis
    keys = torch.cat([a, b]).view(1, 1, 2 * half, d)
    outliers = {7, half + 20}
    glob = _score(ManifoldKV(0.5), keys)[0, 0]
    win = _score(ManifoldKV(0.5, window_size=half), keys)[0, 0]
    assert set(win.topk(2).indices.tolist()) == outliers
    assert set(glob.topk(2).indices.tolist()) != outliers  # the diluted global centroid misranks them
    for w in (2 * half, 10 * half):
        assert torch.equal(_score(ManifoldKV(0.5, window_size=w), keys), _score(ManifoldKV(0.5), keys))
    assert WindowedManifoldKV(0.5).window_size == 4096  # the paper's window
    assert torch.equal(_score(WindowedManifoldKV(0.5, window_size=half), keys)[0, 0], win)
    # a trailing partial window gets its own centroid
    part = _score(ManifoldKV(0.5, window_size=40), keys)[0, 0]
    tail = keys[0, 0, 40:]
    torch.testing.assert_close(part[40:], (tail - tail.mean(0)).norm(dim=-1))


def test_adakv_budget_per_layer_and_masked_count():
    g = torch.Generator().manual_seed(0)
    H, L, ratio, alpha = 4, 50, 0.6, 0.2
    spread = torch.tensor([4.0, 1.0, 0.5, 0.1]).view(1, H, 1, 1)
    keys = torch.randn(1, H, L, 8, generator=g) * spread
    module = SimpleNamespace(layer_idx=0)
    press = AdaKV(press=ManifoldKV(ratio), alpha_safeguard=alpha)
    k2, v2 = press.compress(module, None, keys, keys, {})
    assert k2 is keys  # nothing physically removed
    n_kept = int(L * (1 - ratio))
    evicted = module.press_evicted
    assert int(evicted.sum()) == H * (L - n_kept)            # masked count = layer budget
    kept = L - evicted.sum(-1)[0]
    assert int(kept.sum()) == H * n_kept and (kept >= int(n_kept * alpha)).all()
    assert kept[0] > n_kept > kept[3]                         # the spread-out head gets more budget
    top = ManifoldKV(ratio).score(module, None, keys, keys, {})[0, 3].topk(int(n_kept * alpha)).indices
    assert not evicted[0, 3, top].any()                       # the safeguard tokens of every head survive


def test_adakv_masking_equals_physical_eviction_when_budgets_are_uniform(model, ids):
    """alpha_safeguard=1 gives every head exactly its own top n_kept: masking must then match removal."""
    context, question = ids
    ada = prefill_and_answer(model, AdaKV(press=KNorm(0.5), alpha_safeguard=1.0), context, [question],
                             max_new_tokens=5, gold=[question[:3]])
    phys = prefill_and_answer(model, KNorm(0.5), context, [question], max_new_tokens=5, gold=[question[:3]])
    assert ada.answers == phys.answers
    assert ada.answer_nll[0] == pytest.approx(phys.answer_nll[0], abs=1e-4)
    full = prefill_and_answer(model, None, context, [question], max_new_tokens=5, gold=[question[:3]])
    assert ada.answer_nll[0] != pytest.approx(full.answer_nll[0], abs=1e-4)  # the mask did something
    assert model.config._attn_implementation == "sdpa"  # restored on exit


def test_block_with_a_static_score_equals_global_selection(model, ids):
    context, _ = ids
    a = prefill(model, context, Block(press=KNorm(0.5), block_size=7))
    b = prefill(model, context, KNorm(0.5))
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.keys, y.keys)


def test_streaming_keeps_sinks_and_recent():
    s = _score(StreamingLLM(0.5, n_sink=4), torch.randn(1, 1, 20, 4))[0, 0]
    assert s.topk(10).indices.sort().values.tolist() == [0, 1, 2, 3, 14, 15, 16, 17, 18, 19]


def test_snapkv_keeps_the_attended_key(model, ids):
    """Plant a key that every window query attends to: SnapKV must keep it (and the window itself)."""
    from transformers import DynamicCache

    context, _ = ids
    captured = {}
    attn = model.model.layers[0].self_attn
    h = attn.register_forward_hook(lambda m, a, kw, o: captured.update(kw=kw), with_kwargs=True)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=context, cache=cache, use_cache=True)
    h.remove()
    kw, keys = captured["kw"], cache.layers[0].keys.clone()
    press = SnapKV(0.5, window_size=8)
    q = press.window_queries(attn, kw["hidden_states"], 8, kw).float()  # (1, 4, 8, 16)
    keys[:, :, 5] = 50 * q.mean(dim=(1, 2)).view(1, 1, -1)  # key 5 aligned with the mean window query
    scores = press.score(attn, kw["hidden_states"], keys, keys, kw)[0]
    kept = scores.topk(int(L_CTX * 0.5), dim=-1).indices
    assert all(5 in row.tolist() for row in kept)
    assert all(set(range(L_CTX - 8, L_CTX)) <= set(row.tolist()) for row in kept)


@pytest.mark.parametrize("wrapper", [None, "adakv", "block"])
@pytest.mark.parametrize("name", sorted(SCORERS))
def test_every_scorer_with_every_wrapper_runs_on_a_tiny_backbone(model, ids, name, wrapper):
    context, question = ids
    press = build_press(name, 0.3, wrapper=wrapper, block_size=16, snap_window=8, window_size=16)
    out = prefill_and_answer(model, press, context, [question], max_new_tokens=3, gold=[question[:2]])
    assert len(out.answers[0]) == 3 and torch.isfinite(torch.tensor(out.answer_nll[0]))
    n_kept = int(L_CTX * 0.7)
    assert out.summary["kv_kept_fraction"] == pytest.approx(n_kept / L_CTX)
    assert set(out.summary["kept_per_head"]) == {0, 1}


def test_build_press_errors_name_the_fix():
    with pytest.raises(ValueError, match="press.name"):
        build_press("h2o", 0.2)
    with pytest.raises(ValueError, match="press.wrapper"):
        build_press("keydiff", 0.2, wrapper="chunk")
    with pytest.raises(ValueError, match="not fields of any press"):
        build_press("keydiff", 0.2, windowsize=3)
    with pytest.raises(ValueError, match="fraction removed"):
        build_press("manifoldkv", 1.0)
    p = build_press("snapkv", 0.2, window_size=4096, snap_window=32, alpha_safeguard=0.2)
    assert isinstance(p, SnapKV) and p.window_size == 32  # ManifoldKV's window is not SnapKV's
    p = build_press("manifoldkv", 0.2, wrapper="adakv", window_size=4096, alpha_safeguard=0.3, n_sink=4)
    assert isinstance(p, AdaKV) and p.press.window_size == 4096 and p.alpha_safeguard == 0.3
    assert isinstance(build_press("random", 0.2, seed=3), Random)


def test_pre_rope_variant_scores_the_unrotated_keys(model, ids):
    """pre_rope=True undoes the rotation exactly: on cached (rotated) keys it equals ManifoldKV on the raw k_proj keys."""
    context, _ = ids
    attn = model.model.layers[1].self_attn
    captured = {}
    h = attn.register_forward_hook(lambda m, a, kw, o: captured.update(kw=kw), with_kwargs=True)
    cache = prefill(model, context, KNorm(0.0))
    h.remove()
    kw = captured["kw"]
    raw = attn.k_proj(kw["hidden_states"]).view(1, L_CTX, 2, 16).transpose(1, 2)
    rotated = cache.layers[1].keys
    assert not torch.allclose(rotated, raw, atol=1e-3)
    pre = ManifoldKV(0.5, pre_rope=True).score(attn, kw["hidden_states"], rotated, rotated, kw)
    torch.testing.assert_close(pre, ManifoldKV(0.5).score(attn, None, raw, raw, {}), atol=1e-4, rtol=1e-4)
    # inside Block every scored key is unrotated with its own position
    blocked = prefill(model, context, Block(press=ManifoldKV(0.5, pre_rope=True), block_size=64))
    plain = prefill(model, context, ManifoldKV(0.5, pre_rope=True))
    assert torch.equal(blocked.layers[1].keys, plain.layers[1].keys)
    prefill(model, context, Block(press=ManifoldKV(0.5, pre_rope=True), block_size=8))  # partial blocks run


def test_distance_ablation_variants_match_their_formulas():
    keys = torch.randn(2, 3, 30, 8, generator=torch.Generator().manual_seed(5))
    diff = keys - keys.mean(dim=-2, keepdim=True)
    torch.testing.assert_close(_score(ManifoldKV(0.5, distance="l1"), keys), diff.abs().sum(-1))
    torch.testing.assert_close(_score(ManifoldKV(0.5, distance="linf"), keys), diff.abs().max(-1).values)
    mu = keys.mean(dim=-2, keepdim=True)
    cos = (keys * mu).sum(-1) / (keys.norm(dim=-1) * mu.norm(dim=-1))
    torch.testing.assert_close(_score(ManifoldKV(0.5, distance="cosine"), keys), -cos)
    with pytest.raises(ValueError, match="choose l2"):
        _score(ManifoldKV(0.5, distance="l3"), keys)
