"""lightning_modules.common.activations: every site against transformers' own outputs, on three block layouts."""
import pytest
import torch

from lightning_modules.common.activations import at, capture, decoder_layers, intervene
from lightning_modules.common.backbone import build_backbone

SPECS = {
    "llama": {"family": "llama", "config": dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                num_attention_heads=4, num_key_value_heads=2, attention_bias=True)},
    "gpt2": {"family": "gpt2", "config": dict(vocab_size=97, n_embd=32, n_layer=3, n_head=4, n_positions=64)},
    "gpt_neox": {"family": "gpt_neox", "config": dict(vocab_size=97, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=3, num_attention_heads=4, rotary_pct=0.25)},
}


def _model(family):
    torch.manual_seed(0)
    return build_backbone({**SPECS[family], "dtype": "float32", "attn_implementation": "eager"}).eval()


@pytest.fixture(scope="module", params=list(SPECS))
def model(request):
    return _model(request.param)


def _ids(B=2, T=10, seed=1):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def _cache(out):  # transformers 5 renames past_key_values to cache
    return getattr(out, "cache", None) or out.past_key_values


def test_embed_and_block_out_are_transformers_hidden_states(model):
    ids = _ids()
    with torch.no_grad(), capture(model, ("embed", "block_out")) as acts:
        hs = model(ids, output_hidden_states=True).hidden_states
    L = len(decoder_layers(model))
    torch.testing.assert_close(acts["embed"][0], hs[0], rtol=0, atol=0)
    for layer in range(L - 1):
        torch.testing.assert_close(acts["block_out"][layer], hs[layer + 1], rtol=0, atol=0)
    # transformers' last entry is after the final norm; ours is the raw residual stream
    assert not torch.allclose(acts["block_out"][L - 1], hs[L])


def test_head_writes_sum_to_the_attention_output_and_post_attn_is_residual_plus_it(model):
    ids = _ids()
    with torch.no_grad(), capture(model, ("embed", "block_out", "post_attn", "head_write")) as acts:
        model(ids)
    for layer in range(len(decoder_layers(model))):
        block = decoder_layers(model)[layer]
        attn = next(getattr(block, n) for n in ("self_attn", "attn", "attention") if hasattr(block, n))
        proj = next(getattr(attn, n) for n in ("o_proj", "c_proj", "dense") if hasattr(attn, n))
        heads = acts["head_write"][layer]
        assert heads.shape == (*ids.shape, 4, 32)
        attn_out = heads.sum(-2) + (proj.bias if proj.bias is not None else 0)
        h_in = acts["embed"][0] if layer == 0 else acts["block_out"][layer - 1]
        torch.testing.assert_close(acts["post_attn"][layer], h_in + attn_out, rtol=1e-5, atol=1e-5)
        # and against the projection's own output, recorded independently
        seen = {}
        hook = proj.register_forward_hook(lambda m, a, o: seen.setdefault("o", o))
        with torch.no_grad():
            model(ids)
        hook.remove()
        torch.testing.assert_close(seen["o"], attn_out, rtol=1e-5, atol=1e-5)


def test_capture_checks_sites_and_layers(model):
    with pytest.raises(ValueError, match="unknown activation site"):
        with capture(model, ("resid",)):
            pass
    with pytest.raises(ValueError, match=r"layer\(s\) \[7\] beyond the model's 3"):
        with capture(model, ("block_out",), layers=[7]):
            pass


def test_intervene_zero_is_exact_and_an_edit_is_causal(model):
    ids, t, layer = _ids(), 5, 1
    with torch.no_grad():
        ref = model(ids).logits
        with intervene(model, layer, at(t, torch.zeros(32))):
            same = model(ids).logits
        with intervene(model, layer, at(t, torch.randn(32, generator=torch.Generator().manual_seed(3)))):
            moved = model(ids).logits
    torch.testing.assert_close(same, ref, rtol=0, atol=0)
    torch.testing.assert_close(moved[:, :t], ref[:, :t], rtol=0, atol=0)
    assert (moved[:, t] - ref[:, t]).abs().max() > 1e-3


def test_intervene_lands_on_the_same_position_in_cached_generation(model):
    ids, t, layer = _ids(B=2, T=9), 6, 2
    delta = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))  # a different edit per row
    with torch.no_grad(), intervene(model, layer, at(torch.tensor([t, t - 2]), delta)):
        full = model(ids).logits
        out = model(ids[:, :3], use_cache=True)                 # prefill, then one token at a time
        steps = [out.logits]
        for i in range(3, ids.shape[1]):
            out = model(ids[:, i:i + 1], cache=_cache(out), use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        plain = model(ids).logits
    assert (full[0, t] - plain[0, t]).abs().max() > 1e-3 and (full[1, t - 2] - plain[1, t - 2]).abs().max() > 1e-3
    torch.testing.assert_close(full[0, :t], plain[0, :t], rtol=0, atol=0)


def test_intervene_applies_inside_generate(model):
    """An edit at a position generate() reaches only through the KV cache gives the scores of full re-forwards."""
    ids, layer = _ids(B=1, T=5), 1
    t = ids.shape[1] + 1                                       # the second generated token's position
    edit = at(t, 5 * torch.randn(32, generator=torch.Generator().manual_seed(5)))
    with torch.no_grad(), intervene(model, layer, edit):
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0)
        seq = gen.sequences
        full = model(seq[:, :-1]).logits[:, ids.shape[1] - 1:]   # no cache: every position recomputed
    torch.testing.assert_close(torch.stack(gen.scores, 1), full, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        plain = model(seq[:, :-1]).logits[:, ids.shape[1] - 1:]
    assert (plain[:, 2:] - full[:, 2:]).abs().max() > 1e-3        # the edit at t reached the later scores
    torch.testing.assert_close(plain[:, :2], full[:, :2], rtol=0, atol=0)
