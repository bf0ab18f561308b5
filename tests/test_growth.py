"""Growth of MoE checkpoints (lightning_modules/growth/operators.py, lightning_modules/growth/): index maps, function
preservation of width growth (α = 0) and of depth growth with zerofy_output, the KV cache and save/reload of a grown
model, parameter counts against the formula, the norm seam of stacking, symmetry breaking by the noise, bad input,
snapshots, and growth_tiny end to end."""
import copy

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          OlmoeConfig, OlmoeForCausalLM)

from lightning_modules.growth.operators import (depth_index_map, expert_order, grow_depth, grow_width,
                                             layer_norm_profile, parameter_counts)
from lightning_modules.growth import GrowthModule, chinchilla_flops

V, H, I, L, E, K = 64, 32, 48, 3, 4, 2  # noqa: E741


def mixtral(dtype=torch.float64, seed=0, layers=L):
    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=K, bos_token_id=0, eos_token_id=0,
                        pad_token_id=1, experts_implementation="eager")  # grouped_mm has no fp64
    model = MixtralForCausalLM(cfg).to(dtype).eval()
    _spread_router(model)
    return model


def olmoe(seed=0):
    torch.manual_seed(seed)
    cfg = OlmoeConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, num_experts=E, num_experts_per_tok=K, bos_token_id=0, eos_token_id=0,
                      pad_token_id=1, experts_implementation="eager")
    model = OlmoeForCausalLM(cfg).double().eval()
    _spread_router(model)
    return model


@torch.no_grad()
def _spread_router(model):
    """Router rows far apart (a random init's near-ties would make top-k a coin flip at fp rounding level)."""
    for layer in model.model.layers:
        layer.mlp.gate.weight.normal_(0, 0.5)


def tokens(n=2, t=12, seed=1):
    return torch.randint(2, V, (n, t), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(x, use_cache=False).logits


# --- depth: index maps ----------------------------------------------------------------------------------------
def test_depth_index_maps_interposition_and_stacking_with_ignored_ends():
    assert depth_index_map(4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert depth_index_map(4, "stack") == [0, 1, 2, 3, 0, 1, 2, 3]
    assert depth_index_map(5, ignore_first=1, ignore_last=1) == [0, 1, 1, 2, 2, 3, 3, 4]
    assert depth_index_map(5, "stack", ignore_first=1, ignore_last=1) == [0, 1, 2, 3, 1, 2, 3, 4]
    assert depth_index_map(3, factor=3, ignore_last=2) == [0, 0, 0, 1, 2]
    assert depth_index_map(3, "stack", factor=3, ignore_first=1) == [0, 1, 2, 1, 2, 1, 2]
    assert expert_order(3) == [0, 1, 2, 0, 1, 2] and expert_order(3, placement="interleave") == [0, 0, 1, 1, 2, 2]


def test_copied_layers_land_where_the_map_says_and_layer_idx_is_renumbered():
    src = mixtral()
    src.config.layer_types = [f"type{i}" for i in range(L)]  # as hybrid models (sliding/full) carry
    for method, expected in (("interposition", [0, 0, 1, 1, 2, 2]), ("stack", [0, 1, 2, 0, 1, 2])):
        g = copy.deepcopy(src)
        assert grow_depth(g, method) == expected
        assert g.config.num_hidden_layers == 6 and len(g.model.layers) == 6
        assert g.config.layer_types == [f"type{i}" for i in expected]
        for i, s in enumerate(expected):
            torch.testing.assert_close(g.model.layers[i].self_attn.q_proj.weight, src.model.layers[s].self_attn.q_proj.weight,
                                       rtol=0, atol=0)
            assert g.model.layers[i].self_attn.layer_idx == i
        assert g.model.layers[0] is not g.model.layers[expected.index(0, 1)]  # a copy, not a shared module


# --- function preservation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("build", [mixtral, olmoe], ids=["mixtral-renormalised", "olmoe-not-renormalised"])
@pytest.mark.parametrize("placement", ["append", "interleave"])
def test_width_growth_at_alpha_zero_preserves_the_logits_and_moves_them_by_order_alpha(build, placement):
    src = build()
    x = tokens()
    ref = logits(src, x)
    g = copy.deepcopy(src)
    grow_width(g, alpha=0.0, placement=placement)
    assert g.model.layers[0].mlp.gate.top_k == 2 * K and g.config.num_experts_per_tok == 2 * K
    assert g.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 2 * E
    # exact in fp64 up to the router's softmax, which transformers computes in fp32
    torch.testing.assert_close(logits(g, x), ref, rtol=0, atol=1e-6)
    moved = []
    for alpha in (1e-2, 1e-3):
        g = copy.deepcopy(src)
        grow_width(g, alpha=alpha, placement=placement)
        moved.append((logits(g, x) - ref).abs().max().item())
    assert moved[0] > 1e-5                     # not preserved with noise
    assert 4 < moved[0] / moved[1] < 25        # linear in alpha: O(alpha)


def test_depth_growth_preserves_the_logits_with_zerofy_output_only():
    src = mixtral()
    x = tokens()
    ref = logits(src, x)
    for method in ("interposition", "stack"):
        g = copy.deepcopy(src)
        grow_depth(g, method, zerofy_output=True)
        torch.testing.assert_close(logits(g, x), ref, rtol=0, atol=1e-12)
        g = copy.deepcopy(src)
        grow_depth(g, method)
        assert (logits(g, x) - ref).abs().max() > 1e-3  # a pre-LN block applied twice is another function


def _halves_apart(model, scale=4.0):
    """The up half of every expert's fused gate_up ``scale`` x the gate half: the three σ choices then differ."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj[:, I:] *= scale
    return model


@pytest.mark.parametrize("sigma_over", ["expert", "matrix", "tensor"])
def test_noise_sigma_is_the_releases_fused_expert_tensor_by_default(sigma_over):
    """expert (default, the release's per-expert fc1): one σ over the fused gate|up of the copied expert; matrix
    (ours): σ of the gate and up halves separately; tensor: of all experts together. Only copies get noise."""
    src = _halves_apart(mixtral())
    g = copy.deepcopy(src)
    grow_width(g, alpha=0.5, seed=3, **({} if sigma_over == "expert" else {"sigma_over": sigma_over}))
    w, w0 = g.model.layers[0].mlp.experts.gate_up_proj, src.model.layers[0].mlp.experts.gate_up_proj
    d, d0 = g.model.layers[0].mlp.experts.down_proj, src.model.layers[0].mlp.experts.down_proj
    torch.testing.assert_close(w[:E], w0, rtol=0, atol=0)  # originals untouched
    torch.testing.assert_close(d[:E], d0, rtol=0, atol=0)
    for e in range(E):
        for half in (slice(0, I), slice(I, 2 * I)):  # gate, up
            sigma = {"expert": w0[e], "matrix": w0[e, half], "tensor": w0}[sigma_over].std()
            noise_std = (w[E + e, half] - w0[e, half]).std()
            assert abs(noise_std / (0.5 * sigma) - 1) < 0.1
        sigma = (d0 if sigma_over == "tensor" else d0[e]).std()
        assert abs((d[E + e] - d0[e]).std() / (0.5 * sigma) - 1) < 0.1


def test_stacking_with_factor_above_two_follows_the_releases_passes():
    """The release's stack: [0, n − ignore_last) once, then [ignore_first, n) in each of the factor − 1 later passes."""
    assert depth_index_map(4, "stack", factor=3, ignore_first=1, ignore_last=1) == [0, 1, 2, 1, 2, 3, 1, 2, 3]
    assert depth_index_map(4, "stack", factor=3, ignore_last=2) == [0, 1, 0, 1, 2, 3, 0, 1, 2, 3]
    assert depth_index_map(5, "stack", factor=2, ignore_first=1, ignore_last=1) == [0, 1, 2, 3, 1, 2, 3, 4]  # as before
    src = mixtral(layers=4)
    x = tokens()
    g = copy.deepcopy(src)
    index = grow_depth(g, "stack", factor=3, ignore_first=1, ignore_last=1, zerofy_output=True)
    assert index == [0, 1, 2, 1, 2, 3, 1, 2, 3] and g.config.num_hidden_layers == 9
    # a layer's first occurrence is its original (l4 first appears in the second pass): still function-preserving
    torch.testing.assert_close(logits(g, x), logits(src, x), rtol=0, atol=1e-12)


def test_weight_multiplier_scales_every_tensor_of_the_grown_layers_as_the_release():
    src = mixtral()
    m = 0.5
    g = copy.deepcopy(src)
    index = grow_depth(g, weight_multiplier=m, ignore_last=1)  # default scope: all (the release)
    src_sd, g_sd = src.state_dict(), g.state_dict()
    for new, old in enumerate(index):  # every tensor of every grown layer, originals and the ignored one included
        for key, t in src.model.layers[old].state_dict().items():
            torch.testing.assert_close(g_sd[f"model.layers.{new}.{key}"], m * t, rtol=0, atol=0)
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        torch.testing.assert_close(g_sd[key], src_sd[key], rtol=0, atol=0)
    # ours: only the copies' output projections scale, the originals keep their weights
    g = copy.deepcopy(src)
    grow_depth(g, weight_multiplier=m, multiplier_scope="copy_outputs")
    g_sd = g.state_dict()
    for new, old in enumerate(depth_index_map(L)):
        copied = new % 2 == 1
        for key, t in src.model.layers[old].state_dict().items():
            out = key.endswith(("o_proj.weight", "down_proj"))
            torch.testing.assert_close(g_sd[f"model.layers.{new}.{key}"], (m if copied and out else 1.0) * t,
                                       rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"multiplier_scope='both': choose one of all, copy_outputs"):
        grow_depth(copy.deepcopy(src), multiplier_scope="both")


# --- the grown model as a transformers model --------------------------------------------------------------------
def test_grown_model_generates_with_cache_as_without_and_survives_save_and_reload(tmp_path):
    g = mixtral(torch.float32)
    grow_depth(g)
    grow_width(g, alpha=0.01)
    x = tokens(1, 6)
    g.generation_config.eos_token_id = None  # always 8 new tokens
    with torch.no_grad():
        cached = g.generate(x, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=1)
        seq = x
        for _ in range(8):  # greedy without a cache: the full forward each step
            seq = torch.cat([seq, logits(g, seq)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(cached, seq)
    g.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (back.config.num_hidden_layers, back.config.num_local_experts, back.config.num_experts_per_tok) == (2 * L, 2 * E, 2 * K)
    torch.testing.assert_close(logits(back, x), logits(g, x))


def test_parameter_counts_under_zero3_partitioning_are_the_full_counts():
    """DeepSpeed ZeRO-3 leaves each rank an empty local tensor and the full size in ``ds_numel`` / ``ds_shape``: the
    counts (and the router's expert count, which divided by zero in the growth dry run) come out as unpartitioned."""
    from lightning_modules.common.backbone import count_parameters

    model = olmoe()
    want, want_total = parameter_counts(model), count_parameters(model)
    for p in model.parameters():
        p.ds_numel, p.ds_shape = p.numel(), p.shape
        p.data = torch.empty(0, dtype=p.dtype)
    assert sum(p.numel() for p in model.parameters()) == 0
    assert parameter_counts(model) == want and count_parameters(model) == want_total


def test_parameter_counts_after_growth_match_the_formula():
    src = mixtral(torch.float32)
    kv = 2 * (H // 4)  # two KV heads of head_dim H/4
    attn = H * H + 2 * H * kv + H * H
    per_layer = lambda experts: attn + 2 * H + experts * H + experts * 3 * I * H  # noqa: E731  norms, router, experts
    rest = 2 * V * H + H  # embeddings, untied head, final norm
    assert parameter_counts(src) == {"total": rest + L * per_layer(E), "active": rest + L * (per_layer(E) - (E - K) * 3 * I * H)}
    g = copy.deepcopy(src)
    grow_depth(g, ignore_first=1)
    grow_width(g)
    layers = 2 * L - 1
    counts = parameter_counts(g)
    assert counts["total"] == rest + layers * per_layer(2 * E) == sum(p.numel() for p in g.parameters())
    assert counts["active"] == rest + layers * (per_layer(2 * E) - (2 * E - 2 * K) * 3 * I * H)
    assert chinchilla_flops(counts["active"]) == 120 * counts["active"] ** 2


def test_stacking_makes_a_norm_seam_and_interposition_does_not():
    src = mixtral(torch.float32, layers=6)
    planted = [0.02 * (1 + 0.2 * i) for i in range(6)]  # norms growing with depth by construction
    with torch.no_grad():
        for layer, target, now in zip(src.model.layers, planted, layer_norm_profile(src)):
            for p in layer.parameters():
                if p.dim() >= 2:
                    p.mul_(target / now)
    torch.testing.assert_close(layer_norm_profile(src), planted)
    step = 0.02 * 0.2
    for method in ("interposition", "stack"):
        g = copy.deepcopy(src)
        grow_depth(g, method)
        jumps = torch.tensor(layer_norm_profile(g)).diff()
        if method == "interposition":
            assert jumps.abs().max() <= step * (1 + 1e-4) and (jumps >= -1e-7).all()  # smooth, still monotone
        else:
            assert jumps[5] < -4.9 * step and jumps.abs().argmax() == 5  # the cliff, at the seam l6 -> l1


# --- symmetry breaking -------------------------------------------------------------------------------------------
def _train(model, steps=3, lr=0.5):
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for s in range(steps):
        x = tokens(4, 12, seed=10 + s)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("alpha", [0.0, 0.01])
def test_duplicated_experts_stay_identical_under_sgd_only_without_noise(alpha):
    g = mixtral()
    grow_width(g, alpha=alpha)
    blk = g.model.layers[1].mlp
    before = blk.experts.gate_up_proj.detach().clone()
    pair_gap = lambda w: (w[:E] - w[E:]).abs().max().item()  # noqa: E731
    gap0 = pair_gap(blk.experts.gate_up_proj)
    _train(g)
    assert not torch.equal(blk.experts.gate_up_proj, before)  # trained
    if alpha == 0:
        for w in (blk.experts.gate_up_proj, blk.experts.down_proj, blk.gate.weight):  # equal up to fp64 round-off
            assert pair_gap(w) < 1e-12
    else:  # different gradients: the gap itself moves
        delta = blk.experts.gate_up_proj.detach() - before
        assert (delta[:E] - delta[E:]).abs().max() > 1e-4 * gap0


# --- bad input ------------------------------------------------------------------------------------------------
def test_bad_input_is_one_line_naming_the_fix():
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                                         num_attention_heads=4))
    with pytest.raises(ValueError, match=r"width growth needs an MoE .*growth.width.enabled=false"):
        grow_width(dense)
    with pytest.raises(ValueError, match=r"ignore_first \+ ignore_last = 2 \+ 1 leaves none of the 3 layers"):
        grow_depth(mixtral(), ignore_first=2, ignore_last=1)
    for bad in (1, 1.5):
        with pytest.raises(ValueError, match=r"model.growth.depth.factor=.*use an integer >= 2"):
            depth_index_map(4, factor=bad)
    spec = {"family": "mixtral", "pretrained": None, "config": {"num_hidden_layers": 4, "num_local_experts": 4}}
    on = {"enabled": True}
    with pytest.raises(ValueError, match=r"model.growth.source is missing: set backbone.pretrained="):
        GrowthModule(spec, {"source": None, "depth": on, "width": on})
    with pytest.raises(ValueError, match=r"model.growth.width.factor=3.0: use an integer >= 2"):
        GrowthModule(spec, {"source": "x", "depth": on, "width": {"enabled": True, "factor": 3.0}})
    with pytest.raises(ValueError, match=r"leaves none of the 4 layers to copy"):
        GrowthModule(spec, {"source": "x", "depth": {"enabled": True, "ignore_first": 4}})
    with pytest.raises(ValueError, match=r"width growth needs an MoE source"):
        GrowthModule({"family": "llama", "config": {"num_hidden_layers": 4}}, {"source": "x", "width": on})


# --- end to end ---------------------------------------------------------------------------------------------------
def test_snapshots_at_steps_are_written_during_training(tmp_path):
    from safetensors.torch import load_file

    from tests.helpers import run_experiment

    run_experiment("growth_source_tiny", tmp_path, ["debug=smoke", "trainer.max_steps=4", "callbacks.export.at_steps=[0,2]"])
    w = {s: load_file(tmp_path / f"hf_model_step{s}" / "model.safetensors") for s in (0, 2)}
    final = load_file(tmp_path / "hf_model" / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(w[0][name], w[2][name]) and not torch.equal(w[2][name], final[name])
    assert not (tmp_path / "hf_model_step4").exists()


def test_accuracy_evaluation_of_a_grown_checkpoint_runs_the_release_suite_shape(tmp_path, tiny_lm_dir):
    """growth_eval_olmoe (the tables' accuracy columns) on a grown tiny Mixtral saved as a run's hf_model: zero-shot
    tasks and a few-shot one (MMLU's 5-shot slot) in one run, every task's accuracy and their average logged."""
    from transformers import AutoTokenizer

    from tests.helpers import run_experiment
    from tests.test_zero_shot import make_task

    suite = ["arc_challenge", "boolq", "hellaswag", "openbookqa", "winogrande", "mmlu"]
    assert composed_tasks() == (suite, {"mmlu": 5})  # the release's suite: MMLU 5-shot, the rest zero-shot
    torch.manual_seed(0)
    src = MixtralForCausalLM(MixtralConfig(vocab_size=2048, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=0,
                                           eos_token_id=0, pad_token_id=1))
    grow_depth(src)
    grow_width(src)
    hf_model = tmp_path / "grown" / "hf_model"
    src.save_pretrained(hf_model)
    AutoTokenizer.from_pretrained(tiny_lm_dir).save_pretrained(hf_model)  # an export holds its tokenizer
    tasks, _ = make_task(tmp_path, name="toy_zero", n=6, seed=1)
    make_task(tmp_path, name="toy_few", n=6, seed=2)
    (tasks / "toy_few.yaml").write_text((tasks / "toy_few.yaml").read_text() + "fewshot_split: test\n")
    value, metrics = run_experiment("growth_eval_olmoe", tmp_path / "run", overrides=(
        "backbone=tiny_mixtral", f"backbone.pretrained={hf_model}", "backbone.config.vocab_size=2048",
        "backbone.dtype=float32", "trainer=cpu", "model.tasks=[toy_zero,toy_few]", "~model.fewshot_per_task.mmlu",
        "+model.fewshot_per_task.toy_few=2", f"model.include_path={tasks}",
        "model.include_defaults=false", "model.batch_size=4"))
    assert metrics["status"] == "ok"
    assert metrics["results"]["n_shot"] == {"toy_zero": 0, "toy_few": 2}
    a, b = metrics["final"]["zero_shot/toy_zero/acc"], metrics["final"]["zero_shot/toy_few/acc"]
    assert value == pytest.approx((a + b) / 2)


def composed_tasks():
    from runner import compose

    cfg = compose("growth_eval_olmoe")
    return list(cfg.model.tasks), dict(cfg.model.fewshot_per_task)


def test_growth_tiny_grows_tiny_moe_and_trains(tmp_path, tiny_models):
    from tests.helpers import run_experiment

    # debug=smoke shortens training; the sequence length is this test's only other shrink
    value, metrics = run_experiment("growth_tiny", tmp_path, ["debug=smoke", "data.seq_len=64"])
    p = metrics["parameters"]
    src = AutoModelForCausalLM.from_pretrained(tiny_models["tiny-moe"])
    counts = parameter_counts(src)
    assert (p["growth/source_total"], p["growth/source_active"]) == (counts["total"], counts["active"])
    grown = copy.deepcopy(src)
    grow_depth(grown)
    grow_width(grown)
    assert p["params/total"] == parameter_counts(grown)["total"] and p["growth/active"] == parameter_counts(grown)["active"]
    assert p["growth/flops"] == 6 * p["growth/active"] * 20 * 8 * 64  # 20 steps x batch 8 x 64 tokens
    r = metrics["results"]  # depth first (interposition), then width (appended copies)
    assert r["depth_index"] == [0, 0, 1, 1, 2, 2, 3, 3] and r["expert_order"] == [0, 1, 2, 3] * 2
    assert len(r["norm_profile_source"]) == 4 and len(r["norm_profile_grown"]) == 8
    assert value == metrics["best"]["value"] and value < 8  # ln(2048) = 7.6 is a uniform guess


# --- configs ------------------------------------------------------------------------------------------------------
def test_scratch_baselines_have_the_grown_shape():
    from omegaconf import OmegaConf

    from lightning_modules.common.backbone import build_backbone
    from tests.helpers import compose

    for grown_exp, scratch_exp in (("growth_tiny", "growth_scratch_tiny"),
                                   ("growth_olmoe_depth_width", "growth_olmoe_scratch")):
        grown_cfg, scratch_cfg = compose(grown_exp), compose(scratch_exp)
        spec = OmegaConf.to_container(grown_cfg.backbone, resolve=True)
        model = build_backbone({**spec, "pretrained": None}, meta=True)  # the source's recorded shape
        g = grown_cfg.model.growth
        grow_depth(model, **{k: v for k, v in g.depth.items() if k != "enabled"})
        grow_width(model, **{k: v for k, v in g.width.items() if k != "enabled"})
        scratch = build_backbone(OmegaConf.to_container(scratch_cfg.backbone, resolve=True), meta=True)
        assert parameter_counts(scratch) == parameter_counts(model), scratch_exp
        assert scratch_cfg.trainer.max_steps == grown_cfg.trainer.max_steps  # same extra tokens
        assert "growth" not in scratch_cfg.model


def test_sunk_cost_sweep_grows_each_revision():
    from tests.helpers import compose

    cfg = compose("growth_olmoe_depth_width", ["+sweep=growth_sunk_cost"])
    sources = [s.strip() for s in cfg.hydra.sweeper.params["backbone.pretrained"].split(",")]
    assert len(sources) == 4 and sources[-1].endswith("OLMoE-1B-7B-0924")
    job = compose("growth_olmoe_depth_width", ["+sweep=growth_sunk_cost", f"backbone.pretrained={sources[0]}"])
    assert job.model.growth.source == sources[0] and job.model.growth.source_tokens is None
