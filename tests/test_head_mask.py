"""attention.head_mask / prune_heads: masking a head = zeroing its W_O columns (prefill and cached decoding), and
slicing the same heads out gives the same logits (MHA per head, GQA by whole KV groups)."""
import copy

import pytest
import torch

from lightning_modules.common.attention import attention_modules, head_mask, kv_group_mask, prune_heads
from lightning_modules.common.backbone import build_backbone


def _llama(kv_heads, dtype="float64", qwen=False):
    torch.manual_seed(0)
    cfg = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=kv_heads)
    family = "qwen2" if qwen else "llama"
    return build_backbone({"family": family, "config": cfg, "dtype": dtype, "attn_implementation": "eager"}).eval()


def _zeroed(model, mask):
    """The reference: a copy whose masked heads' W_O columns are zero."""
    ref = copy.deepcopy(model)
    for attn, m in zip(attention_modules(ref), mask):
        d = attn.head_dim
        with torch.no_grad():
            for h in (~m.bool()).nonzero().flatten().tolist():
                attn.o_proj.weight[:, h * d:(h + 1) * d] = 0
    return ref


MASK = torch.tensor([[1, 0, 1, 1], [0, 0, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
IDS = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_head_mask_equals_zeroed_w_o_columns_at_prefill_and_in_cached_decoding(kv_heads):
    model = _llama(kv_heads)
    ref = _zeroed(model, MASK)
    with torch.no_grad():
        want = ref(IDS).logits
        want_gen = ref.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0)
        with head_mask(model, MASK):
            got = model(IDS).logits
            got_gen = model.generate(IDS, max_new_tokens=6, do_sample=False, pad_token_id=0)
            # a cached step on its own: prefill 8 tokens, then feed the 9th with the cache
            out = model(IDS[:, :-1], use_cache=True)
            cache = getattr(out, "cache", None) or out.past_key_values
            step = model(IDS[:, -1:], cache=cache, use_cache=True).logits
        dense = model(IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(step[:, -1], want[:, -1], rtol=0, atol=1e-10)
    assert torch.equal(got_gen, want_gen)
    assert not torch.allclose(dense, want)   # the hook is gone after the context


def test_slice_equals_mask_in_float64_on_mha():
    model = _llama(4)
    with torch.no_grad(), head_mask(model, MASK):
        want = model(IDS).logits
        want_gen = model.generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=0)
    before = [a.q_proj.weight.shape for a in attention_modules(model)]
    with torch.no_grad(), prune_heads(model, MASK):
        assert [a.q_proj.out_features // a.head_dim for a in attention_modules(model)] == MASK.sum(1).tolist()
        got = model(IDS).logits
        got_gen = model.generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert torch.equal(got_gen, want_gen)
    assert [a.q_proj.weight.shape for a in attention_modules(model)] == before   # restored


@pytest.mark.parametrize("qwen", [False, True])   # qwen2: q/k/v biases sliced too
def test_slice_equals_mask_for_gqa_by_whole_kv_groups(qwen):
    model = _llama(2, qwen=qwen)
    keep = kv_group_mask(MASK, 2)
    assert keep.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]
    with torch.no_grad(), head_mask(model, keep):
        want = model(IDS).logits
    with torch.no_grad(), prune_heads(model, keep):
        assert attention_modules(model)[1].k_proj.out_features == attention_modules(model)[1].head_dim
        got = model(IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="kv_group_mask"):
        with prune_heads(model, MASK):
            pass
    with pytest.raises(ValueError, match="at least one head"):
        with prune_heads(model, torch.zeros(3, 4, dtype=torch.bool)):
            pass
    with pytest.raises(ValueError, match=r"\(layers, heads\)"):
        with head_mask(model, torch.ones(2, 4)):
            pass
