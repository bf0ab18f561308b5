"""RLKV (arXiv 2510.08525): the gated mixed-attention core (prefill and decode), the reward-gated L1 penalty, the
RL probe's hooks, the global head allocation, the head-wise full/constant KV cache press and the tiny run."""
import math

import pytest
import torch

from lightning_modules.common.attention import unpatch_attention
from lightning_modules.rlkv.mixed_attention import MixedAttention, allowed_keys, streaming_keys

SINK, RECENT = 2, 5


def tiny_llama(dtype=torch.float64, layers=2, kv_heads=2, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128,
                      attn_implementation="sdpa", pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def gated(model, alpha, **kw):
    mixed = MixedAttention.for_model(model, sink=kw.pop("sink", SINK), recent=kw.pop("recent", RECENT), **kw)
    with torch.no_grad():
        mixed.gates.fill_(alpha) if not torch.is_tensor(alpha) else mixed.gates.copy_(alpha)
    mixed.to(next(model.parameters()).dtype)
    mixed.install(model)
    return mixed


def reference_attention(q, k, v, keep, scale):
    """Plain fp64 masked softmax attention over query/key ranks; keep(r_q, r_k) -> bool."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    N = q.shape[2]
    mask = torch.tensor([[j <= i and keep(i, j) for j in range(N)] for i in range(N)])
    w = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
    return (w @ v).transpose(1, 2)


def random_qkv(N=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, N, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, N, 8, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, N, 8, generator=g, dtype=torch.float64)
    return q, k, v


class _Attn:
    scaling, layer_idx = 8 ** -0.5, 0


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_core_is_the_alpha_mix_of_full_and_sink_recent_softmax_fp64(alpha):
    q, k, v = random_qkv()
    mixed = MixedAttention(1, 2, sink=SINK, recent=RECENT).double()
    with torch.no_grad():
        mixed.gates.fill_(alpha)
    out = mixed.core(_Attn, None, q, k, v, None)
    full = reference_attention(q, k, v, lambda i, j: True, _Attn.scaling)
    stream = reference_attention(q, k, v, lambda i, j: j < SINK or i - j < RECENT, _Attn.scaling)
    torch.testing.assert_close(out, alpha * full + (1 - alpha) * stream, rtol=0, atol=1e-12)
    # within sink + recent every gate gives the same output (both softmaxes see every key)
    torch.testing.assert_close(full[:, :SINK + RECENT], stream[:, :SINK + RECENT], rtol=0, atol=1e-12)


def test_block_window_counts_in_blocks():
    allowed = allowed_keys(None, 12, 12, "cpu")
    s = streaming_keys(allowed, sink=2, recent=4, window="block", block=2)[0, 0]
    # query 9 is in block 4: sink block 0 and blocks 3, 4 (its own, causal)
    assert s[9].nonzero().flatten().tolist() == [0, 1, 6, 7, 8, 9]
    assert s[3, :4].all() and not s[3, 4:].any()  # early queries see their whole causal past


def test_gates_one_reproduce_standard_attention_at_prefill_and_decode_greedy():
    model = tiny_llama()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 61, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    ids[1, :3] = 0
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        ref_logits = model(input_ids=ids, attention_mask=mask).logits
        ref = model.generate(input_ids=ids, attention_mask=mask, **kw)
        gated(model, 1.0)
        logits = model(input_ids=ids, attention_mask=mask).logits
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    torch.testing.assert_close(logits[mask.bool()], ref_logits[mask.bool()], rtol=0, atol=1e-10)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("window", ["token", "block"])
def test_decode_core_equals_prefill_output_and_left_padding_equals_unpadded(window):
    model = tiny_llama()
    alpha = torch.tensor([[0.0, 0.6], [0.2, 1.0]], dtype=torch.float64)
    gated(model, alpha, window=window, block=2, sink=2, recent=4)
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(2, 61, (1, 14), generator=g)
    with torch.no_grad():
        full = model(input_ids=seq).logits[0]
        # decode: prefill 8 tokens, then one token at a time through the cache
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        steps = [model(input_ids=seq[:, :8], cache=cache, use_cache=True).logits[0, -1]]
        for t in range(8, 14):
            steps.append(model(input_ids=seq[:, t:t + 1], cache=cache, use_cache=True,
                               position_ids=torch.tensor([[t]])).logits[0, -1])
        torch.testing.assert_close(torch.stack(steps), full[7:], rtol=0, atol=1e-10)
        # a left-padded row equals its unpadded twin
        padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), seq], 1)
        mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(seq)], 1)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        twin = model(input_ids=padded, attention_mask=mask, position_ids=pos).logits[0, 4:]
        torch.testing.assert_close(twin, full, rtol=0, atol=1e-10)
    # the stream part matters here: the all-ones model differs
    unpatch_attention(model)
    with torch.no_grad():
        assert (model(input_ids=seq).logits[0] - full).abs().max() > 1e-4


def test_bad_window_and_backbone_fail_with_one_line():
    with pytest.raises(ValueError, match="empty window"):
        MixedAttention(2, 2, sink=4, recent=0)
    with pytest.raises(ValueError, match="token or block"):
        MixedAttention(2, 2, window="tile")
    with pytest.raises(ValueError, match="q_proj/k_proj/v_proj/o_proj"):
        MixedAttention.for_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    from lightning_modules.rlkv.mixed_attention import check_backbone

    gpt2 = {"family": "gpt2", "config": {"vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 2}}
    with pytest.raises(ValueError, match="backbone.family=gpt2.*choose such a backbone"):
        check_backbone(gpt2)  # on the meta device: nothing is loaded
    check_backbone({"family": "llama", "config": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                                  "num_hidden_layers": 1, "num_attention_heads": 2}})


# --- allocation and the head-wise press -------------------------------------------------------------------------
from lightning_modules.rlkv.press import HeadMixedPress, allocate  # noqa: E402


@pytest.mark.parametrize("s", [0.0, 0.2, 0.25, 0.5, 0.6, 1.0])
def test_allocation_compresses_exactly_round_s_LH_heads_globally(s):
    g = torch.Generator().manual_seed(0)
    gates = torch.rand(4, 6, generator=g)
    stream = allocate(gates, s, "round")
    k = round(s * 24)
    assert int(stream.sum()) == k
    if 0 < k < 24:
        assert gates[stream].max() < gates[~stream].min()
    # gates low in one layer: every pick lands there (global, not per layer)
    low = gates.clone()
    low[2] = low[2] * 0.01
    assert allocate(low, 0.25)[2].all() and int(allocate(low, 0.25).sum()) == 6


def greedy_decode(model, press, ids, mask, steps, on_step=None):
    """Prefill ``ids`` under ``press`` then decode greedily one token at a time; returns tokens and step logits."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    toks, logits = [], []
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with press(model) if press is not None else torch.no_grad(), torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits[:, -1]
        for _ in range(steps):
            logits.append(out)
            tok = out.argmax(-1, keepdim=True)
            toks.append(tok)
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            pos = pos[:, -1:] + 1
            out = model(input_ids=tok, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).logits[:, -1]
            if on_step is not None:
                on_step(cache)
    return torch.cat(toks, 1), torch.stack(logits, 1)


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 61, (2, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5], ids[1, :5] = 0, 0  # a left-padded row
    return ids, mask


GATES = [[0.9, 0.1], [0.3, 0.8]]


@pytest.mark.parametrize("storage", ["masked", "split"])
def test_streaming_heads_hold_sink_plus_recent_full_heads_grow_by_one(prompt, storage):
    model = tiny_llama(torch.float32)
    press = HeadMixedPress(gates=GATES, sparsity=0.5, sink=2, recent=4, storage=storage)
    ids, mask = prompt
    seen = []
    greedy_decode(model, press, ids, mask, 6, on_step=lambda c: seen.append(HeadMixedPress.kv_entries(model, c)))
    stream = allocate(torch.tensor(GATES), 0.5)
    for t, entries in enumerate(seen, start=1):
        for layer, n in enumerate(entries):
            assert n[stream[layer]].eq(6).all(), (t, layer, n)
            assert n[~stream[layer]].eq(20 + t).all(), (t, layer, n)


def test_split_equals_masked_and_s0_equals_no_press(prompt):
    model = tiny_llama(torch.float32)
    ids, mask = prompt
    ref_toks, ref_logits = greedy_decode(model, None, ids, mask, 10)
    toks0, _ = greedy_decode(model, HeadMixedPress(gates=GATES, sparsity=0.0, sink=2, recent=4), ids, mask, 10)
    assert torch.equal(toks0, ref_toks)
    m_toks, m_logits = greedy_decode(model, HeadMixedPress(gates=GATES, sparsity=0.75, sink=2, recent=4), ids, mask, 10)
    s_toks, s_logits = greedy_decode(model, HeadMixedPress(gates=GATES, sparsity=0.75, sink=2, recent=4,
                                                           storage="split"), ids, mask, 10)
    assert torch.equal(m_toks, s_toks)
    torch.testing.assert_close(s_logits, m_logits, rtol=0, atol=1e-5)
    assert (m_logits - ref_logits).abs().max() > 1e-3  # the window changes what streaming heads see


def test_all_streaming_decoding_equals_a_physically_truncated_cache(prompt):
    """Planted reference: every head streams -> the same as cutting each layer's cache to sink + recent by hand."""
    from transformers import DynamicCache

    model = tiny_llama(torch.float64)
    ids = prompt[0][:1]
    mask = torch.ones_like(ids)
    toks, logits = greedy_decode(model, HeadMixedPress(sparsity=0.0, sink=2, recent=4, source="all_streaming"),
                                 ids, mask, 5)
    cache = DynamicCache(config=model.config)
    ref = []
    with torch.no_grad():
        out = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        for t in range(5):
            ref.append(out)
            for layer in cache.layers:  # keep sink + recent, then attend with the new token
                keep = list(range(2)) + list(range(layer.keys.shape[-2] - 4, layer.keys.shape[-2]))
                layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
            out = model(input_ids=toks[:, t:t + 1], cache=cache, use_cache=True,
                        position_ids=torch.tensor([[20 + t]])).logits[:, -1]
    torch.testing.assert_close(logits, torch.stack(ref, 1), rtol=0, atol=1e-10)


def test_press_bad_input():
    with pytest.raises(ValueError, match="needs gates"):
        HeadMixedPress(sparsity=0.5)
    with pytest.raises(ValueError, match="sparsity"):
        HeadMixedPress(gates=GATES, sparsity=1.5)
    with pytest.raises(ValueError, match="empty window"):
        HeadMixedPress(gates=GATES, recent=0)


# --- the probe: penalty, hooks, clamp, tiny run ---------------------------------------------------------------
from lightning_modules.rlkv.module import RLKVModule  # noqa: E402
from lightning_modules.rlkv.penalty import sparsity_penalty  # noqa: E402


@pytest.mark.parametrize("r_bar", [0.0, 0.3, 0.5, 0.75, 1.0])
def test_penalty_value_and_gradient(r_bar):
    lam, tau = 2.5e-3, 0.5
    gates = torch.tensor([[0.2, 0.9, 0.0], [0.5, 1.0, 0.7]], requires_grad=True)
    p = sparsity_penalty(gates, r_bar, lam, tau)
    p.backward()
    if r_bar <= tau:
        assert float(p) == 0.0 and torch.count_nonzero(gates.grad) == 0
    else:
        w = lam * (math.exp(r_bar) - 1)
        assert float(p) == pytest.approx(w * float(gates.abs().mean()), rel=1e-6)
        torch.testing.assert_close(gates.grad, w * torch.sign(gates.detach()) / gates.numel())


def test_batch_advantage_normalisation_is_token_weighted():
    from lightning_modules.common.rl.advantages import batch_normalize, grpo_advantages

    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    lengths = torch.tensor([3, 5, 2, 7, 1, 4, 6, 2])
    a = batch_normalize(grpo_advantages(r, 4), lengths, eps=0.0)
    w = lengths.float() / lengths.sum()
    n = float(lengths.sum())
    assert float((w * a).sum()) == pytest.approx(0.0, abs=1e-6)
    assert float((w * a ** 2).sum()) == pytest.approx((n - 1) / n, rel=1e-5)  # AReaL's unbiased token std
    a_pop = batch_normalize(grpo_advantages(r, 4), lengths, eps=0.0, unbiased=False)
    assert float((w * a_pop ** 2).sum()) == pytest.approx(1.0, rel=1e-5)


def test_gates_stay_in_unit_interval_after_a_step_at_lr_100(monkeypatch):
    from lightning_modules.common.rl import module as rl_module
    from lightning_modules.rlkv.mixed_attention import MixedAttention as MA

    m = RLKVModule(backbone={"family": "llama"}, reg_scale=1.0, tau=0.0, penalty_scope="batch")
    m.mixed = MA(2, 2)
    opt = torch.optim.SGD(m.mixed.parameters(), lr=100.0)

    def plain_step(self):  # the core's step without a trainer: one optimizer step on the current gradient
        opt.step()
        opt.zero_grad()
        return 0.0

    monkeypatch.setattr(rl_module.RLModule, "_step", plain_step)
    m._raw = torch.ones(4)
    m.regularizer(None, torch.arange(4)).backward()  # the penalty alone pushes every gate down by lr * grad >> 1
    m._step()
    assert float(m.mixed.gates.min()) == 0.0 and float(m.mixed.gates.max()) <= 1.0
    (-m.mixed.gates.sum()).backward()  # and up
    m._step()
    assert float(m.mixed.gates.min()) == 1.0


def test_probe_bad_input_fails_before_loading():
    with pytest.raises(ValueError, match="tau"):
        RLKVModule(backbone={"family": "llama"}, tau=1.5)
    with pytest.raises(ValueError, match="empty window"):
        RLKVModule(backbone={"family": "llama"}, recent=0)


def test_rlkv_tiny_smoke(tmp_path, tiny_lm_dir):
    """The tiny probe end to end (smoke: 20 steps; data.n_val=16, model.self_filter=16 and SMOKE_WARMUP shrink
    evaluation, the self-filter and the cached warm-up, which debug=smoke does not): rollouts from the gated model,
    the penalty on, gates moved."""
    from tests.helpers import SMOKE_WARMUP, run_experiment

    value, metrics = run_experiment("rlkv_tiny", tmp_path, overrides=("debug=smoke", "data.n_val=16",
                                                                      "model.self_filter=16", *SMOKE_WARMUP))
    assert metrics["status"] == "ok" and metrics["global_step"] == 20
    final, results = metrics["final"], metrics["results"]
    assert math.isfinite(final["train/loss"]) and final["train/reg"] >= 0
    gates = torch.tensor(results["gates"])
    assert gates.shape == (4, 2) and 0 <= float(gates.min()) and float(gates.max()) <= 1
    assert float(gates.min()) < 0.99  # gates moved
    assert 0 < results["self_filter"]["kept"] <= 16


def test_duo_distillation_is_zero_at_gates_one_and_positive_below():
    from lightning_modules.rlkv.duo import DuoAttentionModule

    m = DuoAttentionModule(backbone={"family": "llama"}, sink=2, recent=4)
    m.model = m.install_gates(tiny_llama(), m.window)
    m.mixed.double()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 61, (2, 24), generator=g)
    sup = torch.zeros_like(ids, dtype=torch.bool)
    sup[:, -5:] = True
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "supervise": sup}
    assert float(m.distill_loss(batch)) < 1e-20
    with torch.no_grad():
        m.mixed.gates.zero_()
    loss = m.distill_loss(batch)
    loss.backward()
    assert float(loss) > 1e-8 and m.mixed.gates.grad.abs().sum() > 0
    assert all(not p.requires_grad for p in m.model.parameters())


def test_duoattn_tiny_smoke(tmp_path, tiny_lm_dir):
    """debug=smoke (20 steps); data.n_train/n_val shrink the generated passkey sets, which smoke does not."""
    from tests.helpers import run_experiment

    value, metrics = run_experiment("duoattn_tiny", tmp_path, overrides=("debug=smoke", "data.n_train=80",
                                                                         "data.n_val=4"))
    gates = torch.tensor(metrics["results"]["gates"])
    assert metrics["status"] == "ok" and gates.shape == (4, 2)
    assert 0 <= float(gates.min()) < 0.99 and float(gates.max()) <= 1 and math.isfinite(value)


def test_press_generate_is_greedy_generate_and_counts_the_kept_cache(prompt):
    """The benchmark's decoder: no press = transformers' greedy generate (left padding included); every head
    streaming keeps (sink + recent) / cache length of the entries."""
    from lightning_modules.rlkv.evaluation import press_generate

    model = tiny_llama(torch.float64)
    ids, mask = prompt
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                             eos_token_id=None)[:, ids.shape[1]:]
    out = press_generate(model, None, prompts, 6, eos_id=None, pad_id=0)
    assert torch.equal(out["tokens"], ref) and out["kv_kept_fraction"] == 1.0
    one = press_generate(model, HeadMixedPress(source="all_streaming", sink=2, recent=4), prompts[:1], 6, None, 0)
    assert one["kv_kept_fraction"] == pytest.approx(6 / (20 + 5))  # 20 prompt + 5 fed tokens in the cache
    forced = press_generate(model, None, prompts, 6, None, 0, targets=ref)
    assert torch.equal(forced["tokens"], ref) and forced["nll"] > 0


def test_masks_in_every_form_give_the_same_keys():
    """bool (sdpa), additive (eager) and 2-D padding (flash) masks of one left-padded batch agree."""
    pad = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    as_bool = pad[:, None, None, :].bool() & causal
    additive = torch.zeros(as_bool.shape).masked_fill(~as_bool, torch.finfo(torch.float32).min)
    ref = allowed_keys(as_bool, 6, 6, "cpu")
    assert torch.equal(allowed_keys(additive, 6, 6, "cpu"), ref) and torch.equal(allowed_keys(pad, 6, 6, "cpu"), ref)
    # padding queries see only themselves; real ones their real causal past
    assert ref[0, 0, 0].nonzero().flatten().tolist() == [0] and ref[0, 0, 4].nonzero().flatten().tolist() == [2, 3, 4]


# --- the release's recipe (issue 38) -----------------------------------------------------------------------------
def planted_rollouts(rewards, lengths, group_size, prompt_len=2):
    """Rollouts with the given rewards and response lengths (token ids are irrelevant to advantages)."""
    from lightning_modules.common.rl.rollouts import Rollouts

    lengths = torch.as_tensor(lengths)
    T = int(lengths.max())
    rmask = (torch.arange(T)[None] < lengths[:, None]).float()
    N = len(lengths)
    ids = torch.full((N, prompt_len + T), 5, dtype=torch.long)
    am = torch.cat([torch.ones(N, prompt_len, dtype=torch.long), rmask.long()], 1)
    ro = Rollouts(ids, am, prompt_len, rmask, group_size, ["x"] * N)
    ro.rewards = torch.as_tensor(rewards, dtype=torch.float32)
    return ro


def recipe_module(monkeypatch, ro, *overrides):
    """The paper-scale probe's model config (rlkv_r1_llama8b), its rollout step fed the planted rollouts."""
    from types import SimpleNamespace

    from hydra.utils import instantiate

    from lightning_modules.common.rl import module as core
    from runner import compose

    module = instantiate(compose("rlkv_r1_llama8b", list(overrides)).model)
    monkeypatch.setattr(core, "generate_rollouts", lambda *a, **k: planted_rollouts(ro.rewards, ro.lengths, 4))
    module.get_tokenizer = lambda: SimpleNamespace(eos_token_id=1, pad_token_id=0)
    monkeypatch.setattr(type(module), "score", lambda self, r, batch: ro.rewards.clone())
    return module


def test_advantages_are_the_reward_normalised_over_the_batch_only_as_the_recipe(monkeypatch):
    """32 prompts x G 4 at accuracy 0.70: the recipe (AReaL adv_norm at batch level, no reward_norm) gives every token
    (r - mean) / (unbiased token std + 1e-5); an all-correct group is pushed up, not to ~0 as group normalisation
    does. ``model.advantage=grpo`` keeps group-then-batch as a switch."""
    import numpy as np

    per_group = [4] * 12 + [3] * 10 + [2] * 6 + [0] * 4
    r = [float(i < c) for c in per_group for i in range(4)]
    lengths = [10 + (i % 7) for i in range(128)]
    ro = planted_rollouts(r, lengths, 4)
    batch = {"prompt_ids": [[5, 5]] * 32, "prompt": ["q"] * 32, "answer": ["1"] * 32}
    got = recipe_module(monkeypatch, ro).rollout(batch).advantages
    tok = np.repeat(np.array(r), lengths)  # one value per response token, as AReaL normalises
    ref = (np.array(r) - tok.mean()) / (tok.std(ddof=1) + 1e-5)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)
    assert float(got[:48].min()) > 0.6  # all-correct groups: +0.65 per token

    grouped = recipe_module(monkeypatch, ro, "model.advantage=grpo").rollout(batch).advantages
    assert float(grouped[:48].abs().max()) < 0.05  # group then batch: an all-correct group gets ~0
    flipped = float(((got > 0) != (grouped > 0)).float().mean())
    assert flipped > 0.1  # a sizeable share of the rollouts change sign between the two


def test_ffd_micro_batches_follow_areals_first_fit_decreasing():
    from lightning_modules.rlkv.penalty import ffd_micro_batches

    # 5000 opens; 4000 fits nowhere; 3000 joins 4000; 2000 joins 5000; 1000 fits nowhere (both at 7000)
    assert sorted(ffd_micro_batches([5000, 4000, 3000, 2000, 1000], 7680)) == [[0, 3], [1, 2], [4]]
    # equal lengths pair up in index order; min_groups opens that many first
    assert ffd_micro_batches([3000] * 6, 7680) == [[0, 1], [2, 3], [4, 5]]
    assert len(ffd_micro_batches([100] * 6, 7680, min_groups=3)) == 3
    assert ffd_micro_batches([9000, 10], 7680) == [[0], [1]]  # over capacity: alone


@pytest.mark.parametrize("scope", ["microbatch", "batch"])
def test_penalty_per_micro_batch_weighted_by_token_share_stays_on_below_tau(scope):
    """Planted: 10 rollouts of 100 prompt + 2900 response tokens, two per 7,680-token micro-batch, rewards
    (1,1)(1,0)(0,0)(0,0)(0,0) (accuracy 0.3 < τ 0.5). The release's form: only the all-correct micro-batch is above τ
    and weighs 2/10 of the tokens, so the multiplier is 0.2 (e − 1); one batch mean switches the penalty off."""
    from lightning_modules.rlkv.mixed_attention import MixedAttention as MA

    raw = torch.tensor([1.0, 1, 1, 0, 0, 0, 0, 0, 0, 0])
    ro = planted_rollouts(raw, [2900] * 10, 2, prompt_len=100)
    m = RLKVModule(backbone={"family": "llama"}, reg_scale=1e-3, tau=0.5, penalty_scope=scope)
    m.mixed = MA(2, 2)
    with torch.no_grad():
        m.mixed.gates.copy_(torch.tensor([[0.2, 0.9], [0.5, 1.0]]))
    m._raw = raw
    pen = m.regularizer(ro, torch.arange(10))
    expected = 1e-3 * 0.2 * (math.e - 1) * 0.65 if scope == "microbatch" else 0.0
    assert float(pen) == pytest.approx(expected, rel=1e-6, abs=1e-12)
    # the token share, not the row count, weighs a micro-batch: rows 0-2 (all correct, 3000 + 3000 + 1100 tokens)
    # pack into one, the other seven (1100 each, all wrong) into two more
    ro_long = planted_rollouts(raw, [2900, 2900] + [1000] * 8, 2, prompt_len=100)
    m.penalty_scope = "microbatch"
    w = float(m.regularizer(ro_long, torch.arange(10))) / (1e-3 * 0.65)
    assert w == pytest.approx(6800 / 13800 * (math.e - 1), rel=1e-6)


def test_top_k_reaches_the_sampler_and_each_recipe_samples_as_released():
    """top_k=1 sampling is greedy whatever the temperature (the core passes top_k to generate); the Qwen3 probe samples
    at T 0.6 / top-p 0.95 / top-k 20 (qwen3_grpo.yaml), the R1-distilled ones at T 1 (deepseek_grpo.yaml); AdamW weight
    decay 0.017 in both recipes, on the gates (2-D, so in the decayed group)."""
    from hydra.utils import instantiate

    from lightning_modules.common.rl.rollouts import generate_rollouts
    from runner import compose

    model = tiny_llama(torch.float32)
    torch.manual_seed(0)
    sampled = generate_rollouts(model, [[5, 6, 7]], 4, 6, None, 0, temperature=1.5, top_k=1)
    greedy = generate_rollouts(model, [[5, 6, 7]], 1, 6, None, 0, temperature=0.0)
    assert all(torch.equal(row, greedy.input_ids[0]) for row in sampled.input_ids)
    qwen3, llama = (instantiate(compose(e).model) for e in ("rlkv_qwen3_4b_thinking", "rlkv_r1_llama8b"))
    assert (qwen3.temperature, qwen3.top_p, qwen3.top_k) == (0.6, 0.95, 20)
    assert (llama.temperature, llama.top_p, llama.top_k) == (1.0, 1.0, 0)
    for m in (qwen3, llama):
        m.mixed = MixedAttention(2, 2)
        decayed = next(g for g in m.param_groups() if any(p is m.mixed.gates for p in g["params"]))
        assert decayed["weight_decay"] == pytest.approx(0.017)


def test_press_generate_follows_the_release_protocol(prompt):
    """RLKV's eval/bench/pred.py: each row generates up to max_length - its prompt length; the last prompt tokens are
    decoded one at a time (exact without a press, through the window with one); degenerate repetition stops a row."""
    from lightning_modules.rlkv.evaluation import press_generate

    model = tiny_llama(torch.float64)
    ids, mask = prompt
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]  # 20 and 15 tokens
    out = press_generate(model, None, prompts, 100, eos_id=None, pad_id=0, max_length=24)
    assert out["tokens"].shape == (2, 9)
    for p, row, n in zip(prompts, out["tokens"], (4, 9)):
        with torch.no_grad():
            ref = model.generate(input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                                 eos_token_id=None)[0, len(p):]
        assert torch.equal(row[:n], ref) and not row[n:].any()  # then padding
    sim = press_generate(model, None, prompts, 6, None, 0, decode_simulation=50)  # capped at the shortest - 1
    assert torch.equal(sim["tokens"], press_generate(model, None, prompts, 6, None, 0)["tokens"])
    press = HeadMixedPress(source="all_streaming", sink=2, recent=4)
    with_sim = press_generate(model, press, prompts[:1], 6, None, 0, decode_simulation=10, targets=out["tokens"][:1])
    without = press_generate(model, press, prompts[:1], 6, None, 0, targets=out["tokens"][:1])
    assert with_sim["nll"] != pytest.approx(without["nll"], rel=1e-6)  # the tail saw the window, not the whole prompt
    assert with_sim["kv_kept_fraction"] == pytest.approx(without["kv_kept_fraction"])

    class Constant(torch.nn.Module):  # a head that always predicts token 7: endless repetition
        def forward(self, h):
            out = torch.zeros(*h.shape[:-1], 61, dtype=h.dtype)
            out[..., 7] = 1.0
            return out

    model.lm_head = Constant()
    rep = press_generate(model, None, prompts, 100, None, 0, repeat_window=20)
    assert [len(c) for c in rep["completions"]] == [40, 40]  # first checked at 40 (past one window): 1 distinct < 2
    assert [len(c) for c in press_generate(model, None, prompts, 30, None, 0)["completions"]] == [30, 30]
    assert press_generate(model, None, prompts, 30, [3, 7], 0)["completions"] == [[], []]  # any EOS of a list stops


def test_allocation_counts_heads_below_the_release_quantile_and_reads_released_gate_files(tmp_path):
    """sparsify_attention_heads: heads strictly below numpy's s-quantile stream (= ceil(s (n - 1)) for distinct gates,
    one fewer than round(s n) at e.g. s = 0.6 of 256); ties by (layer, head) order; released adapter_weights.tsv
    files (gates outside [0, 1], their training clamps before the forward) are read and clipped."""
    import numpy as np

    g = torch.rand(32, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for s in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        stream = allocate(g, s)
        assert int(stream.sum()) == int((g.numpy() < np.quantile(g.numpy(), s)).sum())
        assert g[stream].max() < g[~stream].min()
    assert int(allocate(g, 0.6).sum()) == 153 and int(allocate(g, 0.6, "round").sum()) == 154
    tied = torch.tensor([[0.5, 0.2], [0.5, 0.5]])
    assert allocate(tied, 0.5).tolist() == [[True, True], [False, False]]  # 2 of 4: the 0.2 and the first 0.5
    path = tmp_path / "adapter_weights.tsv"
    path.write_text("1.2\t-0.1\n0.4\t0.7\n")
    press = HeadMixedPress(gates=str(path), sparsity=0.5)
    assert press.allocation(2, 2).tolist() == [[False, True], [True, False]]
    from lightning_modules.rlkv.press import load_gates

    assert load_gates(str(path)).tolist() == [[1.0, 0.0], [0.4, 0.7]]
    with pytest.raises(ValueError, match="head_count"):
        HeadMixedPress(gates=GATES, head_count="floor")


def test_rollout_chunks_bound_the_generate_batch_and_the_paper_probes_fit_their_gpus():
    """rollout_chunk: generate sees at most chunk sequences per call (chunk // G prompts), greedy output unchanged;
    the paper probes (16 prompts x G 4 per GPU, 1,024 + 7,168 tokens) hold bf16 weights + the KV cache of one chunk
    in an 80 GB A100 with room to spare, where one call for all 64 sequences would not for R1-Llama-8B / Qwen3-4B."""
    from lightning_modules.common.backbone import build_backbone, count_parameters
    from lightning_modules.common.rl.rollouts import generate_rollouts
    from runner import compose

    model = tiny_llama(torch.float32)
    calls = []
    generate = model.generate
    model.generate = lambda **kw: calls.append(kw["input_ids"].shape[0] * kw["num_return_sequences"]) or generate(**kw)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16]]
    whole = generate_rollouts(model, prompts, 3, 5, None, 0, temperature=0.0)
    calls.clear()
    chunked = generate_rollouts(model, prompts, 3, 5, None, 0, temperature=0.0, chunk=6)
    assert calls == [2, 2, 1] and torch.equal(chunked.input_ids, whole.input_ids)  # greedy: one sequence per prompt
    torch.manual_seed(0)
    calls.clear()
    sampled = generate_rollouts(model, prompts, 3, 5, None, 0, temperature=1.0, chunk=6)
    assert calls == [6, 6, 3] and sampled.input_ids.shape[0] == 15
    for experiment in ("rlkv_r1_llama8b", "rlkv_r1_qwen7b", "rlkv_qwen3_4b_thinking"):
        from omegaconf import OmegaConf

        cfg = compose(experiment)
        spec = OmegaConf.to_container(cfg.backbone, resolve=True)
        c = spec["config"]
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv_per_token = c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * 2
        tokens = cfg.data.max_prompt_tokens + cfg.model.max_new_tokens
        weights = 2 * count_parameters(build_backbone(spec, meta=True))
        sequences = cfg.data.batch_size * cfg.model.group_size
        chunked_gb = (weights + cfg.model.rollout_chunk * tokens * kv_per_token) / 1e9
        assert cfg.model.rollout_chunk and chunked_gb < 0.6 * 80, (experiment, chunked_gb)
        if experiment != "rlkv_r1_qwen7b":  # 4 KV heads: even unchunked it fits
            assert (weights + sequences * tokens * kv_per_token) / 1e9 > 0.85 * 80, experiment


def test_duo_trains_as_released_schedule_block_window_and_qa_span(tiny_tokenizer):
    """base/duo_attn/train.py: lr x min(1, max((t+1)/(N//5), .1), max((N-t)/(N//5), .1)); the 128-token block window;
    data.py: one question + key + separator per pass key after the context, the whole QA span supervised; context
    lengths evenly spaced from n_tokens_min to n_tokens."""
    from lightning_modules.rlkv.data import MultiPasskeyDataModule
    from lightning_modules.rlkv.duo import duo_schedule
    from runner import compose

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sch = duo_schedule(opt, 2000)
    factors = []
    for _ in range(2000):
        factors.append(opt.param_groups[0]["lr"])
        opt.step()
        sch.step()
    assert factors[0] == pytest.approx(0.1) and factors[199] == pytest.approx(0.5) and factors[399] == 1.0
    assert factors[1000] == 1.0 and factors[1700] == pytest.approx(0.75) and factors[1999] == pytest.approx(0.1)
    paper = compose("duoattn_r1_llama8b")
    assert paper.model.window == "block" and paper.model.block == 128 and paper.data.layout == "qa_span"
    assert paper.model.scheduler._target_.endswith("duo_schedule") and paper.trainer.max_steps == 2000

    dm = MultiPasskeyDataModule(tiny_tokenizer, n_tokens=300, n_tokens_min=200, length_intervals=3, n_keys=4,
                                n_train=3, n_val=1)
    dm.setup()
    for i, target in enumerate((200, 250, 300)):
        ids, sup = dm.train_set[i]
        span = [t for t, s in zip(ids, sup) if s]
        first = sup.index(1)
        assert all(sup[first:]) and not any(sup[:first])  # one contiguous span at the end
        text = tiny_tokenizer.decode(span)
        assert text.count("What is pass key number") == 4 and text.endswith("\n\n")
        keys = [line.split("Pass key: ")[1] for line in text.split("\n\n") if "Pass key: " in line]
        context = tiny_tokenizer.decode(ids[:first])
        assert all(f"Pass key number {j + 1} is: {k}." in context for j, k in enumerate(keys))
        assert abs(first - target) < 20  # the context runs about n_tokens (+ intro / closing lines)
    recite = MultiPasskeyDataModule(tiny_tokenizer, n_tokens=200, n_keys=4, n_train=1, n_val=1, layout="recite")
    recite.setup()
    ids, sup = recite.train_set[0]
    assert "," in tiny_tokenizer.decode([t for t, s in zip(ids, sup) if s])  # the keys recited, only they supervised


@pytest.mark.parametrize("name", ["h2o", "rkv"])
def test_token_dropping_baselines_decode_a_left_padded_batch_at_the_matched_budget(prompt, name):
    """The table's H2O / R-KV rows through the evaluation decoder (model/press=h2o|rkv, matched sparsity): a padded row
    and an unpadded one decode, well under the full cache."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lightning_modules.rlkv.evaluation import press_generate

    model = tiny_llama(torch.float32)
    ids, mask = prompt
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    cfg = OmegaConf.load(f"conf/model/press/{name}.yaml")
    cfg.sparsity, cfg.window = 0.5, (4 if name == "h2o" else 8)
    if name == "rkv":
        cfg.fixed_size, cfg.buffer, cfg.obs_window = 12, 4, 2
    press = instantiate(cfg)
    out = press_generate(model, press, prompts, 8, None, 0)
    assert out["tokens"].shape == (2, 8) and out["kv_kept_fraction"] < 0.8  # the budget's exact counts: test_kv_press


def test_every_press_of_the_rlkv_table_instantiates_from_the_eval_config():
    """rlkv_eval_<model> with head_mixed (gates), h2o or rkv (no gates key leaks into the token-dropping presses)."""
    from hydra.utils import instantiate

    from runner import compose

    for name, cls in (("head_mixed", "HeadMixedPress"), ("h2o", "H2O"), ("rkv", "RKV")):
        press = instantiate(compose("rlkv_eval_r1_llama8b", [f"model/press={name}"]).model.press)
        assert type(press).__name__ == cls and press.sparsity == 0.4


@pytest.mark.parametrize("cls", ["rlkv", "duo"])
def test_clamp_before_forward_is_the_release_timing(monkeypatch, cls):
    """clamp=before_forward (AReaL's train_batch, DuoAttention's train.py): a step may leave gates outside [0, 1]; the
    next training forward (grad on) clamps them first, no-grad passes do not. after_step (ours) clamps at the step."""
    from lightning_modules.common.rl import module as rl_module
    from lightning_modules.rlkv.duo import DuoAttentionModule

    make = (lambda **kw: RLKVModule(backbone={"family": "llama"}, sink=2, recent=4, **kw)) if cls == "rlkv" else \
        (lambda **kw: DuoAttentionModule(backbone={"family": "llama"}, sink=2, recent=4, **kw))
    monkeypatch.setattr(rl_module.RLModule, "_step", lambda self: 0.0)
    ids = torch.randint(2, 61, (1, 12), generator=torch.Generator().manual_seed(0))
    outside = torch.tensor([[1.4, -0.3], [0.5, 2.0]], dtype=torch.float64)
    for clamp in ("before_forward", "after_step"):
        m = make(clamp=clamp)
        m.model = m.install_gates(tiny_llama(), m.window)
        m.mixed.double()
        with torch.no_grad():
            m.mixed.gates.copy_(outside)  # as an optimizer step may leave them
        m._step() if cls == "rlkv" else m.on_train_batch_end(None, None, 0)
        stepped = m.mixed.gates.detach().clone()
        with torch.no_grad():
            m.model(input_ids=ids)
        assert torch.equal(m.mixed.gates.detach(), stepped)  # a no-grad pass (rollout, log-probs) changes nothing
        m.model(input_ids=ids)
        clamped = outside.clamp(0, 1)
        assert torch.equal(stepped, outside if clamp == "before_forward" else clamped)
        assert torch.equal(m.mixed.gates.detach(), clamped)
    with pytest.raises(ValueError, match="clamp"):
        make(clamp="never")
