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


@pytest.mark.parametrize("mode,leaks", [("causal_shift_g", False), ("causal_shift", False), ("none", True)])
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


def test_causal_gi_leaks_within_a_segment_only():
    model = tiny_model("llama")
    attach_hici(model, {**TINY, "local_slots": 4, "global_slots": 2, "gate_init": 0.1})
    model.double().train()
    patch_attention(model, HiCICore(num_segments=4, causal_mode="causal_gi"))
    x = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(3))
    a, b = _perturbed_logits(model, x, [23])  # last token of segment 2
    assert (a[:, :16] - b[:, :16]).abs().max() < 1e-12  # segments 0-1: G_i is cumulative, no cross-segment leak
    assert (a[:, 16:23] - b[:, 16:23]).abs().max() > 1e-6  # segment 2's earlier tokens see token 23 through L_2


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


def test_slot_statistics_against_formula():
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    flat = x.reshape(2, 12, 5)
    st = slot_statistics(x, cumulative=False)
    torch.testing.assert_close(st[:, 0].double(), flat.mean(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st[:, 3].double(), flat.std(1, unbiased=False), atol=1e-5, rtol=1e-5)
    cum = slot_statistics(x, cumulative=True)  # entry 1 pools segments 0..1
    torch.testing.assert_close(cum[:, 1, 1].double(), x[:, :2].reshape(2, 8, 5).amax(1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cum[:, 1, 3].double(), x[:, :2].reshape(2, 8, 5).std(1, unbiased=False), atol=1e-5, rtol=1e-5)


def spec_params_per_layer(H, M=8, db=512, c=128, d=512, K=4):
    """The spec's modules, counted by hand (nn.Linear with bias, LayerNorm with affine)."""
    local = M * H + 3 * (H * db + db) + (db * H + H)
    glob = (H * c + c) + 2 * c + (c * d + d) + 2 * d + K * d + 4 * (d * d + d) + (d * H + H) + 1
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
        print(f"\nHiCI on LLaMA-2-7B: +{added / 1e6:.1f}M = {100 * added / base:.2f}% of the base "
              f"({100 * added / (base + added):.2f}% of the adapted model)")
    assert 5.6 < 100 * added / base < 5.9


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
        hici_out = None
    with torch.no_grad():
        hici_out = m.model(input_ids=x).logits
    m.full_model().save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is LlamaForCausalLM
    assert not any("local_constructor" in n or "lora" in n for n, _ in loaded.named_parameters())
    assert loaded.config.rope_parameters["rope_type"] == "linear"
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, ref, atol=1e-4, rtol=1e-4)
    assert hici_out is not None


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
    res = metrics["results"]
    assert math.isfinite(res["ppl@128"]) and math.isfinite(res["ppl@256"]) and 0 <= res["passkey@128"] <= 1
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert state["global_step"] == 20
    assert any("lora_A" in k for k in state["state_dict"])
    assert (tmp_path / "hf_full" / "config.json").exists()


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

    from datamodules.long_context import PasskeyMix
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
