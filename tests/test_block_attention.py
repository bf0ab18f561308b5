"""Attention patterns without N × N masks (lightning_modules/common/block_attention.py): the block-wise engine against
SDPA on the same mask, every pattern's block-wise path against today's dense-mask code (forward and gradients, fp32,
padding left and right, GQA, odd lengths), FlexAttention's forward on CPU, packed documents through a model, and
the property that no tensor of N × N elements is ever built."""
import pytest
import torch
import torch.nn.functional as F

from lightning_modules.common import block_attention as ba
from lightning_modules.common.block_attention import (blockwise_attend, causal_layout, flex_attend, groups_layout,
                                                      rolled_groups_layout, sink_recent_layout)

RTOL = 1e-5


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 so that tiny tensors go through the tiled path (and its chunk edges) instead of one SDPA call."""
    monkeypatch.setattr(ba, "CHUNK", 8)


def assert_rel(got, ref, rtol=RTOL):
    """max |got - ref| <= rtol · max |ref| (the issue's 1e-5 relative, fp32), absolute below 1: a query that sees one
    key has exactly zero q/k gradients, which both sides compute as rounding noise."""
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= rtol * max(scale, 1.0), f"error {err:.2e} > {rtol} x max(|ref| = {scale:.2e}, 1)"


def grads(fn, inputs, seed=0):
    """fn(*inputs) and d<out, g>/d inputs for a fixed random g."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, g)]


def assert_same(fn_new, fn_ref, inputs):
    for got, ref in zip(grads(fn_new, inputs), grads(fn_ref, inputs)):
        assert_rel(got, ref)


def qkv(b, h, h_kv, q_len, kv_len, d=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, q_len, d, generator=g, dtype=dtype), torch.randn(b, h_kv, kv_len, d, generator=g, dtype=dtype),
            torch.randn(b, h_kv, kv_len, d, generator=g, dtype=dtype))


def padding(b, n, left=(), right=(), holes=()):
    valid = torch.ones(b, n, dtype=torch.bool)
    for row, count in left:
        valid[row, :count] = False
    for row, count in right:
        valid[row, n - count:] = False
    for row, lo, hi in holes:
        valid[row, lo:hi] = False
    return valid


# --- the engine: tiled = one SDPA call on the layout's own dense mask -------------------------------------------------
VALID = padding(3, 37, left=[(0, 5)], right=[(1, 7)], holes=[(2, 10, 13)])
DOCS = torch.tensor([0] * 10 + [1] * 15 + [2] * 12).expand(3, 37)
# a document wholly padded (row 0), a left pad longer than a decoding step's offset (row 1), a row of padding (row 2)
VALID2 = padding(3, 37, left=[(1, 20)], holes=[(0, 10, 25), (2, 0, 37)])
LAYOUTS = {
    "causal": lambda: causal_layout(3, 37, 37),
    "causal_padded": lambda: causal_layout(3, 37, 37, VALID),
    "documents": lambda: causal_layout(3, 37, 37, None, DOCS),
    "documents_padded": lambda: causal_layout(3, 37, 37, VALID, DOCS),
    "decode_padded": lambda: causal_layout(3, 21, 37, VALID),
    "empty_runs": lambda: causal_layout(3, 37, 37, VALID2, DOCS),
    "decode_long_pad": lambda: causal_layout(3, 21, 37, VALID2),
    "sink_recent_empty_runs": lambda: sink_recent_layout(3, 21, 37, 3, 6, "token", 4, VALID2, DOCS, chunk=8),
    "groups": lambda: groups_layout(3, 37, 10, 3),
    "rolled": lambda: rolled_groups_layout(3, 40, 10),
    "sink_recent_token": lambda: sink_recent_layout(3, 37, 37, 3, 6, "token", 4, VALID, DOCS, chunk=8),
    "sink_recent_block": lambda: sink_recent_layout(3, 37, 37, 3, 6, "block", 4, VALID, None, chunk=8),
    "recent_only": lambda: sink_recent_layout(3, 37, 37, 0, 1, "token", 4, VALID, None, chunk=8),
    "sink_recent_decode": lambda: sink_recent_layout(3, 21, 37, 2, 5, "block", 4, VALID, None, chunk=8),
}


@pytest.mark.parametrize("kernel", ["fused", "math"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_tiled_engine_equals_sdpa_on_the_layouts_mask(name, kernel):
    layout = LAYOUTS[name]()
    q, k, v = qkv(layout.batch, 4, 2, layout.q_len, layout.kv_len)
    mask = layout.dense()
    assert mask.any(-1).all()  # every query sees a key (a padding row: itself)
    assert_same(lambda q, k, v: blockwise_attend(q, k, v, layout, chunk=4, kernel=kernel),
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), (q, k, v))


def test_bf16_runs_and_stays_close():
    layout = LAYOUTS["sink_recent_token"]()
    q, k, v = qkv(layout.batch, 4, 4, layout.q_len, layout.kv_len)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense())
    got = blockwise_attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), layout, chunk=4)
    assert got.dtype == torch.bfloat16 and (got.float() - ref).abs().max() < 3e-2


def test_causal_layout_equals_rlkvs_allowed_keys_and_transformers_packed_mask():
    """The padding rule is RLKV's (a row that sees nothing sees itself) and the documents are transformers' (a
    position-id restart starts one); the 4-D masks they build are the reference."""
    from transformers.masking_utils import find_packed_sequence_indices, sdpa_mask

    from lightning_modules.rlkv.mixed_attention import allowed_keys

    for q_len in (37, 21):
        assert torch.equal(causal_layout(3, q_len, 37, VALID).dense(), allowed_keys(VALID.long(), q_len, 37, "cpu"))
    pos = torch.cat([torch.arange(10), torch.arange(15), torch.arange(12)])[None].expand(3, -1)
    docs = find_packed_sequence_indices(pos)
    from transformers.masking_utils import causal_mask_function, and_masks, packed_sequence_mask_function

    ref = sdpa_mask(3, 37, 37, mask_function=and_masks(causal_mask_function, packed_sequence_mask_function(docs)),
                    allow_is_causal_skip=False)
    assert torch.equal(causal_layout(3, 37, 37, None, docs).dense(), ref)


# --- every pattern against today's dense code ------------------------------------------------------------------------
@pytest.mark.parametrize("window", ["token", "block"])
@pytest.mark.parametrize("case", ["plain", "padded", "decode", "documents"])
def test_rlkv_mixed_attention_blockwise_equals_dense(window, case, small_chunks):
    from lightning_modules.rlkv.mixed_attention import MixedAttention

    n, kv_len = (21, 37) if case == "decode" else (37, 37)
    mask = {"plain": None, "padded": VALID.long(), "decode": VALID.long(), "documents": None}[case]
    docs = DOCS if case == "documents" else None
    dense_mask = mask
    if docs is not None:  # the dense core sees packed rows as transformers' sdpa hands them: a 4-D mask
        dense_mask = docs[:, None, :, None] == docs[:, None, None, :]

    class Attn:
        scaling, layer_idx = 8 ** -0.5, 1

    def core(impl, m, **kw):
        mixed = MixedAttention(2, 2, sink=3, recent=6, window=window, block=4, attention_impl=impl)
        with torch.no_grad():
            mixed.gates.copy_(torch.tensor([[0.1, 0.9], [0.3, 0.6]]))
        return lambda q, k, v: mixed.core(Attn, None, q, k, v, m, **kw)

    assert_same(core("blockwise", mask, documents=docs), core("sdpa_dense", dense_mask), qkv(3, 4, 2, n, kv_len))


def _segment_inputs(b=2, h=4, h_kv=2, s=4, n=9, p=5, seed=0):
    q, k, v = qkv(b, h, h_kv, s * n, s * n, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    pk, pv = (torch.randn(b, s, h_kv, p, 8, generator=g) for _ in range(2))
    return q, k, v, pk, pv


@pytest.mark.parametrize("prefix", ["none", "all", "shifted", "per_row"])
@pytest.mark.parametrize("pad", ["none", "left", "right"])
def test_hici_segment_attention_blockwise_equals_dense(prefix, pad, small_chunks):
    """Segments of 9 tokens (odd; chunks of 8 cut them), GQA 4/2, prefix of 5 slots valid everywhere, from segment 1
    on (the shifted modes), or per row; padding that covers a whole segment and part of the next."""
    from lightning_modules.hici.hici_attention import segment_attention

    s = 4
    q, k, v, pk, pv = _segment_inputs(s=s)
    tv = {"none": None, "left": padding(2, 36, left=[(0, 12)]), "right": padding(2, 36, right=[(1, 11)])}[pad]
    pvalid = {"none": None, "all": torch.ones(s, dtype=torch.bool), "shifted": torch.tensor([False, True, True, True]),
              "per_row": torch.tensor([[False, False, True, True], [True, True, True, False]])}[prefix]

    def run(impl):
        if prefix == "none":
            return lambda q, k, v: segment_attention(q, k, v, num_segments=s, token_valid=tv, attention_impl=impl)
        return lambda q, k, v, pk, pv: segment_attention(q, k, v, pk, pv, pvalid, s, tv, attention_impl=impl)

    inputs = (q, k, v) if prefix == "none" else (q, k, v, pk, pv)
    assert_same(run("blockwise"), run("sdpa_dense"), inputs)


@pytest.mark.parametrize("mode", ["none", "causal_gi", "causal_gi_gonly", "causal_shift", "causal_shift_g"])
def test_hici_core_every_causal_mode_blockwise_equals_dense_with_gradients(mode, small_chunks):
    """The whole HiCI layer (slots, statistics, integrator, broadcast) in a 2-layer GQA LLaMA, fp32, a left- and a
    right-padded row: logits and every trainable gradient (HiCI modules and the projections) agree."""
    from lightning_modules.common.attention import patch_attention
    from lightning_modules.hici.hici_attention import HiCICore
    from lightning_modules.hici.module import attach_hici

    from tests.test_hici import TINY, tiny_model

    model = tiny_model("llama", dtype=torch.float32)
    attach_hici(model, {**TINY, "local_slots": 4, "global_slots": 2, "global_query_init": "xavier"})
    for attn in [m for m in model.modules() if hasattr(m, "global_integrator")]:
        attn.global_integrator.out.weight.data.normal_(0, 0.5)  # make G matter
    model.train()
    x = torch.randint(0, 97, (2, 36), generator=torch.Generator().manual_seed(3))
    mask = padding(2, 36, left=[(0, 11)], right=[(1, 4)]).long()

    def run(impl):
        patch_attention(model, HiCICore(num_segments=4, causal_mode=mode, attention_impl=impl))
        model.zero_grad()
        logits = model(input_ids=x, attention_mask=mask).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (a, ga), (b, gb) = run("blockwise"), run("sdpa_dense")
    assert_rel(a, b)
    assert set(ga) == set(gb) and any("global_integrator" in n for n in ga)
    for name in ga:
        assert_rel(ga[name], gb[name])


@pytest.mark.parametrize("shift", ["no_wrap", "roll"])
@pytest.mark.parametrize("h_kv", [4, 2])
def test_s2attn_blockwise_equals_dense(shift, h_kv, small_chunks):
    from lightning_modules.hici.s2attn import s2_attention

    run = lambda impl: lambda q, k, v: s2_attention(q, k, v, 0.25, shift, impl)  # noqa: E731
    assert_same(run("blockwise"), run("sdpa_dense"), qkv(2, 4, h_kv, 40, 40))


def test_segment_local_blockwise_equals_dense(small_chunks):
    from lightning_modules.hici.s2attn import LocalCore

    class Attn:
        pass

    run = lambda impl: lambda q, k, v: LocalCore(4, impl)(Attn, None, q, k, v)  # noqa: E731
    assert_same(run("blockwise"), run("sdpa_dense"), qkv(2, 4, 2, 36, 36))


# --- through a model: packed documents and padding -----------------------------------------------------------------
def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).float().train()


def test_packed_and_padded_rows_through_use_block_attention_equal_sdpa(small_chunks):
    """A packed row (three documents, position ids restarting) and a padded batch: the paperlab_block model gives
    transformers' sdpa logits and gradients (padded positions aside), and hands its layers no 4-D mask."""
    from lightning_modules.common.block_attention import BLOCK_IMPL, unuse_block_attention, use_block_attention

    model = _llama()
    ids = torch.randint(2, 61, (1, 37), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(10), torch.arange(15), torch.arange(12)])[None]
    padded = torch.randint(2, 61, (2, 30), generator=torch.Generator().manual_seed(2))
    mask = padding(2, 30, left=[(0, 9)], right=[(1, 6)]).long()
    keep = mask.bool()

    def run():
        model.zero_grad()
        a = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        b = model(input_ids=padded, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
        (a.sum() + b[keep].sum()).backward()
        return [a.detach(), b.detach()[keep]] + [p.grad.clone() for p in model.parameters()]

    ref = run()
    use_block_attention(model, "blockwise")
    assert model.config._attn_implementation == BLOCK_IMPL
    seen = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    got = run()
    handle.remove()
    assert seen[0] is ba.PACKED and seen[1].dim() == 2  # packed: documents from position ids; padded: the 2-D mask
    for g, r in zip(got, ref):
        assert_rel(g, r)
    assert unuse_block_attention(model).config._attn_implementation == "sdpa"


def test_rlkv_core_gets_packed_documents_and_other_cores_refuse_them(small_chunks):
    from lightning_modules.common.attention import patch_attention
    from lightning_modules.common.block_attention import use_block_attention
    from lightning_modules.hici.s2attn import LocalCore
    from lightning_modules.rlkv.mixed_attention import MixedAttention

    ids = torch.randint(2, 61, (1, 37), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(10), torch.arange(15), torch.arange(12)])[None]
    outs = []
    for impl in ("sdpa_dense", "blockwise"):  # sdpa: transformers' 4-D document mask; blockwise: documents=
        model = _llama().eval()
        mixed = MixedAttention.for_model(model, sink=2, recent=4, attention_impl=impl)
        with torch.no_grad():
            mixed.gates.fill_(0.3)
        mixed.install(model)
        use_block_attention(model, impl)
        with torch.no_grad():
            outs.append(model(input_ids=ids, position_ids=pos, use_cache=False).logits)
    assert_rel(outs[1], outs[0])
    model = use_block_attention(_llama(), "blockwise")
    patch_attention(model, LocalCore(1))
    with pytest.raises(ValueError, match="does not attend within packed documents"):
        model(input_ids=ids, position_ids=pos, use_cache=False)


# --- FlexAttention: the same mask_mods ----------------------------------------------------------------------------
FLEX_CASES = ["causal_padded", "documents_padded", "groups", "rolled", "sink_recent_token", "sink_recent_block"]


def test_flex_forward_equals_blockwise_on_cpu_uncompiled():
    """torch's unfused FlexAttention (forward only on CPU) with each pattern's BlockMask."""
    for name in FLEX_CASES:
        layout = LAYOUTS[name]()
        q, k, v = qkv(layout.batch, 4, 2, layout.q_len, layout.kv_len)
        assert_rel(flex_attend(q, k, v, layout, compiled=False), blockwise_attend(q, k, v, layout, chunk=4))


@pytest.mark.slow
def test_flex_forward_compiled_on_cpu():
    """Compiled FlexAttention (~20 s per pattern to compile on CPU): the HiCI and RLKV patterns at N = 256."""
    from lightning_modules.hici.hici_attention import segment_layout

    valid = padding(2, 256, left=[(0, 40)], right=[(1, 17)])
    for layout in (segment_layout(2, 256, 4, 4, torch.tensor([False, True, True, True]), valid),
                   sink_recent_layout(2, 256, 256, 16, 64, "block", 32, valid)):
        kv_len = layout.kv_len
        q, k, v = qkv(2, 4, 2, 256, kv_len, d=16)
        assert_rel(flex_attend(q, k, v, layout, compiled=True), blockwise_attend(q, k, v, layout, chunk=64))


# --- no N × N tensor --------------------------------------------------------------------------------------------------
class LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """The most elements any op's output had (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_no_tensor_grows_like_n_squared():
    """N = 1024 with chunks of 64, one head: the largest tensor any op makes (forward + backward) stays far below N²
    (a dense mask alone would be N²), for every pattern; the dense HiCI path does exceed it."""
    from lightning_modules.hici.hici_attention import segment_attention, segment_layout

    n, ch = 1024, 64
    valid = padding(1, n, left=[(0, 100)])
    layouts = [causal_layout(1, n, n, valid), causal_layout(1, n, n, None, (torch.arange(n) // 300)[None]),
               groups_layout(1, n, 256, 128), rolled_groups_layout(1, n, 256),
               sink_recent_layout(1, n, n, 128, 256, "token", 128, valid, chunk=ch),
               sink_recent_layout(1, n, n, 128, 256, "block", 128, None, chunk=ch),
               segment_layout(1, n, 4, 4, None, valid)]
    for layout in layouts:
        q, k, v = (t.requires_grad_(True) for t in qkv(1, 1, 1, n, layout.kv_len, d=8))
        with LargestTensor() as seen:
            blockwise_attend(q, k, v, layout, chunk=ch).sum().backward()
        assert seen.most <= 4 * n * 8 + ch * ch, (layout.params, seen.most)
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 1, 1, n, n, d=8))
    pk = pv = torch.zeros(1, 4, 1, 4, 8)
    with LargestTensor() as seen:
        segment_attention(q, k, v, pk, pv, num_segments=4, attention_impl="sdpa_dense").sum().backward()
    assert seen.most >= n * n // 4


def test_bad_switch_names_the_choices():
    with pytest.raises(ValueError, match="auto, flex, blockwise, sdpa_dense"):
        ba.resolve_impl("dense", "cpu")
    assert ba.resolve_impl("auto", "cpu") == "blockwise" and ba.resolve_impl("auto", "cuda") == "flex"
