"""WaterSIC end to end on the cached tiny pretrained model: the experiment, the driver at 2/3/4 bits, and
sequential mode's first group equal to plain mode's."""
import copy
import math

import pytest
import torch

from tests.helpers import run_experiment


@pytest.fixture(scope="module")
def tiny_setup(tiny_lm_dir):
    from transformers import AutoModelForCausalLM

    from datamodules.common.tokenizer import load_tokenizer
    from datamodules.text import TextDataModule

    dm = TextDataModule(load_tokenizer(pretrained=str(tiny_lm_dir)), seq_len=128)
    dm.setup()
    calib = [{"input_ids": torch.stack([dm.train_set[i]["input_ids"] for i in range(8)])}]
    evals = {"input_ids": torch.stack([dm.val_set[i]["input_ids"] for i in range(32)])}  # enough tokens to order 3 vs 4 bits
    return AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir)).eval(), calib, evals


def test_watersic_tiny_smoke(tmp_path, tiny_lm_dir):
    from datamodules.common.corpus import embedded_documents

    held_out = tmp_path / "held_out.txt"
    held_out.write_text("\n".join(embedded_documents()[-40:]))
    value, metrics = run_experiment("watersic_tiny", tmp_path, ["debug=smoke", "model.n_calib=8", "model.with_limit=false",
                                                               f"+model.eval_sets.held={{files: {held_out}, max_windows: 2}}",
                                                               "model.eval_seq_len=128",
                                                               "model.finetune={epochs: 1, lr: 1.0e-3, lr_min: 1.0e-4, batch_size: 8, max_sequences: 16}"])
    assert metrics["status"] == "ok"
    final = metrics["final"]
    # the held-out set: its own perplexities and the quantized model's KL to the reference
    assert math.isfinite(final["eval/held/ppl"]) and final["eval/held/ppl_fp"] > 1 and final["eval/held/kl_bits"] > 0
    assert len(metrics["results"]["finetune"]["kl_nats_per_epoch"]) == 1  # WaterSIC-FT ran
    assert abs(final["quant/bits"] - 3.0) < 0.01          # global rate control lands on the budget
    assert final["quant/bits_column"] < final["quant/bits_pooled"]
    assert 0 < value == final["test/kl_bits"] < 0.1 and math.isfinite(final["test/ppl"])
    assert final["test/ppl"] > 0.99 * final["test/ppl_fp"]
    layers = metrics["results"]["layers"]
    assert len(layers) == 4 * 7 and not any("lm_head" in r["layer"] or "embed" in r["layer"] for r in layers)
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # task=test quantizes in place, writes no checkpoint


def test_driver_perplexity_rises_as_bits_fall(tiny_setup):
    from lightning_modules.watersic import WaterSIC
    from lightning_modules.common.quantize.driver import quantize_model
    from lightning_modules.common.quantize.module import nll_and_kl

    base, calib, evals = tiny_setup
    ppl, kl = {}, {}
    rates = {}
    for bits in (4, 3, 2):  # nominal r, no secant search (the search is tested on its own), to stay fast
        model = copy.deepcopy(base)
        rep = quantize_model(model, WaterSIC(rescalers=False, target_rate=False), calib, bits, with_limit=False, log=None)
        rates[bits] = rep["summary"]["bits"]
        nll_q, _, kl_sum, n_tok, n_pos = nll_and_kl(model, base, evals)
        ppl[bits], kl[bits] = math.exp(nll_q / n_tok), float(kl_sum / n_pos)
    assert rates[2] < rates[3] < rates[4]
    assert ppl[2] > ppl[3] > ppl[4] and kl[2] > kl[3] > kl[4] > 0


@pytest.mark.parametrize("rate_control", [True, False])
def test_driver_rate_control_charges_each_layer_its_actual_rate(tiny_setup, rate_control):
    """Under rate control each layer's target is the remaining budget per remaining weight (clamped to
    [0.05, 16]) and the quantizer is told so; without it every layer gets R and no flag."""
    from lightning_modules.common.quantize.driver import quantize_model
    from lightning_modules.watersic import WaterSIC

    class Recorder(WaterSIC):
        def quantize(self, weight, stats, rate, rate_control=False):
            calls.append((rate, rate_control))
            return super().quantize(weight, stats, rate, rate_control=rate_control)

    calls = []
    base, calib, _ = tiny_setup
    rep = quantize_model(copy.deepcopy(base), Recorder(rescalers=False, target_rate=False), calib, 2.5,
                         rate_control=rate_control, with_limit=False, log=None)
    sizes = [r["rows"] * r["cols"] for r in rep["layers"]]
    bits_left, weights_left = 2.5 * sum(sizes), sum(sizes)
    for (target, flag), row, size in zip(calls, rep["layers"], sizes):
        expected = min(16.0, max(0.05, bits_left / weights_left)) if rate_control else 2.5
        assert target == pytest.approx(expected, rel=1e-12) and flag is rate_control and row["target"] == target
        bits_left -= row["bits"] * size
        weights_left -= size
    assert len(calls) == 28 and (len({t for t, _ in calls}) > 1) is rate_control  # the budget moved the targets


def test_module_kl_matches_shared_evaluator(tiny_setup):
    from lightning_modules.common.evaluation import kl_bits_per_token
    from lightning_modules.common.quantize import RTN
    from lightning_modules.common.quantize.driver import quantize_model
    from lightning_modules.common.quantize.module import nll_and_kl

    base, calib, evals = tiny_setup
    model = copy.deepcopy(base)
    quantize_model(model, RTN(), calib, 2, with_limit=False, log=None)
    _, _, kl_sum, _, n_pos = nll_and_kl(model, base, evals)
    assert float(kl_sum / n_pos) == pytest.approx(kl_bits_per_token(model, base, evals["input_ids"]), rel=1e-4)


def test_sequential_first_group_equals_plain(tiny_setup):
    """The first group's inputs come from an unquantized prefix, so Qronos statistics reduce to plain ones there."""
    from lightning_modules.common.quantize import GPTQ
    from lightning_modules.common.quantize.driver import linear_groups, quantize_model

    base, calib, _ = tiny_setup
    calib = [{"input_ids": calib[0]["input_ids"][:2]}]
    first = [n for n, _ in linear_groups(base, calib[0])[0]]
    assert first == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    plain, seq = copy.deepcopy(base), copy.deepcopy(base)
    quantize_model(plain, GPTQ(), calib, 3, mode="plain", with_limit=False, log=None)
    rep = quantize_model(seq, GPTQ(), calib, 3, mode="sequential", reference=base, with_limit=False, log=None)
    mods_p, mods_s = dict(plain.named_modules()), dict(seq.named_modules())
    for name in first:
        assert torch.allclose(mods_p[name].weight, mods_s[name].weight)
    # later layers see the quantized model's inputs, so they differ
    assert not torch.equal(mods_p["model.layers.3.mlp.down_proj"].weight, mods_s["model.layers.3.mlp.down_proj"].weight)
    assert len(rep["layers"]) == 28


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gptq_tiny", "rtn_tiny"])
def test_baseline_tiny_experiments(tmp_path, tiny_lm_dir, name):
    value, metrics = run_experiment(name, tmp_path)
    final = metrics["final"]
    assert metrics["status"] == "ok" and final["quant/bits_cardinality"] == pytest.approx(3 + 16 / 128, abs=0.3)
    assert final["test/kl_bits"] > 0 and final["test/ppl"] > 0.99 * final["test/ppl_fp"]


@pytest.mark.parametrize("name", ["watersic_tiny", "gptq_tiny", "rtn_tiny", "watersic_llama32_1b", "watersic_llama2_7b",
                                  "watersic_llama3_8b", "watersic_llama3_70b", "watersic_qwen3_8b", "gptq_llama32_1b",
                                  "watersic_ft_llama32_1b"])
def test_experiments_compose_and_instantiate(name, tmp_path):
    from hydra.utils import instantiate

    from tests.helpers import compose

    cfg = compose(name, [], output_dir=tmp_path)
    module = instantiate(cfg.model, _convert_="all")  # checks the quantizer's keyword arguments; no backbone built
    assert module.model is None and cfg.task == "test"
    if not name.endswith("_tiny"):
        assert cfg.data.seq_len == 2048 and cfg.model.eval_sets.wikitext2.files.endswith("wiki.test.txt")
        # calibration: all of WikiText-2 train (the release's nsamples=None), none of it cut off for val/test
        assert cfg.model.n_calib is None and cfg.data.files.endswith("wiki.train.txt")
        assert cfg.data.val_fraction == cfg.data.test_fraction == 0.0
        assert cfg.model.eval_sets.wikitext2.join == "\n\n" and cfg.model.eval_sets.c4.max_windows == 256
        assert cfg.trainer.precision == "16-true"  # FP16, as the spec's reference perplexities
        assert cfg.model.mode == "sequential" and cfg.paper.name == "watersic" and cfg.backbone.dtype == "float16"
        if name.startswith("watersic"):  # the spec's best-run extras
            assert cfg.model.residual_compensation and cfg.model.attn_weighted_qkv == 0.01 and cfg.model.eps_search
        else:  # the fair baseline: rate-targeted Huffman-GPTQ
            assert module.quantizer.target_rate and module.quantizer.extra_bit


def test_null_n_calib_calibrates_on_the_whole_training_split():
    from types import SimpleNamespace

    from lightning_modules.common.quantize.module import QuantizeLMModule

    train = [{"input_ids": torch.full((8,), i)} for i in range(10)]
    module = QuantizeLMModule({"family": "llama"}, n_calib=None, calib_batch_size=4)
    module._trainer = SimpleNamespace(datamodule=SimpleNamespace(train_set=train))
    batches = module.calibration_batches()
    assert [len(b["input_ids"]) for b in batches] == [4, 4, 2]
    assert sorted(int(x) for b in batches for x in b["input_ids"][:, 0]) == list(range(10))  # every sequence once
    module.n_calib = 11
    with pytest.raises(ValueError, match="model.n_calib=11 but the training split holds 10 sequences"):
        module.calibration_batches()


@pytest.mark.parametrize("choice,cls,name", [("rtn", "RTN", "rtn"), ("gptq", "GPTQ", "gptq"),
                                             ("huffman_gptq", "GPTQ", "huffman_gptq"), ("watersic", "WaterSIC", "watersic")])
def test_quantizer_is_chosen_by_config_group(choice, cls, name, tmp_path):
    """``model/quantizer=<name>`` builds that class by ``_target_``; its settings are kept as plain hparams that rebuild it."""
    from hydra.utils import instantiate

    from tests.helpers import compose

    module = instantiate(compose("gptq_tiny", [f"model/quantizer={choice}"], output_dir=tmp_path).model, _convert_="all")
    assert type(module.quantizer).__name__ == cls and module.method == name
    rebuilt = instantiate(module.hparams["quantizer"])
    assert type(rebuilt) is type(module.quantizer) and vars(rebuilt) == vars(module.quantizer)


def test_default_quantizers_and_the_removed_method_key(tmp_path):
    from hydra.utils import instantiate

    from lightning_modules.common.quantize import GPTQ
    from lightning_modules.common.quantize.module import QuantizeLMModule
    from lightning_modules.watersic import WaterSIC, WaterSICModule
    from tests.helpers import compose

    assert isinstance(QuantizeLMModule({"family": "llama"}).quantizer, GPTQ)  # the common baseline, not a paper's
    assert isinstance(WaterSICModule({"family": "llama"}).quantizer, WaterSIC)
    cfg = compose("gptq_tiny", ["model.method=rtn"], output_dir=tmp_path)
    with pytest.raises(Exception) as info:
        instantiate(cfg.model, _convert_="all")
    cause = info.value.__cause__ or info.value  # Hydra wraps errors raised in a constructor
    assert isinstance(cause, ValueError) and str(cause) == "model.method=rtn is gone: choose the quantizer with model/quantizer=rtn"


def test_old_method_key_fails_on_the_command_line_with_one_line():
    import subprocess
    import sys

    from tests.helpers import ROOT

    out = subprocess.run([sys.executable, "run.py", "experiment=gptq_tiny", "model.method=rtn"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "model/quantizer=" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_eval_sets_join_wikitext_the_standard_way(tmp_path, tiny_tokenizer):
    """join="\n\n": every line (empty ones included) as one text, tokenized once; join=null: non-empty documents
    each followed by EOS; max_documents cuts the split; a set without files fails naming the key."""
    from lightning_modules.common.quantize.module import eval_set, eval_tokens

    lines = [" = Title = ", "", " First paragraph of the article .", "", " Second one , with @-@ tokens ."]
    path = tmp_path / "wiki.test.txt"
    path.write_text("\n".join(lines) + "\n")
    joined = eval_tokens(eval_set("w", files=str(path)), tiny_tokenizer)
    assert list(joined) == tiny_tokenizer("\n\n".join(lines))["input_ids"]
    per_doc = eval_tokens(eval_set("w", files=str(path), join=None), tiny_tokenizer)
    docs = [t for t in lines if t.strip()]
    assert int((per_doc == tiny_tokenizer.eos_token_id).sum()) == len(docs)
    two = eval_tokens(eval_set("w", files=str(path), join=" ", max_documents=2), tiny_tokenizer)
    assert list(two) == tiny_tokenizer(" ".join(lines[:2]))["input_ids"]
    with pytest.raises(ValueError, match="eval_sets.c4.files"):
        eval_set("c4", files=None)


def test_attention_weighted_and_residual_statistics(tiny_setup):
    """The driver's extras against explicit computations: token weights = attention received (mean over heads, summed
    over queries, mean 1); ε = 0 weights Σ_X by them alone, ε = 1 is the plain sequential statistics; Σ_ΔR,X̂ = E[(R − R̂)x̂ᵀ]
    with R the input of the norm before the layer's sub-block."""
    from lightning_modules.common.quantize.calibration import capture_inputs
    from lightning_modules.common.quantize.driver import WholeModelRunner, _sequential_stats, attention_token_weights

    base, calib, _ = tiny_setup
    batch = {"input_ids": calib[0]["input_ids"][:2, :32]}
    ref = copy.deepcopy(base)
    ref.set_attn_implementation("eager")
    probs = ref(**batch, output_attentions=True, use_cache=False).attentions[1].double()
    expect = probs.mean(1).sum(1)
    expect = expect / expect.mean()
    got = attention_token_weights(copy.deepcopy(base), "model.layers.1", batch)
    assert torch.allclose(got, expect, atol=1e-10) and float(got.mean()) == pytest.approx(1.0, abs=1e-12)

    model = copy.deepcopy(base)
    with torch.no_grad():
        for p in model.model.layers[0].parameters():
            p.add_(0.01 * torch.randn_like(p))
    mods, refs = dict(model.named_modules()), dict(base.named_modules())
    runner = WholeModelRunner(model, base, [batch])
    qkv = [(f"model.layers.1.self_attn.{p}_proj", mods[f"model.layers.1.self_attn.{p}_proj"]) for p in "qkv"]
    plain = _sequential_stats(runner, refs, qkv, [batch])
    zero = _sequential_stats(runner, refs, qkv, [batch], a_eps=0.0)
    one = _sequential_stats(runner, refs, qkv, [batch], a_eps=1.0)
    flat = lambda t: t.double().reshape(-1, t.shape[-1])
    x = flat(capture_inputs(base, refs[qkv[0][0]], batch))
    wts = attention_token_weights(base, "model.layers.1", batch).reshape(-1)
    assert torch.allclose(one.sigma_x, plain.sigma_x, atol=1e-12) and one.tokens == plain.tokens == 64
    assert torch.allclose(zero.sigma_x, (x * wts[:, None]).T @ x / wts.sum(), atol=1e-10)

    down = [("model.layers.1.mlp.down_proj", mods["model.layers.1.mlp.down_proj"])]
    st = _sequential_stats(runner, refs, down, [batch], residual=True)
    r = flat(capture_inputs(base, refs["model.layers.1.post_attention_layernorm"], batch))
    rh = flat(capture_inputs(model, mods["model.layers.1.post_attention_layernorm"], batch))
    xh = flat(capture_inputs(model, down[0][1], batch))
    assert torch.allclose(st.residual_cross, (r - rh).T @ xh / r.shape[0], atol=1e-10)
    assert st.residual_cross.abs().max() > 0 and _sequential_stats(runner, refs, down, [batch]).residual_cross is None


def test_extras_run_through_the_driver(tiny_setup):
    """All extras at once on the tiny model (2 golden-section steps): the ε found per q/k/v group is reported, zeroed
    rows are zero, and plain mode refuses the sequential-only extras in one line."""
    from lightning_modules.common.quantize.driver import quantize_model
    from lightning_modules.watersic import WaterSIC

    base, calib, _ = tiny_setup
    calib = [{"input_ids": calib[0]["input_ids"][:2, :32]}]
    model = copy.deepcopy(base)
    rep = quantize_model(model, WaterSIC(target_rate=False), calib, 3.0, mode="sequential", reference=base,
                         with_limit=False, residual_compensation=True, attn_weighted_qkv=0.01,
                         zero_out_rows={"layers.2.mlp.down_proj": [0, 5]}, eps_search=True, eps_steps=2, log=None)
    qrows = [r for r in rep["layers"] if r["layer"].endswith("q_proj")]
    assert len(qrows) == 4 and all(0 <= r["q_eps"] <= 1 and 0 <= r["a_eps"] <= 1 for r in qrows)
    zeroed = model.model.layers[2].mlp.down_proj.weight[[0, 5]]
    assert torch.equal(zeroed, torch.zeros_like(zeroed))
    with pytest.raises(ValueError, match="mode=sequential"):
        quantize_model(copy.deepcopy(base), WaterSIC(), calib, 3.0, residual_compensation=True, log=None)


def test_watersic_ft_recovers_planted_rescalers(tiny_setup):
    """Planted truth: every MLP down_proj of the tiny model is written as diag(t*)·A·diag(g*) exactly (A = W/(t* g*ᵀ));
    WaterSIC-FT starting from t = 1, g = 1 (a distorted model) trains only t, g, and the KL to the original falls
    by 10x while t·gᵀ moves back toward t*·g*ᵀ (KL is flat in some directions, so not all the way); the rest of the
    model is untouched."""
    from lightning_modules.watersic.finetune import finetune_rescalers, kl_loss

    base, calib, _ = tiny_setup
    seqs = calib[0]["input_ids"][:4, :32]
    model = copy.deepcopy(base)
    g_ = torch.Generator().manual_seed(0)
    factors, planted = {}, {}
    for i, blk in enumerate(model.model.layers):
        w = blk.mlp.down_proj.weight.detach().double()
        t_star = 1 + 0.3 * torch.rand(w.shape[0], generator=g_, dtype=torch.float64)
        g_star = 1 + 0.3 * torch.rand(w.shape[1], generator=g_, dtype=torch.float64)
        with torch.no_grad():  # the distorted start: A itself (t = g = 1), i.e. W / (t* g*ᵀ)
            blk.mlp.down_proj.weight.copy_((w / torch.outer(t_star, g_star)).float())
        name = f"model.layers.{i}.mlp.down_proj"
        factors[name] = (torch.ones(w.shape[0], dtype=torch.float64), torch.ones(w.shape[1], dtype=torch.float64))
        planted[name] = torch.outer(t_star, g_star)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "down_proj" not in n}
    with torch.no_grad():
        kl0 = float(kl_loss(model, base, seqs))
    hist = finetune_rescalers(model, base, factors, seqs, epochs=60, lr=1e-2, lr_min=1e-3, batch_size=4, log=None)
    with torch.no_grad():
        kl1 = float(kl_loss(model, base, seqs))
    assert kl1 < 0.1 * kl0 and hist[-1] < hist[0]
    mods = dict(model.named_modules())
    for name, outer in planted.items():  # Ŵ / A = t gᵀ, compared with the planted t* g*ᵀ
        a = dict(base.named_modules())[name].weight.double() / outer
        got = mods[name].weight.double() / a
        assert float((got - outer).norm()) < 0.85 * float((torch.ones_like(outer) - outer).norm())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


@pytest.mark.parametrize("mode", ["plain", "sequential"])
def test_offloaded_driver_quantizes_as_the_in_memory_driver(tiny_setup, mode):
    """``offload`` (one block at a time from carried hidden states, the 70B path) against the in-memory driver on the
    tiny model, every extra on in sequential mode (residual compensation, attention-weighted q/k/v, the ε search, rate
    control, zeroed rows), two batches: the same layers, rates, ε and weights. Eager attention in both, so the hidden
    states the two paths carry are computed by the same kernels."""
    from lightning_modules.common.quantize.driver import quantize_model
    from lightning_modules.watersic import WaterSIC

    base, calib, _ = tiny_setup
    base = copy.deepcopy(base)
    base.set_attn_implementation("eager")
    calib = [{"input_ids": calib[0]["input_ids"][:2, :32]}, {"input_ids": calib[0]["input_ids"][2:4, :32]}]
    extras = dict(residual_compensation=True, attn_weighted_qkv=0.01, eps_search=True, eps_steps=2,
                  zero_out_rows={"layers.2.mlp.down_proj": [0, 5]}) if mode == "sequential" else {}
    out = {}
    for offload in (None, "cpu"):
        model = copy.deepcopy(base)
        rep = quantize_model(model, WaterSIC(target_rate=False), calib, 3.0, mode=mode, rate_control=True,
                             reference=copy.deepcopy(base) if mode == "sequential" else None, with_limit=False,
                             offload=offload, log=None, **extras)
        out[offload] = (model, rep)
    (mem, rep_mem), (off, rep_off) = out[None], out["cpu"]
    assert [r["layer"] for r in rep_off["layers"]] == [r["layer"] for r in rep_mem["layers"]]
    for a, b in zip(rep_mem["layers"], rep_off["layers"]):
        assert a["bits"] == pytest.approx(b["bits"], rel=1e-9) and a.get("q_eps") == b.get("q_eps")
    for (name, w), w_off in zip(mem.named_parameters(), off.parameters()):
        torch.testing.assert_close(w_off, w, rtol=0, atol=1e-6, msg=name)
    assert rep_off["summary"]["bits"] == pytest.approx(rep_mem["summary"]["bits"], rel=1e-12)


def test_streamed_blocks_give_the_same_logits(tiny_setup):
    """``stream_blocks``: the blocks stay in host memory and each visits the device for its own forward (the
    evaluation's path under ``model.offload``); the logits equal the plain forward's, and removing the hooks ends it."""
    from lightning_modules.common.quantize.offload import blocks, stream_blocks

    base, calib, _ = tiny_setup
    model = copy.deepcopy(base)
    x = calib[0]["input_ids"][:2, :32]
    with torch.no_grad():
        want = base(input_ids=x, use_cache=False).logits
        moved = []
        handles = stream_blocks(model, "cpu")
        handles.append(blocks(model)[1].register_forward_pre_hook(lambda m, a: moved.append(1)))
        got = model(input_ids=x, use_cache=False).logits
    for h in handles:
        h.remove()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert moved == [1] and not blocks(model)[1]._forward_pre_hooks


@pytest.mark.slow  # two smoke runs: ~2 CPU-min; the driver's and the streaming's equalities run in the default suite
def test_offload_runs_the_experiment_to_the_same_numbers(tmp_path, tiny_lm_dir):
    """``model.offload=true`` end to end (the 70B experiment's path: backbone out of the module tree, block-wise
    quantization, streamed evaluation) gives the in-memory run's metrics; with WaterSIC-FT it stops in one line."""
    common = ["debug=smoke", "model.n_calib=8", "model.with_limit=false", "model.finetune=null"]
    _, plain = run_experiment("watersic_tiny", tmp_path / "plain", common)
    _, offloaded = run_experiment("watersic_tiny", tmp_path / "offload", [*common, "model.offload=true"])
    assert plain["status"] == offloaded["status"] == "ok"
    for key in ("test/ppl", "test/ppl_fp", "test/kl_bits", "quant/bits"):
        assert offloaded["final"][key] == pytest.approx(plain["final"][key], rel=1e-5), key
    from lightning_modules.watersic.module import WaterSICModule

    with pytest.raises(ValueError, match="model.offload=true"):
        WaterSICModule({"pretrained": str(tiny_lm_dir)}, offload=True,
                       finetune={"epochs": 1, "lr": 1e-3, "lr_min": 1e-4, "batch_size": 8})
