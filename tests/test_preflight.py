"""The preflight (``lightning_modules/common/preflight.py``): every experiment gets one from its config alone, and its
figures hold against what tiny CPU runs really allocate.

- Every experiment composes with ``debug=preflight`` and the estimator answers on the meta device (no weights).
- ``debug=preflight`` through ``runner.run`` prints, writes ``preflight.json`` and stops: no datamodule, no trainer, no
  GPU check (a paper-scale experiment whose data and GPUs are absent passes); ``run.py`` exits 0.
- Counted figures: weights, gradients and optimizer states of a tiny LLaMA trained two steps by Lightning (fp32,
  bf16-true, LoRA on a bf16 base) against the tensors actually allocated (within 20%, the issue's bar).
- Formulas: one LLaMA block's bytes saved for backward (fp32, bf16, autocast over fp32 weights) and the whole model's,
  measured with saved-tensor hooks; the KV cache against a real ``DynamicCache``.
- ZeRO accounting, hook shapes (a grown MoE, RLKV's gates) and the header parser against known numbers.
"""
from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from lightning_modules.common import preflight as pf
from runner import compose

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def _estimate(experiment: str, tmp_path, *overrides) -> dict:
    return pf.estimate(compose(experiment, ["debug=preflight", *overrides], output_dir=tmp_path))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_has_a_preflight(experiment, tmp_path):
    report = pf.estimate(cfg := compose(experiment, ["debug=preflight"], output_dir=tmp_path))
    assert cfg.preflight == "only"
    json.dumps(report, default=str)  # preflight.json
    if report["model"] is None:  # an API model: nothing on a GPU, said in a note
        assert any("no local" in n for n in report["notes"])
        return
    assert report["params_total"] > 0 and report["weights"] > 0
    static = sum(report[k] for k in ("weights", "gradients", "master_weights", "optimizer_states", "buffers",
                                     "frozen_copies", "helper_models"))
    assert report["static"] == pytest.approx(static)
    dynamic = [report.get(k, 0.0) for k in ("activations_train", "activations_eval")]
    dynamic.append(report.get("kv_cache", 0.0) + report.get("generate_working_set", 0.0))
    assert report["peak"] == pytest.approx(static + max(dynamic))
    trains = "fit" in report["task"] and report["params_trainable"] > 0
    assert (report["gradients"] > 0) == trains and (report["optimizer_states"] > 0) == trains
    if trains:  # a training shape, or a note that the config gives none
        assert report.get("activations_train", 0) > 0 or any("training length unknown" in n for n in report["notes"])
    if experiment.endswith("_tiny"):
        return
    header = report["header_gpu_gib"]
    assert report["warning"] is None or ("exceeds" in report["warning"]) == (header is not None)
    if header is not None:
        assert (report["warning"] is not None) == (report["peak"] / pf.GIB > header)


def test_debug_preflight_builds_nothing_and_writes_json(tmp_path, capsys):
    """A paper-scale run whose data, checkpoint and GPUs are all absent here: the preflight still answers, and the run
    stops before check_config (which would refuse the GPU trainer) and before any datamodule is built."""
    from runner import run

    cfg = compose("hici_llama7b", ["debug=preflight"], output_dir=tmp_path)
    assert run(cfg) is None
    report = json.loads((tmp_path / "preflight.json").read_text())
    assert report["params_total"] > 6e9 and not (tmp_path / "metrics.json").exists()
    out = capsys.readouterr().out
    assert "preflight: hici_llama7b" in out and "peak" in out


def test_preflight_value_is_checked(tmp_path):
    from runner import ConfigError, run

    with pytest.raises(ConfigError, match="preflight='yes'"):
        run(compose("lm_tiny", ["preflight=yes"], output_dir=tmp_path))


def test_run_py_debug_preflight_exits_zero(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "experiment=rlkv_r1_llama8b", "debug=preflight",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "KV cache (generate)" in proc.stdout and (tmp_path / "preflight.json").exists()


# --- counted: weights, gradients, optimizer states against a tiny Lightning run ---------------------------------

def _measured_static(cfg, lora: dict | None) -> dict:
    """Bytes of the parameters and gradients (before the optimizer step) and of every optimizer state tensor, after a
    tiny LLaMA of ``cfg`` trains two steps with Lightning at ``cfg.trainer.precision``."""
    import lightning as L
    from omegaconf import OmegaConf

    from lightning_modules.common.lm import CausalLMModule
    from lightning_modules.common.lora import apply_lora

    spec = OmegaConf.to_container(cfg.backbone, resolve=True)
    vocab = spec["config"]["vocab_size"]

    class LM(CausalLMModule):
        def build_model(self):
            model = super().build_model()
            return apply_lora(model, **lora) if lora else model

    seen: dict = {}

    class Measure(L.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            params = {id(p): p for p in module.model.parameters()}.values()
            seen["weights"] = sum(p.nbytes for p in params)
            seen["gradients"] = sum(p.grad.nbytes for p in params if p.grad is not None)

        def on_train_end(self, trainer, module):
            state = trainer.optimizers[0].state.values()
            seen["optimizer_states"] = sum(t.nbytes for s in state for t in s.values() if torch.is_tensor(t))

    torch.manual_seed(0)
    ids = torch.randint(0, vocab, (8, 32))
    loader = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=4)
    module = LM(spec, optimizer=partial(torch.optim.AdamW, lr=1e-3))
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=cfg.trainer.precision, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Measure()])
    trainer.fit(module, train_dataloaders=loader)
    return seen


LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("overrides,lora", [
    ([], None),                                                               # fp32, AdamW
    (["backbone.dtype=bfloat16", "trainer.precision=bf16-true"], None),       # bf16 weights and states
    (["backbone.dtype=bfloat16", "+model.lora.r=8", "+model.lora.alpha=16", "+model.lora.dropout=0.0",
      "+model.lora.targets=[q_proj,v_proj]"], LORA),                          # frozen bf16 base, fp32 adapters
], ids=["fp32", "bf16-true", "lora-bf16-base"])
def test_counted_memory_matches_a_tiny_run(overrides, lora, tmp_path):
    cfg = compose("lm_tiny", ["debug=preflight", "task=fit", *overrides], output_dir=tmp_path)
    report = pf.estimate(cfg)
    measured = _measured_static(cfg, lora)
    for key in ("weights", "gradients", "optimizer_states"):
        assert report[key] == pytest.approx(measured[key], rel=0.2), (key, report[key], measured[key])
    total = sum(measured.values())
    assert sum(report[k] for k in measured) == pytest.approx(total, rel=0.2)
    if lora:  # only the adapters have gradients and states: a few percent of the weights
        assert report["gradients"] < 0.1 * report["weights"]


def test_zero_and_ddp_accounting():
    """ZeRO's per-GPU bytes (Rajbhandari et al. 2020, §3: 2Ψ + 2Ψ + 12Ψ under mixed-precision Adam): ZeRO-3 divides
    all 16 bytes/parameter by the data-parallel degree, ZeRO-2 all but the 2-byte weights; DDP replicates everything."""
    from omegaconf import OmegaConf

    cfg = compose("lm_llama7b", ["debug=preflight"])  # bf16 backbone, bf16-mixed, ZeRO-3 on 8 GPUs
    trained, _ = pf.build_trained(cfg)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    n, w = 6_738_415_616, 8
    z3 = pf.static_memory(cfg, trained, model_cfg)
    assert (z3["weights"], z3["gradients"], z3["master_weights"] + z3["optimizer_states"]) == \
        pytest.approx((2 * n / w, 2 * n / w, 12 * n / w))
    cfg.trainer.strategy.stage = 2
    z2 = pf.static_memory(cfg, trained, model_cfg)
    assert (z2["weights"], z2["gradients"], z2["optimizer_states"]) == pytest.approx((2 * n, 2 * n / w, 8 * n / w))
    cfg.trainer.strategy.stage, cfg.trainer.strategy.offload_optimizer = 3, True
    off = pf.static_memory(cfg, trained, model_cfg)
    assert off["optimizer_states"] == 0 and off["host_per_node"] == pytest.approx(12 * n)
    cfg.trainer.strategy = {"_target_": "lightning.pytorch.strategies.DDPStrategy"}
    ddp = pf.static_memory(cfg, trained, model_cfg)  # bf16 parameters: bf16 gradients and Adam states
    assert (ddp["weights"], ddp["gradients"], ddp["optimizer_states"], ddp["buffers"]) == \
        pytest.approx((2 * n, 2 * n, 4 * n, 2 * n))


# --- formulas: activations and KV cache against measurements ----------------------------------------------------

def _tiny_llama(dtype=torch.float32, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=layers, vocab_size=512, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def _saved_bytes(fn, exclude: set) -> tuple[int, object, dict]:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out, seen


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast"])
def test_layer_activation_formula_matches_saved_tensors(mode):
    """One decoder layer: the bytes saved for backward equal the formula's (to within 2%); under autocast the bf16
    copies of its linear weights come on top, as the formula adds them for the whole model."""
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    model = _tiny_llama(dtype)
    block = pf.block_of(model.config, model)
    b, s = 2, 64
    layer = model.model.layers[0]
    x = torch.randn(b, s, 64, dtype=dtype, requires_grad=True)
    pos = torch.arange(s)[None].expand(b, s)
    cos_sin = model.model.rotary_emb(x, pos)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {t.untyped_storage().data_ptr() for t in cos_sin}  # shared by all layers, computed once
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else torch.autocast("cpu", enabled=False)
    with ctx:
        measured, _, _ = _saved_bytes(lambda: layer(x, attention_mask=None, position_ids=pos,
                                                    position_embeddings=cos_sin), params)
    p = 4 if mode == "fp32" else 2
    r = 4 if mode != "bf16" else 2
    formula = pf.layer_activation_bytes(block, b * s, p, r)
    if mode == "autocast":
        formula += 2 * sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert measured == pytest.approx(formula, rel=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_activation_formula_matches_saved_tensors(dtype):
    """The whole model with its LM loss: saved tensors + the logits the output holds, against every layer's formula +
    the head's (without the transient tensor, which is never saved): within 5%."""
    model = _tiny_llama(dtype, layers=3)
    block = pf.block_of(model.config, model)
    b, s = 2, 64
    ids = torch.randint(0, 512, (b, s))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured, out, seen = _saved_bytes(lambda: model(input_ids=ids, labels=ids, use_cache=False), params)
    if out.logits.untyped_storage().data_ptr() not in seen:
        measured += out.logits.nbytes
    p = 4 if dtype == torch.float32 else 2
    formula = block.layers * pf.layer_activation_bytes(block, b * s, p) + \
        pf.head_activation_bytes(block, b * s, p, transient=False)
    assert measured == pytest.approx(formula, rel=0.05)
    no_ckpt = pf.train_activation_bytes(block, b, s, p)
    assert no_ckpt["peak"] == pytest.approx(formula + 4 * block.vocab * b * s)
    ckpt = pf.train_activation_bytes(block, b, s, p, checkpointing=True)
    assert ckpt["peak"] < no_ckpt["peak"]


def test_kv_cache_formula_matches_a_dynamic_cache():
    model = _tiny_llama(torch.bfloat16, layers=3)
    rows, tokens = 3, 40
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 512, (rows, tokens)), use_cache=True).past_key_values
    measured = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert pf.kv_cache_bytes(pf.block_of(model.config, model), rows, tokens, 2) == measured


def test_sliding_window_layers_hold_their_window():
    block = pf.Block(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=6, vocab=10,
                     window=8, sliding_layers=5)
    per = 2 * 2 * 16 * 2
    assert pf.kv_cache_bytes(block, 1, 100, 2) == per * (1 * 100 + 5 * 8)


# --- hooks and the header -------------------------------------------------------------------------------------

def test_growth_hook_grows_the_source_to_the_scratch_shape(tmp_path):
    """growth_olmoe_depth_width grows OLMoE-1B-7B x2 in depth and width; growth_olmoe_scratch is that grown shape built
    from its own config: the two counts agree (26.52B)."""
    grown = _estimate("growth_olmoe_depth_width", tmp_path)
    scratch = _estimate("growth_olmoe_scratch", tmp_path)
    assert grown["params_total"] == scratch["params_total"] == pytest.approx(26.521e9, rel=1e-3)
    assert _estimate("growth_olmoe_depth", tmp_path)["params_total"] == pytest.approx(13.632e9, rel=1e-3)


def test_rlkv_trains_only_its_gates_and_generates(tmp_path):
    report = _estimate("rlkv_r1_llama8b", tmp_path)
    assert report["params_trainable"] == 32 * 8  # (layers, KV heads) gates on a frozen 8B backbone
    g = report["shapes"]["generate"]
    assert (g["rows"], g["tokens"]) == (16 * 4, 1024 + 7168)  # prompts x G, prompt + new tokens
    assert report["kv_cache"] == 64 * 8192 * 32 * 2 * 8 * 128 * 2


def test_offloaded_70b_quantization_fits_one_80gb_gpu(tmp_path):
    """watersic_llama3_70b with model.offload: one block of the model and one of its reference on the GPU beside the
    embeddings and head, the rest (both copies) in host memory; without offload the two 141 GB copies cannot fit."""
    on = _estimate("watersic_llama3_70b", tmp_path)
    off = _estimate("watersic_llama3_70b", tmp_path, "model.offload=false")
    block = on["params_total"] * 2 * 0.0121  # one of 80 blocks: 0.856B of 70.6B parameters, bf16
    assert on["frozen_copies"] == pytest.approx(block, rel=0.02) and on["header_gpu_gib"] == 80
    assert on["peak"] / pf.GIB < 80 < off["peak"] / pf.GIB and on["warning"] is None and "exceeds" in off["warning"]
    assert on["host_per_node"] == pytest.approx(2 * off["weights"], rel=1e-9)


def test_a_reward_model_is_counted_whole_per_gpu(tmp_path):
    """ps_ppo_rlhf loads its reward model whole on every GPU beside the ZeRO-3 policy: counted from the directory's
    config.json (Llama, one label, bf16) as the parameter formula says; a note where the directory is not there yet."""
    from transformers import LlamaConfig

    V, h, inter, L, heads, kv = 1000, 64, 160, 3, 4, 2
    LlamaConfig(vocab_size=V, hidden_size=h, intermediate_size=inter, num_hidden_layers=L, num_attention_heads=heads,
                num_key_value_heads=kv, num_labels=1).save_pretrained(tmp_path / "models" / "reward_model")
    d = h // heads
    per_layer = h * h * 2 + 2 * h * kv * d + 3 * h * inter + 2 * h  # q, o; k, v; gate, up, down; two norms
    expected = 2 * (V * h + L * per_layer + h + h * 1)  # + final norm + the one-logit score head, in bf16
    with_dir = _estimate("ps_ppo_rlhf_qwen25_7b", tmp_path, f"local.data_root={tmp_path}")
    assert with_dir["helper_models"] == expected
    assert with_dir["static"] == pytest.approx(sum(with_dir[k] for k in (
        "weights", "gradients", "master_weights", "optimizer_states", "buffers", "frozen_copies")) + expected)
    without = _estimate("ps_ppo_rlhf_qwen25_7b", tmp_path, f"local.data_root={tmp_path / 'absent'}")
    assert without["helper_models"] == 0 and any("reward" in n and "not counted" in n for n in without["notes"])


def test_int8_base_and_lora(tmp_path):
    report = _estimate("spard_qwen25_7b_gsm8k", tmp_path)
    assert report["checkpointing"] and report["params_trainable"] < 0.01 * report["params_total"]
    # int8 linear weights (1 byte) and fp32 embeddings, head and norms: well under the bf16 model's 2 bytes/param
    assert report["weights"] < 1.5 * report["params_total"]


@pytest.mark.parametrize("text,gpus,gib,hours", [
    ("8x H100 80GB, ~720 GPU-hours (estimated: 6ND)", 8, 80, "~720 GPU-hours"),
    ("2 x A100-80GB", 2, 80, None),
    ("1x GPU with >= 24 GB (A100/H100), ~1 GPU-hour (estimated)", 1, 24, "~1 GPU-hour"),
    ("8x H100 80GB (bf16 weights ~141 GB), estimated ~40 GPU-hours", 8, 80, "~40 GPU-hours"),
    ("no GPU: 64,000 API requests", None, None, None),
    ("release: 4x GPUs tensor parallel; here FP16 weights 141 GB need >= 2x 141 GB", None, None, None),
])
def test_header_hardware_parser(text, gpus, gib, hours):
    parsed = pf.parse_hardware(text)
    assert (parsed["gpus"], parsed["gpu_gib"], parsed["gpu_hours"]) == (gpus, gib, hours)
