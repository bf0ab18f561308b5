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
