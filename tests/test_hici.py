"""HiCI (arXiv 2603.20843) and LongLoRA's S²-Attn: masks against naive references, reductions to plain attention,
causality (and the released code's leak), the recipe's parameter count, `full`-mode export, tiny runs end to end."""
import math

import pytest
import torch
import torch.nn.functional as F

from lightning_modules.common.attention import attention_enabled, patch_attention, unpatch_attention
from lightning_modules.hici.hici_attention import (GlobalIntegrator, HiCICore, LocalConstructor, segment_attention,
                                                   slot_statistics)
from lightning_modules.hici.module import HiCILongContextLM, attach_hici, clip_hici_gradients, rope_factor
from lightning_modules.hici.s2attn import s2_attention

TINY = dict(heads=4, bottleneck_dim=32, compress_dim=8, expand_dim=32, integrator_heads=4)


def tiny_model(family="llama", dtype=torch.float64, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
    if family == "qwen3":
        kw["head_dim"] = 16
    cfg = AutoConfig.for_model(family, **kw)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


# --- the broadcast mask ------------------------------------------------------------------------------------------
def naive_segment_attention(q, k, v, pk, pv, valid, s):
    """Per batch, per segment, per head: explicit scores, explicit mask, fp64."""
    b, h, n_tok, d = q.shape
    n, rep = n_tok // s, h // k.shape[1]
    out = torch.zeros(b, n_tok, h, d, dtype=q.dtype)
    for bi in range(b):
        for i in range(s):
            for hi in range(h):
                kv = hi // rep
                qi = q[bi, hi, i * n:(i + 1) * n]
                keys = torch.cat([pk[bi, i, kv], k[bi, kv, i * n:(i + 1) * n]]) if valid[i] else k[bi, kv, i * n:(i + 1) * n]
                vals = torch.cat([pv[bi, i, kv], v[bi, kv, i * n:(i + 1) * n]]) if valid[i] else v[bi, kv, i * n:(i + 1) * n]
                p = keys.shape[0] - n
                scores = qi @ keys.T / math.sqrt(d)
                for t in range(n):
                    scores[t, p + t + 1:] = -math.inf
                out[bi, i * n:(i + 1) * n, hi] = torch.softmax(scores, -1) @ vals
    return out


def test_vectorised_segment_attention_equals_naive_loop():
    g = torch.Generator().manual_seed(0)
    b, h, kv, s, n, d, p = 2, 4, 2, 4, 6, 8, 5
    q = torch.randn(b, h, s * n, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, kv, s * n, d, generator=g, dtype=torch.float64) for _ in range(2))
    pk, pv = (torch.randn(b, s, kv, p, d, generator=g, dtype=torch.float64) for _ in range(2))
    valid = torch.tensor([False, True, True, True])
    got = segment_attention(q, k, v, pk, pv, valid, num_segments=s)
    ref = naive_segment_attention(q, k, v, pk, pv, valid, s)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_one_segment_without_slots_is_the_layers_causal_attention(family):
    model = tiny_model(family)
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=x).logits
    patch_attention(model, HiCICore(num_segments=1, causal_mode="none"))  # no modules attached: no slots
    torch.testing.assert_close(model(input_ids=x).logits, ref, atol=1e-10, rtol=1e-10)
    # ...while 4 segments without slots is a different (block-local) pattern
    patch_attention(model, HiCICore(num_segments=4, causal_mode="none"))
    assert (model(input_ids=x).logits - ref).abs().max() > 1e-3
    unpatch_attention(model)
    torch.testing.assert_close(model(input_ids=x).logits, ref, atol=0, rtol=0)


def _perturbed_logits(model, x, pos):
    y = x.clone()
    y[:, pos] = (y[:, pos] + 1 + torch.arange(len(pos))) % 97
    return model(input_ids=x).logits, model(input_ids=y).logits


@pytest.mark.parametrize("mode,leaks", [("causal_shift_g", False), ("causal_shift", False), ("causal_gi", False),
                                        ("causal_gi_gonly", False), ("none", True)])
def test_future_segment_perturbation(mode, leaks):
    """Perturb the last segment: earlier segments' outputs must not move unless the mode leaks (the released code)."""
    model = tiny_model("llama")
    attach_hici(model, {**TINY, "local_slots": 4, "global_slots": 2, "gate_init": 0.1})
    for attn in [m for m in model.modules() if hasattr(m, "global_integrator")]:
        attn.global_integrator.out.weight.data.normal_(0, 0.5)  # make G matter
    model.double().train()  # training-time segmentation
    patch_attention(model, HiCICore(num_segments=4, causal_mode=mode))
    x = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(2))
    a, b = _perturbed_logits(model, x, list(range(24, 32)))
    diff = (a[:, :24] - b[:, :24]).abs().max().item()
    assert (diff > 1e-6) if leaks else (diff < 1e-12), diff
    assert (a[:, 24:] - b[:, 24:]).abs().max() > 1e-6  # the perturbed segment itself does change


@pytest.mark.parametrize("mode", ["causal_gi", "causal_gi_gonly"])
def test_causal_gi_leaks_within_a_segment_only(mode):
    model = tiny_model("llama")
    attach_hici(model, {**TINY, "local_slots": 4, "global_slots": 2, "gate_init": 0.1})
    for attn in [m for m in model.modules() if hasattr(m, "global_integrator")]:
        attn.global_integrator.out.weight.data.normal_(0, 0.5)  # make G matter
    model.double().train()
    patch_attention(model, HiCICore(num_segments=4, causal_mode=mode))
    x = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(3))
    a, b = _perturbed_logits(model, x, [23])  # last token of segment 2
    assert (a[:, :16] - b[:, :16]).abs().max() < 1e-12  # segments 0-1: G_i is cumulative, no cross-segment leak
    assert (a[:, 16:23] - b[:, 16:23]).abs().max() > 1e-6  # segment 2's earlier tokens see token 23 (L_2 / G_2)


# --- S²-Attn -----------------------------------------------------------------------------------------------------
def s2_mask_reference(q, k, v, ratio, shift):
    b, h, n, d = q.shape
    g = int(n * ratio)
    t = torch.arange(n)
    plain = (t[None] <= t[:, None]) & ((t // g)[:, None] == (t // g)[None])
    if shift == "roll":
        r = (t - g // 2) % n
        shifted = (r[None] <= r[:, None]) & ((r // g)[:, None] == (r // g)[None])
    else:
        gs = (t + g // 2) // g
        shifted = (t[None] <= t[:, None]) & (gs[:, None] == gs[None])
    mask = torch.stack([plain] * (h // 2) + [shifted] * (h - h // 2))[None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("shift", ["no_wrap", "roll"])
def test_s2attn_equals_its_mask_definition(shift):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(s2_attention(q, k, v, 0.25, shift), s2_mask_reference(q, k, v, 0.25, shift),
                               atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("shift,leaks", [("no_wrap", False), ("roll", True)])
def test_s2attn_future_leak(shift, leaks):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 32, 8, generator=g, dtype=torch.float64) for _ in range(3))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 28:] += 1.0
    v2[:, :, 28:] += 1.0  # perturb the last half-group (tokens 28..31)
    diff = (s2_attention(q, k, v, 0.25, shift) - s2_attention(q, k2, v2, 0.25, shift))[:, :28].abs().max().item()
    assert (diff > 1e-6) if leaks else (diff < 1e-12), diff


# --- parts and the recipe ----------------------------------------------------------------------------------------
def test_gate_starts_at_inverse_softplus_of_0p1():
    gi = GlobalIntegrator(64, gate_init=0.1)
    assert gi.gate.item() == pytest.approx(math.log(math.expm1(0.1)), abs=1e-7)
    assert F.softplus(gi.gate).item() == pytest.approx(0.1, abs=1e-7)


def test_released_initialisation_no_bias_top_norm_queries_per_matrix_xavier():
    model = tiny_model("llama", dtype=torch.float32)
    emb = model.get_input_embeddings().weight.detach()
    emb[[5, 17]] *= 10  # the two highest-norm tokens, for K=2 queries
    attach_hici(model, {**TINY, "local_slots": 4, "global_slots": 2, "gate_init": 0.1})
    for attn in [m for m in model.modules() if hasattr(m, "global_integrator")]:
        gi, lc = attn.global_integrator, attn.local_constructor
        assert not [n for n, _ in [*gi.named_parameters(), *lc.named_parameters()]
                    if n.endswith("bias") and "expand.1" not in n and "compress.1" not in n]  # LayerNorms keep theirs
        with torch.no_grad():
            want = gi.expand(gi.compress(emb[[17, 5]] if emb[17].norm() > emb[5].norm() else emb[[5, 17]]))
        torch.testing.assert_close(gi.queries.detach(), want)
    xavier = tiny_model("llama", dtype=torch.float32)
    attach_hici(xavier, {**TINY, "local_slots": 4, "global_slots": 2, "gate_init": 0.1, "global_query_init": "xavier"})
    q = xavier.model.layers[0].self_attn.global_integrator.queries
    assert q.abs().max() <= math.sqrt(6 / (2 + 32))  # xavier_uniform's bound for a (2, 32) matrix
    with pytest.raises(ValueError, match="global_query_init"):
        attach_hici(xavier, {**TINY, "global_query_init": "normal"})
    torch.manual_seed(0)
    gi = GlobalIntegrator(4096, expand_dim=512)  # per-matrix xavier: std 1/sqrt(512) = 0.0442 for each of q, k, v
    for block in gi.select.in_proj_weight.detach().chunk(3):
        assert block.std().item() == pytest.approx(1 / math.sqrt(512), rel=0.02)


def _padding_model(mode):
    model = tiny_model("llama")
    attach_hici(model, {**TINY, "local_slots": 4, "global_slots": 2, "gate_init": 0.1})
    for attn in [m for m in model.modules() if hasattr(m, "global_integrator")]:
        attn.global_integrator.out.weight.data.normal_(0, 0.5)  # make G matter
    model.double().train()
    return model


@pytest.mark.parametrize("mode", ["none", "causal_gi", "causal_gi_gonly", "causal_shift", "causal_shift_g"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_row_equals_its_unpadded_twin(mode, side):
    """Two whole segments of padding (8 tokens each): the real 16 tokens must give the logits of the same 16 tokens
    run alone as 2 segments of 8, in every causal mode — G pools only the valid segments' slots. Positions count
    from the first real token, as generation does (RoPE's fp32 tables make shifted positions differ at ~1e-8)."""
    model = _padding_model(mode)
    x = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(8))
    pad = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(9))  # arbitrary padded content
    padded = torch.cat([pad, x], 1) if side == "left" else torch.cat([x, pad], 1)
    mask = torch.cat([torch.zeros(1, 16), torch.ones(1, 16)], 1) if side == "left" else torch.cat(
        [torch.ones(1, 16), torch.zeros(1, 16)], 1)
    batch = torch.cat([padded, torch.randint(0, 97, (1, 32))])  # beside an unpadded row, as in a real batch
    patch_attention(model, HiCICore(num_segments=4, causal_mode=mode))
    mask = torch.cat([mask, torch.ones(1, 32)]).long()
    got = model(input_ids=batch, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits[:1]
    got = got[:, 16:] if side == "left" else got[:, :16]
    patch_attention(model, HiCICore(num_segments=2, causal_mode=mode))
    twin = model(input_ids=x).logits
    torch.testing.assert_close(got, twin, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("mode", ["none", "causal_shift_g"])
def test_padding_inside_a_segment_does_not_reach_the_valid_tokens(mode):
    model = _padding_model(mode)
    patch_attention(model, HiCICore(num_segments=4, causal_mode=mode))
    x = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(10))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[0, 29:] = 0  # right padding inside the last segment
    mask[1, :3] = 0  # left padding inside the first
    y = x.clone()
    y[mask == 0] = (y[mask == 0] + 1) % 97
    a, b = model(input_ids=x, attention_mask=mask).logits, model(input_ids=y, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=1e-10, rtol=1e-10)
    assert torch.isfinite(a).all()


def test_token_validity_reads_every_mask_form():
    from lightning_modules.hici.hici_attention import token_validity

    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    as_bool = (causal & pad.bool()[:, None, :])[:, None]  # what sdpa layers get
    as_float = torch.zeros(2, 1, 5, 5).masked_fill(~as_bool, torch.finfo(torch.float32).min)  # eager
    for mask in (pad, as_bool, as_float):
        assert torch.equal(token_validity(mask, 5), pad.bool())
    assert token_validity(None, 5) is None and token_validity(torch.ones(2, 5), 5) is None


def test_training_loss_ignores_padding():
    """A padded batch's loss is the loss over its valid tokens only: equal to the unpadded twin's."""
    m = _module()
    m.model.double()
    x = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(11))
    padded = torch.cat([x, torch.randint(0, 97, (1, 64))], 1)
    mask = torch.cat([torch.ones(1, 64), torch.zeros(1, 64)], 1).long()
    m.model.train()
    loss = m.compute_loss({"input_ids": padded, "labels": padded, "attention_mask": mask})
    m.hici_cfg["num_segments"] = 2
    for attn in [a for a in m.model.modules() if hasattr(a, "_paperlab_core")]:
        attn._paperlab_core.num_segments = 2
    twin = m.compute_loss({"input_ids": x, "labels": x})
    assert loss.item() == pytest.approx(twin.item(), rel=1e-9)


def _stats_reference(x, keep=None):
    """fp64 statistics of the slots of the kept segments, pooled over segments 0..i, by the textbook formulas."""
    b, s_, m, h = x.shape
    keep = torch.ones(b, s_, dtype=torch.bool) if keep is None else keep
    out = torch.zeros(b, s_, 5, h, dtype=torch.float64)
    for bi in range(b):
        for i in range(s_):
            pooled = x[bi, : i + 1][keep[bi, : i + 1]].reshape(-1, h).double()
            if len(pooled):
                mean = pooled.mean(0)
                out[bi, i] = torch.stack([mean, pooled.amax(0), pooled.amin(0),
                                          pooled.std(0, unbiased=False).clamp_min(1e-6), mean / mean.norm()])
    return out


def test_slot_statistics_against_formula():
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    ref = _stats_reference(x)
    torch.testing.assert_close(slot_statistics(x, cumulative=True).double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(slot_statistics(x, cumulative=False).double(), ref[:, -1], atol=1e-5, rtol=1e-5)
    keep = torch.tensor([[False, True, True], [True, False, True]])  # wholly padded segments are left out
    ref = _stats_reference(x, keep)
    torch.testing.assert_close(slot_statistics(x, True, keep).double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(slot_statistics(x, False, keep).double(), ref[:, -1], atol=1e-5, rtol=1e-5)


def test_slot_statistics_std_is_precise_under_a_large_offset():
    """slots = 10 + 0.01·N(0,1): the one-pass E[x²] − E[x]² in fp32 is off by ~30% here; two-pass is not."""
    g = torch.Generator().manual_seed(0)
    x = (10 + 0.01 * torch.randn(2, 4, 8, 64, generator=g, dtype=torch.float64))
    ref = _stats_reference(x)[:, :, 3]
    for cumulative in (True, False):
        got = slot_statistics(x.float(), cumulative)[..., 3, :].double()
        want = ref if cumulative else ref[:, -1]
        assert ((got - want).abs() / want).max() < 1e-3
    flat = x.float().reshape(2, 32, 64)
    one_pass = ((flat * flat).mean(1) - flat.mean(1) ** 2).clamp_min(0).sqrt().double()
    assert ((one_pass - ref[:, -1]).abs() / ref[:, -1]).max() > 1e-2  # what the old form gave: the test can fail


@pytest.mark.parametrize("cumulative", [True, False])
def test_statistics_gradients_are_finite_on_identical_slots_and_a_constant_segment(cumulative):
    """The NaN of hici_tiny: sqrt of a variance that is exactly 0 has a 0·∞ backward. Every statistic's gradient,
    on identical slots and through the whole local→global path on a constant segment, must be finite."""
    slots = torch.full((1, 4, 8, 16), 0.5, requires_grad=True)
    stats = slot_statistics(slots, cumulative)
    for j in range(5):
        (g,) = torch.autograd.grad(stats[..., j, :].sum(), slots, retain_graph=True)
        assert torch.isfinite(g).all(), j
    torch.manual_seed(0)
    local, glob = LocalConstructor(16, 8, 8, 2), GlobalIntegrator(16, 2, 4, 8, 2)
    x = torch.ones(1, 4, 6, 16)  # every segment constant: identical slots within and across segments
    st = slot_statistics(local(x), cumulative)
    assert (st[..., 3, :] == 1e-6).all()  # the std floor is what is reached
    glob(st.reshape(-1, 5, 16)).sum().backward()
    params = [*local.parameters(), *glob.parameters()]
    assert all(torch.isfinite(p.grad).all() for p in params)
    assert any(p.grad.abs().sum() > 0 for p in local.parameters())


def spec_params_per_layer(H, M=8, db=512, c=128, d=512, K=4, bias=False):
    """The spec's modules, counted by hand (nn.Linear with or without bias, LayerNorm with affine)."""
    local = M * H + 3 * (H * db + db * bias) + (db * H + H * bias)
    glob = ((H * c + c * bias) + 2 * c + (c * d + d * bias) + 2 * d + K * d + 4 * (d * d + d * bias)
            + (d * H + H * bias) + 1)
    return local, glob


def test_added_parameters_llama2_7b_on_meta(capsys):
    from omegaconf import OmegaConf

    from lightning_modules.common.backbone import build_backbone, count_parameters
    from tests.helpers import compose

    cfg = compose("hici_llama7b")
    spec = OmegaConf.to_container(cfg.backbone, resolve=True)
    model = build_backbone(spec, meta=True)
    base = count_parameters(model)
    attach_hici(model, OmegaConf.to_container(cfg.model.hici, resolve=True))
    added = count_parameters(model) - base
    local, glob = spec_params_per_layer(4096)
    assert added == 32 * (local + glob)
    assert 8.4e6 < local < 8.45e6 and 3.7e6 < glob < 3.8e6  # the spec's ~8.4M + ~3.7M per layer
    with capsys.disabled():
        print(f"\nHiCI on LLaMA-2-7B: +{local / 1e6:.3f}M local +{glob / 1e6:.3f}M global per layer, "
              f"+{added / 1e6:.1f}M = {100 * added / base:.2f}% of the base "
              f"({100 * added / (base + added):.2f}% of the adapted model)")
    assert 5.6 < 100 * added / base < 5.9
    from lightning_modules.hici.hici_attention import global_integrator_params, local_constructor_params

    for bias in (False, True):
        assert local_constructor_params(4096, 8, 512, bias) + global_integrator_params(4096, 4, 128, 512, bias) == sum(
            spec_params_per_layer(4096, bias=bias))
    with_bias = LocalConstructor(64, 8, 32, 4, bias=True), GlobalIntegrator(64, 4, 8, 32, 4, bias=True)
    assert sum(p.numel() for m in with_bias for p in m.parameters()) == sum(
        spec_params_per_layer(64, M=8, db=32, c=8, d=32, K=4, bias=True))


def test_rope_factor_is_ceil_of_target_over_original():
    assert rope_factor(16384, 4096) == 4 and rope_factor(100_000, 4096) == 25 and rope_factor(49152, 40960) == 2
    assert rope_factor(None, 4096) == 1 and rope_factor(2048, 4096) == 1


def test_hici_clip_touches_hici_gradients_only():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 4.0]), torch.full((4,), 10.0)
    norm = clip_hici_gradients([a], 0.3)
    assert norm == pytest.approx(5.0)
    assert a.grad.norm().item() == pytest.approx(0.3, rel=1e-4)
    assert torch.equal(b.grad, torch.full((4,), 10.0))


def _module(attention="hici", **kw):
    spec = dict(family="llama", pretrained=None, dtype="float32", attn_implementation="sdpa",
                config=dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    m = HiCILongContextLM(spec, attention=attention, hici=TINY, rope=dict(target_length=128), **kw)
    m.configure_model()
    return m


def test_trainable_set_and_param_groups():
    m = _module()
    names = {n for n, p in m.model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in names) and any("embed_tokens" in n for n in names)
    assert any("input_layernorm" in n for n in names) and any("local_constructor" in n for n in names)
    assert not any(n.endswith("q_proj.base_layer.weight") or "mlp" in n for n in names)  # frozen base weights
    base, hici = m.param_groups()
    assert hici["lr"] == 2e-4 and "lr" not in base
    assert sum(p.numel() for p in hici["params"]) == m.parameter_counts()["params/hici"]
    assert m.plain_model().config.rope_parameters["factor"] == 2.0  # ceil(128 / 64)


def test_full_mode_exports_a_plain_transformers_model(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    m = _module()
    opt = torch.optim.AdamW([p for p in m.model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randint(0, 97, (2, 128), generator=torch.Generator().manual_seed(6))
    for _ in range(2):  # move LoRA B away from zero, embeddings and norms away from their init
        opt.zero_grad()
        m.compute_loss({"input_ids": x, "labels": x}).backward()
        opt.step()
    m.model.eval()
    with torch.no_grad(), attention_enabled(m.model, False):
        ref = m.model(input_ids=x).logits  # LoRA unmerged, plain attention
    with torch.no_grad():  # eval_mode=hici prefill: one segment (eval_segments=1), causal_shift_g gives it no prefix
        hici_out = m.model(input_ids=x).logits
        m.model.train()
        trained_pattern = m.model(input_ids=x).logits  # 4 segments, G_{i-1} prefixes
        m.model.eval()
    m.full_model().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is LlamaForCausalLM
    assert not any("local_constructor" in n or "lora" in n for n, _ in loaded.named_parameters())
    assert loaded.config.rope_parameters["rope_type"] == "linear"
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hici_out, ref, atol=1e-5, rtol=1e-5)  # one causal segment = plain attention
    assert (trained_pattern - ref).abs().max() > 1e-2


def test_bad_switches_name_the_fix():
    with pytest.raises(ValueError, match="causal_mode"):
        HiCICore(causal_mode="future")
    with pytest.raises(ValueError, match="model.attention"):
        HiCILongContextLM({"family": "llama"}, attention="sparse")
    with pytest.raises(ValueError, match="unknown keys"):
        HiCILongContextLM({"family": "llama"}, hici={"slots": 3})
    with pytest.raises(ValueError, match="s2.shift"):
        s2_attention(*(torch.zeros(1, 2, 8, 4) for _ in range(3)), shift="wrap")


# --- end to end ----------------------------------------------------------------------------------------------------
# the experiment as configured, shrunk to fit the default suite's budget: 256-token blocks with the native context
# declared as 64, so position interpolation (factor 4), HiCI's 4 segments and S²-Attn's groups all still act
SMOKE = ("debug=smoke", "data.seq_len=256", "model.rope.original_length=64", "model.evaluation.ppl_lengths=[128,256]",
         "model.evaluation.ppl_max_tokens=1024", "model.evaluation.passkey_lengths=[128]",
         "model.evaluation.passkey_samples=1", "data.max_val_sequences=4")


@pytest.mark.parametrize("experiment", ["hici_tiny", "longlora_tiny"])
def test_tiny_experiment_end_to_end(experiment, tmp_path, tiny_lm_dir):
    import csv

    from tests.helpers import run_experiment

    value, metrics = run_experiment(experiment, tmp_path, overrides=SMOKE)
    assert metrics["status"] == "ok" and metrics["global_step"] == 20 and math.isfinite(value)
    rows = list(csv.DictReader(open(tmp_path / "csv" / "metrics.csv")))
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(val) == 2 and val[-1] < val[0]  # validation loss falls while it trains
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert state["global_step"] == 20
    assert any("lora_A" in k for k in state["state_dict"])
    # the long-context figures, recomputed independently from the exported `full` model: PPL and passkey in
    # eval_mode=full are those of the plain transformers model with LoRA merged
    want = full_model_figures(tmp_path, SMOKE, experiment)
    assert {k: metrics["results"][k] for k in want} == pytest.approx(want, rel=1e-4)


def full_model_figures(run_dir, overrides, experiment, ppl_lengths=(128, 256), passkey_length=128) -> dict:
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from datamodules.synthetic import passkey_sample
    from lightning_modules.common.evaluation import greedy_generate, perplexity, string_match_part
    from tests.helpers import compose

    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf_full").eval()
    tok = AutoTokenizer.from_pretrained(run_dir / "hf_full")
    dm = instantiate(compose(experiment, list(overrides)).data, _convert_="all")
    tokens = dm.eval_tokens()[:1024]
    out = {f"ppl@{n}": perplexity(model, tokens, n, stride=n // 4, batch_size=1)["ppl"] for n in ppl_lengths}
    s = passkey_sample(tok, passkey_length, seed=10_000)
    out[f"passkey@{passkey_length}"] = string_match_part(greedy_generate(model, tok, [s["prompt"]], 8)[0], [s["answer"]])
    return out


def test_cached_generation_through_the_patch_matches_the_plain_model():
    """Prefill runs the core, decoding with a KV cache falls back to the layer's attention: with one segment and
    causal_shift_g (eval_segments=1: no prefix) greedy decoding equals the unpatched model's, token for token."""
    model = tiny_model("qwen3", dtype=torch.float32)
    x = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = model.generate(input_ids=x, **kw)
    attach_hici(model, {**TINY, "local_slots": 4, "global_slots": 2, "gate_init": 0.1})
    patch_attention(model, HiCICore(num_segments=4, causal_mode="causal_shift_g", eval_segments=1))
    model.eval()
    assert torch.equal(model.generate(input_ids=x, **kw), ref)


def test_passkey_mix_plants_answers_at_the_rate_asked(tiny_tokenizer):
    import numpy as np

    from lightning_modules.hici.data import PasskeyMix
    from datamodules.text import PackedTokens

    base = PackedTokens(np.arange(256 * 40, dtype=np.int64) % 500, 256)
    mix = PasskeyMix(base, tiny_tokenizer, fraction=0.3, seed=0)
    picked = [i for i in range(len(mix)) if mix.is_passkey(i)]
    assert 4 <= len(picked) <= 20
    item = mix[picked[0]]
    text = tiny_tokenizer.decode(item["input_ids"])
    key = text.split("The pass key is ")[1][:5]
    assert key.isdigit() and text.count(key) == 3  # planted twice, answered once after the question
    j = next(i for i in range(len(mix)) if not mix.is_passkey(i))
    assert torch.equal(mix[j]["input_ids"], base[j]["input_ids"])  # the rest are the packed LM blocks


def test_sharded_perplexity_sums_to_the_whole_with_equal_forward_counts():
    """What the distributed evaluation relies on: the shards' NLL and token sums add up to the unsharded figure, and
    every rank makes the same number of forward passes (a rank that runs out scores a dummy batch)."""
    from lightning_modules.common.evaluation import perplexity

    model = tiny_model("llama")
    tokens = torch.randint(0, 97, (200,), generator=torch.Generator().manual_seed(12))
    whole = perplexity(model, tokens, 32, stride=8, batch_size=2)
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    parts = []
    for rank in range(3):
        calls.clear()
        parts.append((perplexity(model, tokens, 32, stride=8, batch_size=2, shard=(rank, 3)), len(calls)))
    hook.remove()
    assert len({n for _, n in parts}) == 1  # equal forward counts
    assert sum(p["tokens"] for p, _ in parts) == whole["tokens"] == 199
    assert sum(p["nll"] for p, _ in parts) == pytest.approx(whole["nll"], rel=1e-12)
