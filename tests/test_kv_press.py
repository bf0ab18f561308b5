"""The shared KV-cache press interface (lightning_modules/common/kv_press.py): the cache contract, the baselines'
ranking semantics against planted ground truth, the small-budget edge cases, and every press config x wrapper config
(conf/model/press, conf/model/press_wrapper) on one tiny backbone. ManifoldKV's own tests: tests/test_manifoldkv.py."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from lightning_modules.common.kv_press import (AdaKV, Block, KeyDiff, KNorm, ScorerPress, SnapKV, StreamingLLM,
                                               prefill_and_answer)

CONF = Path(__file__).resolve().parents[1] / "conf" / "model"
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
    for press in (KNorm(0.0), AdaKV(press=KeyDiff(0.0)), Block(press=SnapKV(0.0))):
        cache = prefill(model, context, press)
        for a, b in zip(ref.layers, cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_question_appended_after_compression_decodes_at_the_right_positions(model, ids):
    context, question = ids
    # uncompressed: identical to greedy decoding of context + question as one sequence (positions continue at L)
    out = prefill_and_answer(model, KeyDiff(0.0), context, [question, question], max_new_tokens=5)
    expected = greedy_reference(model, torch.cat([context[0], question]), 5)
    assert out.answers == [expected, expected]  # the cache was restored between the two questions
    # compressed: the question runs on the shortened cache, one compressed context serves both questions
    out = prefill_and_answer(model, KeyDiff(0.5), context, [question, question[:3]], max_new_tokens=4,
                             gold=[question[:2], question[:2]])
    assert [len(a) for a in out.answers] == [4, 4]
    assert out.summary["kv_kept_fraction"] == pytest.approx(int(L_CTX * 0.5) / L_CTX)
    assert all(torch.isfinite(torch.tensor(x)) for x in out.answer_nll)


def score_of(press, keys):
    return press.score(SimpleNamespace(layer_idx=0), None, keys, keys, {})


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
    s = score_of(StreamingLLM(0.5, n_sink=4), torch.randn(1, 1, 20, 4))[0, 0]
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




def test_keydiff_and_knorm_match_their_formulas():
    keys = torch.randn(2, 3, 30, 8, generator=torch.Generator().manual_seed(5))
    unit = keys / keys.norm(dim=-1, keepdim=True)
    anchor = unit.mean(dim=-2, keepdim=True)
    cos = (unit * anchor).sum(-1) / anchor.norm(dim=-1)
    torch.testing.assert_close(score_of(KeyDiff(0.5), keys), -cos)
    torch.testing.assert_close(score_of(KNorm(0.5), keys), -keys.norm(dim=-1))


# --- small budgets (each a bug once) --------------------------------------------------------------------
def kept_positions(full_layer, layer):
    """Per head, the context positions a compressed cache layer kept (matched against the full cache)."""
    match = (layer.keys[0, :, :, None] == full_layer.keys[0, :, None]).all(-1)  # heads x kept x L
    return [sorted(match[h].float().argmax(-1).tolist()) for h in range(match.shape[0])]


def test_snapkv_always_keeps_its_window_even_when_the_budget_equals_it(model, ids):
    """SnapKV(0.75, window_size=8) on 32 tokens keeps exactly the 8 window tokens in every head: the window is padded
    strictly above every prefix score (padding with the max let the best prefix token tie and displace it)."""
    context = ids[0][:, :32]
    full, cache = prefill(model, context, KNorm(0.0)), prefill(model, context, SnapKV(0.75, window_size=8))
    for full_layer, layer in zip(full.layers, cache.layers):
        assert kept_positions(full_layer, layer) == [list(range(24, 32))] * 2
    # the scores themselves: the window strictly above every prefix token, its most recent tokens highest
    captured = {}
    attn = model.model.layers[0].self_attn
    h = attn.register_forward_hook(lambda m, a, kw, o: captured.update(kw=kw), with_kwargs=True)
    prefill(model, context, KNorm(0.0))
    h.remove()
    keys = full.layers[0].keys
    s = SnapKV(0.75, window_size=8).score(attn, captured["kw"]["hidden_states"], keys, keys, captured["kw"])
    assert (s[..., 24:].amin(-1) > s[..., :24].amax()).all() and (s[..., 24:].diff(dim=-1) > 0).all()
    kept = s.topk(4, dim=-1).indices.sort(dim=-1).values  # a budget below the window keeps its most recent tokens
    assert kept.tolist() == [[[28, 29, 30, 31]] * 2]


def test_tiny_context_keeps_one_token_and_a_question_is_never_compressed(model, ids):
    """KNorm(0.9) on 5 tokens keeps max(1, int(0.5)) = 1 per head; the question forward that follows (positions 5..)
    is appended, never taken for a prefill, even on a cache emptied by hand (the first position tells, not the size)."""
    context, question = ids[0][:, :5], ids[1][:3].view(1, -1)
    press = KNorm(0.9)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with press(model), torch.no_grad():
        model(input_ids=context, cache=cache, use_cache=True)
        assert [layer.keys.shape[-2] for layer in cache.layers] == [1, 1]
        model(input_ids=question, position_ids=torch.arange(5, 8)[None], cache=cache, use_cache=True)
        assert [layer.keys.shape[-2] for layer in cache.layers] == [4, 4]  # 1 kept + 3 question tokens, uncompressed
        for layer in cache.layers:  # an empty cache: still no prefill, the question starts at position 5
            layer.keys, layer.values = layer.keys[:, :, :0], layer.values[:, :, :0]
        model(input_ids=question, position_ids=torch.arange(5, 8)[None], cache=cache, use_cache=True)
        assert [layer.keys.shape[-2] for layer in cache.layers] == [3, 3]
    out = prefill_and_answer(model, KNorm(0.9), context, [question[0]], max_new_tokens=3, gold=[question[0, :2]])
    assert out.summary["kv_kept_fraction"] == pytest.approx(1 / 5) and len(out.answers[0]) == 3


def test_adakv_safeguard_keeps_at_least_one_token_per_head():
    """L=8, two heads, head 0 scaled x10: KNorm scores all of head 0 below head 1, and int(4 * 0.2) = 0 would leave
    head 0 empty ([0, 8]); the safeguard floor of 1 keeps head 0's lowest-norm key: [1, 7]."""
    keys = torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(0))
    keys[:, 0] *= 10
    module = SimpleNamespace(layer_idx=0)
    AdaKV(press=KNorm(0.5)).compress(module, None, keys, keys, {})
    kept = ~module.press_evicted[0]
    assert kept.sum(-1).tolist() == [1, 7]
    assert kept[0].nonzero().item() == int(keys[0, 0].norm(dim=-1).argmin())
    with pytest.raises(ValueError, match="alpha_safeguard"):
        AdaKV(press=KNorm(0.5), alpha_safeguard=1.5)


# --- every press and wrapper config -----------------------------------------------------------------------
PRESSES = sorted(p.stem for p in (CONF / "press").glob("*.yaml")  # the token scorers (RLKV's head_mixed: test_rlkv)
                 if "compression_ratio" in OmegaConf.load(p))
WRAPPERS = [None, *sorted(p.stem for p in (CONF / "press_wrapper").glob("*.yaml"))]


def press_from_configs(name: str, wrapper: str | None, ratio: float = 0.3):
    """The press the module gets for ``model/press=<name> model/press_wrapper=<wrapper>``, with small windows."""
    from hydra.utils import instantiate

    cfg = OmegaConf.load(CONF / "press" / f"{name}.yaml")
    cfg.compression_ratio = ratio
    if "window_size" in cfg:
        cfg.window_size = 8  # SnapKV's observation window, ManifoldKV's centroid window
    press = instantiate(cfg)
    if wrapper is None:
        return press
    wcfg = OmegaConf.load(CONF / "press_wrapper" / f"{wrapper}.yaml")
    if "block_size" in wcfg:
        wcfg.block_size = 16
    return instantiate(wcfg)(press=press)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", PRESSES)
def test_every_press_with_every_wrapper_runs_on_a_tiny_backbone(model, ids, name, wrapper):
    context, question = ids
    press = press_from_configs(name, wrapper)
    assert isinstance(press.press if wrapper else press, ScorerPress)
    out = prefill_and_answer(model, press, context, [question], max_new_tokens=3, gold=[question[:2]])
    assert len(out.answers[0]) == 3 and torch.isfinite(torch.tensor(out.answer_nll[0]))
    n_kept = int(L_CTX * 0.7)
    assert out.summary["kv_kept_fraction"] == pytest.approx(n_kept / L_CTX)
    assert set(out.summary["kept_per_head"]) == {0, 1}
    # spec() is the press as config data again: it instantiates back to an equal press
    from hydra.utils import instantiate

    spec = press.spec()
    assert spec["_target_"].endswith(type(press).__name__) and instantiate(spec) == press


def test_the_press_configs_cover_the_baselines_and_wrappers_need_a_scorer():
    assert {"keydiff", "knorm", "snapkv", "streaming", "random"} <= set(PRESSES)
    assert {"adakv", "block"} <= set(WRAPPERS[1:])
    with pytest.raises(ValueError, match="wraps a scorer press"):
        AdaKV(press=Block(press=KNorm(0.5)))
    with pytest.raises(ValueError, match="fraction removed"):
        KNorm(1.0)


TEXT = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256)
SLIDING = {  # model_type -> (config, layers a press compresses on a 40-token context)
    "gemma3_text": (dict(**TEXT, num_hidden_layers=6, sliding_window=16), [5]),  # window < context: global layer only
    "gemma3": (dict(mm_tokens_per_image=4, text_config=dict(**TEXT, num_hidden_layers=6, sliding_window=16),
                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=56, patch_size=14, vision_use_head=False)), [5]),  # as released
    "ministral": (dict(**TEXT, num_hidden_layers=4, sliding_window=64,
                       layer_types=["full_attention"] + ["sliding_attention"] * 3), [0, 1, 2, 3]),  # window > context
}


@pytest.mark.parametrize("model_type", sorted(SLIDING))
def test_sliding_window_models_compress_the_layers_that_hold_the_context(ids, model_type):
    """Gemma-3 (1024-token windows, here 16) and Ministral (32K windows, here 64) on a 40-token context."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config, compressed = SLIDING[model_type]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **config)
    sliding = AutoModelForCausalLM.from_config(cfg).eval()
    context, question = ids
    out = prefill_and_answer(sliding, KNorm(0.5), context, [question, question], max_new_tokens=3,
                             gold=[question[:2], question[:2]])
    assert sorted(out.summary["kept_per_head"]) == compressed and out.summary["kv_kept_fraction"] == 0.5
    assert out.answers[0] == out.answers[1] and out.answer_nll[0] == out.answer_nll[1]  # context restored each time
    # uncompressed, through the sliding layers: the answer NLL of one plain forward over context + question + answer
    full = prefill_and_answer(sliding, KNorm(0.0), context, [question], max_new_tokens=2, gold=[question[:2]])
    with torch.no_grad():
        logp = sliding(input_ids=torch.cat([context[0], question, question[:2]])[None]).logits[0].log_softmax(-1)
    reference = -logp[-3:-1].gather(-1, question[:2].view(-1, 1)).mean().item()
    assert full.answer_nll[0] == pytest.approx(reference, abs=1e-4)


# --- decoding-time token dropping (RLKV's baselines) ------------------------------------------------------------------
def test_h2o_keeps_the_recent_half_and_the_top_accumulated_attention_half(model, ids):
    """After a 40-token prefill at sparsity 0.6, window 4: budget int(40 x 0.4) + 4 = 20, so each head keeps its 10
    latest entries and the 10 others with the highest attention summed over the prompt's queries and the group's
    query heads (eager attention weights as the reference); decoding keeps the count at the growing budget."""
    from transformers import DynamicCache

    from lightning_modules.common.kv_press import H2O

    context, _ = ids
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        att = model(input_ids=context, output_attentions=True).attentions
    model.config._attn_implementation = "sdpa"
    press = H2O(sparsity=0.6, window=4)
    cache = DynamicCache(config=model.config)
    with press(model), torch.no_grad():
        model(input_ids=context, cache=cache, use_cache=True)
        from lightning_modules.common.kv_press import attention_layers

        layers = attention_layers(model)
        for layer, a in zip(layers, att):
            score = a[0].sum(1).view(2, 2, L_CTX).sum(1)  # (kv heads, keys)
            for h in range(2):
                kept = (~layer.press_evicted[0, h]).nonzero().flatten().tolist()
                top = score[h, :L_CTX - 10].topk(10).indices.tolist()
                assert kept == sorted(top + list(range(L_CTX - 10, L_CTX)))
        assert press.summary()["kv_kept_fraction"] == pytest.approx(20 / L_CTX)
        tok, expected = torch.tensor([[5]]), 20
        for t in range(1, 9):  # one more entry each step; over the budget, back to 2 x int(budget / 2)
            model(input_ids=tok, cache=cache, use_cache=True, position_ids=torch.tensor([[L_CTX + t - 1]]))
            budget = int((L_CTX + t) * 0.4) + 4
            expected = expected + 1 if expected + 1 <= budget else 2 * (budget // 2)
            assert (~layers[0].press_evicted[0]).sum(-1).tolist() == [expected] * 2


def test_rkv_evicts_a_buffer_of_the_latest_window_by_importance_and_redundancy(model, ids):
    """R-KV with a 12-entry window, 4-entry buffer, 2 cached queries: a 40-token prefill over its budget evicts exactly
    4 entries per head among the latest 12 but the last 2; older entries stay; at or under the window nothing goes.
    Redundancy by hand on three equal keys and one orthogonal: each key's last > 0.5-similar partner is ignored."""
    from transformers import DynamicCache

    from lightning_modules.common.kv_press import RKV, attention_layers

    context, _ = ids
    press = RKV(sparsity=0.5, window=6, obs_window=2, fixed_size=12, buffer=4, kernel=3)
    cache = DynamicCache(config=model.config)
    with press(model), torch.no_grad():
        model(input_ids=context, cache=cache, use_cache=True)
        for layer in attention_layers(model):
            ev = layer.press_evicted[0]
            assert ev.sum(-1).tolist() == [4, 4]
            assert not ev[:, :L_CTX - 12].any() and not ev[:, L_CTX - 2:].any()
    small = RKV(sparsity=0.5, window=6, obs_window=2, fixed_size=64, buffer=4)
    with small(model), torch.no_grad():
        model(input_ids=context, cache=DynamicCache(config=model.config), use_cache=True)
        assert all(not layer.press_evicted.any() for layer in attention_layers(model))  # 40 entries <= 64
    keys = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])
    # rows after zeroing: [0,1,0,0], [1,0,0,0], [1,0,0,0], [0,0,0,0] -> column means [.5, .25, 0, 0] -> softmax
    torch.testing.assert_close(RKV.redundancy(keys)[0], torch.tensor([0.5, 0.25, 0.0, 0.0]).softmax(-1))
    with pytest.raises(ValueError, match="sparsity"):
        RKV(sparsity=1.0)


def _dense_h2o_scores(query, key, attention_mask, evicted, scaling):
    """The (n x K) formula the chunked scores replace: causal & padding & not evicted, softmax, summed over real
    queries and the group's query heads."""
    B, Hq, n, _ = query.shape
    H, K = key.shape[1], key.shape[-2]
    allowed = torch.ones(n, K, dtype=torch.bool).tril(K - n)[None, None] & (attention_mask[..., -n:, -K:] == 0)
    real_q = allowed[:, 0].diagonal(K - n, dim1=-2, dim2=-1)
    see = allowed & ~evicted.repeat_interleave(Hq // H, 1)[:, :, None]
    logits = query @ key.repeat_interleave(Hq // H, 1).transpose(-1, -2) * scaling
    probs = logits.masked_fill(~see, float("-inf")).softmax(-1).nan_to_num(0.0) * real_q[:, None, :, None]
    return probs.sum(2).view(B, H, -1, K).sum(2), real_q


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_h2o_attention_scores_by_query_chunks_equal_the_dense_scores(monkeypatch, chunk):
    """A left-padded batch (additive float mask), GQA, some entries already evicted, an odd n that a chunk does not
    divide, a forward of 7 new queries over 11 cached entries: the chunked scores equal the dense formula's."""
    from lightning_modules.common import kv_press

    monkeypatch.setattr(kv_press, "QUERY_CHUNK", chunk)
    g = torch.Generator().manual_seed(3)
    B, Hq, H, n, K, d = 2, 4, 2, 7, 11, 8
    query, key = torch.randn(B, Hq, n, d, generator=g), torch.randn(B, H, K, d, generator=g)
    pad = torch.tensor([[False] * K, [True] * 3 + [False] * (K - 3)])  # row 1: three left-pad entries
    mask = torch.zeros(B, 1, n, K).masked_fill(pad[:, None, None], float("-inf"))
    evicted = torch.rand(B, H, K, generator=g) < 0.2
    real_q, _ = kv_press._visibility(mask, n, K, B, "cpu")
    got = kv_press.attention_received(SimpleNamespace(scaling=0.3), query, key, mask, evicted, real_q)
    want, want_real = _dense_h2o_scores(query, key, mask, evicted, 0.3)
    assert torch.equal(real_q, want_real)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("press", ["h2o", "rkv"])
def test_a_decoding_drop_prefill_builds_no_n_by_n_tensor(model, monkeypatch, press):
    """H2O's and R-KV's prefill over n = 200 tokens: no tensor the forward makes holds n x n elements (the old H2O
    path made Hq x n x n scores and an n x n mask) — recorded op by op with a dispatch mode — and the evictions still
    bring each head to the budget."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache

    from lightning_modules.common import kv_press

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.largest = max(Largest.largest, t.numel())
            return out

    monkeypatch.setattr(kv_press, "QUERY_CHUNK", 16)
    n = 200
    context = torch.randint(2, 97, (1, n), generator=torch.Generator().manual_seed(4))
    p = kv_press.H2O(sparsity=0.5, window=4) if press == "h2o" else \
        kv_press.RKV(sparsity=0.5, window=12, obs_window=2, fixed_size=64, buffer=16)
    with p(model), torch.no_grad(), Largest():
        model(input_ids=context, cache=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    assert 0 < Largest.largest < n * n
    kept = p.summary()["kept_per_head"][0]
    assert kept == ([2 * ((n // 2 + 4) // 2)] * 2 if press == "h2o" else [n - 16] * 2)
