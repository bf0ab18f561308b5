"""export_packed: a quantized tiny model packed to 4 bits, saved, reloaded, and equal to the fake-quantized model;
the quantizers that cannot be packed fail with one line."""
import copy

import pytest
import torch

from callbacks.kernels.w4a16 import PackedLinear
from lightning_modules.common.quantize import GPTQ, RTN
from lightning_modules.common.quantize.driver import quantize_model
from lightning_modules.common.quantize.export import (grid_codes, load_packed, pack_model, pack_skeleton, save_packed,
                                                      storage_bytes)


@pytest.fixture(scope="module")
def tiny(tiny_lm_dir):
    """tiny-lm, calibration batches and eval ids: random tokens (the equalities tested here hold for any input)."""
    from transformers import AutoModelForCausalLM

    gen = torch.Generator().manual_seed(0)
    calib = [{"input_ids": torch.randint(0, 2048, (8, 64), generator=gen)}]
    ids = torch.randint(0, 2048, (4, 64), generator=gen)
    return AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir)).eval(), calib, ids


def _quantized(tiny, quantizer, rate, **kw):
    base, calib, ids = tiny
    model = copy.deepcopy(base)
    report = quantize_model(model, quantizer, calib, rate, with_limit=False, log=None, **kw)
    return model, report, ids


def _awq():
    from lightning_modules.dllmquant.awq import AWQ

    return AWQ(search="layer", n_grid=4, grid="absmax_row")  # ours: a per-row grid of W·diag(s), s kept as input_scale


@pytest.mark.parametrize("make,rate,kw", [
    (RTN, 4, {}),                                                          # 16 levels, mid-rise: zero 7.5
    (GPTQ, 3, {"zero_out_rows": {"layers.1.mlp.up_proj": [0, 5]}}),        # 8 levels; zeroed rows decode to 0
    (lambda: GPTQ(extra_bit=True), 3, {}),                                 # Huffman-GPTQ: 15 levels, zero on a level
    (_awq, 4, {}),                                                         # the grid of W·diag(s), x / s in the layer
], ids=["rtn4", "gptq3_zeroed_rows", "huffman_gptq3", "awq4"])
def test_packed_checkpoint_reloads_to_the_fake_quantized_logits(tiny, tmp_path, make, rate, kw):
    model, report, ids = _quantized(tiny, make(), rate, **kw)
    fake = {n: m.weight.detach().clone() for n, m in model.named_modules() if n in report["grids"]}
    with torch.no_grad():
        want = model(input_ids=ids).logits
    fp_bytes = storage_bytes(model)
    names = pack_model(model, report["grids"], report["input_scales"])
    assert len(names) == 28 and sorted(names) == sorted(r["layer"] for r in report["layers"])
    save_packed(model, tmp_path, names)
    loaded = load_packed(tmp_path)
    mods = dict(loaded.named_modules())
    for name, w in fake.items():  # each layer decodes to its fake-quantized weight (up to the fp32 scale's rounding)
        layer = mods[name]
        assert isinstance(layer, PackedLinear) and layer.qweight.dtype == torch.uint8
        w_packed = layer.dequantize() if layer.input_scale is None else layer.dequantize() / layer.input_scale
        assert (w_packed - w).abs().max() <= 4e-7 * w.abs().max()
    assert not any(type(m) is torch.nn.Linear for n, m in mods.items() if ".layers." in n)
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    # really 4-bit: the 28 linears (196,608 weights a block) hold half a byte a weight plus one fp32 scale and zero
    # per row; embeddings, norms and the head stay fp32
    linear = sum(m.out_features * m.in_features for m in mods.values() if isinstance(m, PackedLinear))
    rows = sum(m.out_features for m in mods.values() if isinstance(m, PackedLinear))
    assert storage_bytes(loaded) == fp_bytes - 4 * linear + linear // 2 + 8 * rows + (
        4 * sum(m.in_features for m in mods.values() if isinstance(m, PackedLinear) and m.input_scale is not None))
    on_disk = sum((tmp_path / f).stat().st_size for f in ("model.safetensors", "buffers.safetensors"))
    assert 0 < on_disk - storage_bytes(loaded) < 20_000  # the same tensors plus the files' JSON headers


def test_skeleton_size_is_the_packed_size(tiny):
    """The meta-device size (used for paper-scale models) equals a real export's."""
    model, report, _ = _quantized(tiny, RTN(), 4)
    pack_model(model, report["grids"])
    skeleton = copy.deepcopy(tiny[0]).to("meta")
    assert len(pack_skeleton(skeleton)) == 28
    assert storage_bytes(skeleton) == storage_bytes(model)


def test_weights_off_the_grid_are_refused(tiny):
    model, report, _ = _quantized(tiny, RTN(), 4)
    name = "model.layers.2.mlp.down_proj"
    layer = model.get_submodule(name)
    assert grid_codes(layer.weight, report["grids"][name]).max() == 15
    with torch.no_grad():
        layer.weight[3, 7] += 0.3 * report["grids"][name].scale[3, 0]
    with pytest.raises(ValueError, match=f"{name}: the weight is not on its quantizer's grid"):
        pack_model(model, report["grids"])


def test_grids_of_more_than_sixteen_levels_are_refused(tiny):
    model, report, _ = _quantized(tiny, GPTQ(extra_bit=True), 4)  # 2^5 - 1 = 31 levels
    with pytest.raises(ValueError, match="31 levels, a 4-bit code holds 16"):
        pack_model(model, report["grids"])


def test_watersic_cannot_export_and_says_why(tiny, tmp_path):
    from lightning_modules.watersic import WaterSIC, WaterSICModule

    model, report, _ = _quantized(tiny, WaterSIC(rescalers=False, target_rate=False), 3)
    assert report["grids"] == {}
    with pytest.raises(ValueError, match="watersic cannot be packed to 4 bits: its codes are unbounded integers"):
        pack_model(model, report["grids"], quantizer=WaterSIC())
    with pytest.raises(ValueError, match="model.export_packed: watersic cannot be packed"):
        WaterSICModule({"family": "llama"}, export_packed=str(tmp_path))


def test_dllmquant_exports_only_weight_only_models(tmp_path):
    from lightning_modules.dllmquant.module import DLLMQuantModule

    spec = {"family": "llama", "diffusion": {"mask_token_id": 3}}
    with pytest.raises(ValueError, match="set model.a_bits=16 and model.v_bits=16 to export"):
        DLLMQuantModule(spec, a_bits=4, export_packed=str(tmp_path))
    assert DLLMQuantModule(spec, a_bits=16, export_packed=str(tmp_path)).export_packed == str(tmp_path)


def test_rtn_tiny_experiment_exports_and_reports_bytes(tmp_path, tiny_lm_dir):
    from tests.helpers import run_experiment

    out = tmp_path / "packed"
    _, metrics = run_experiment("rtn_tiny", tmp_path, ["debug=smoke", "model.rate=4", "model.n_calib=8",
                                                       "model.with_limit=false", f"model.export_packed={out}"])
    final = metrics["final"]
    assert metrics["status"] == "ok" and (out / "model.safetensors").exists()
    assert final["quant/bytes_memory"] < 0.5 * final["quant/bytes_memory_fp"]
    assert abs(final["quant/bytes_disk"] - final["quant/bytes_memory"]) < 20_000
    assert 0 < final["test/kl_bits"] < 0.5  # the test loop ran the packed model against the fp reference
    assert isinstance(load_packed(out).model.layers[0].self_attn.q_proj, PackedLinear)
