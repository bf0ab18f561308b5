"""QATLawModule: variants, one init, one gradient per variant, the tiny experiment end to end, paper-scale sizes."""
import copy
import math

import pytest
import torch
from omegaconf import OmegaConf

from lightning_modules.common.backbone import build_backbone, count_parameters
from lightning_modules.common.fake_quant import FakeQuantLinear
from lightning_modules.qat_law.module import QATLawModule, parse_variants
from tests.helpers import CONF, run_experiment


def spec(name="llama_qat_t150k", vocab=2048):
    root = OmegaConf.create({"backbone": OmegaConf.load(CONF / "backbone" / f"{name}.yaml"),
                             "data": {"tokenizer": {"vocab_size": vocab}}})
    return OmegaConf.to_container(root.backbone, resolve=True)


def test_parse_variants():
    v = parse_variants(["fp", "w4a4", "w4a16_g64", "w4a4_fc2a8", "fp"], [16, 128])
    assert [x["key"] for x in v] == ["fp", "w4a4_g16", "w4a4_g128", "w4a16_g64", "w4a4_fc2a8_g16", "w4a4_fc2a8_g128"]
    a8 = v[-1]
    assert (a8["precision"], a8["w_bits"], a8["a_bits"], a8["fc2_a_bits"], a8["group_size"]) == ("w4a4_fc2a8", 4, 4, 8, 128)
    assert v[3]["precision"] == "w4a16" and v[3]["a_bits"] == 16
    with pytest.raises(ValueError, match="is not 'fp' or w<bits>a<bits>"):
        parse_variants(["int4"], [16])


def test_variants_share_one_init_and_quantize_what_they_say():
    torch.manual_seed(0)
    m = QATLawModule(spec(), precisions=["fp", "w4a16", "w16a4", "w4a4_fc2a8"], group_sizes=[64])
    m.configure_model()
    ref = dict(m.models["fp"].named_parameters())
    for key, model in m.models.items():
        for name, p in model.named_parameters():
            assert torch.equal(p, ref[name]), f"{key}.{name} starts from a different init"
    assert not any(isinstance(x, FakeQuantLinear) for x in m.models["fp"].modules())
    w = {n: x for n, x in m.models["w4a16_g64"].named_modules() if isinstance(x, FakeQuantLinear)}
    assert len(w) == 7 and all(x.w_bits == 4 and x.a_bits == 16 and x.w_group_size == 64 for x in w.values())
    a = {n: x for n, x in m.models["w16a4_g64"].named_modules() if isinstance(x, FakeQuantLinear)}
    assert all(x.w_bits == 16 and x.a_bits == 4 for x in a.values())
    mixed = {n: x for n, x in m.models["w4a4_fc2a8_g64"].named_modules() if isinstance(x, FakeQuantLinear)}
    assert {n.split(".")[-1]: x.a_bits for n, x in mixed.items()}["down_proj"] == 8
    assert sum(x.a_bits == 4 for x in mixed.values()) == 6
    assert type(m.models["w4a16_g64"].lm_head) is torch.nn.Linear  # the LM head stays in full precision
    counts = m.parameter_counts()
    assert counts["params/non_embedding"] == count_parameters(m.models["fp"], non_embedding=True) == 147_840


def test_joint_training_equals_separate_training():
    """Summed losses over disjoint variants give each variant exactly its solo gradient; clipping is per variant."""
    torch.manual_seed(1)
    m = QATLawModule(spec(), precisions=["fp", "w4a4"], group_sizes=[16])
    m.configure_model()
    solo = copy.deepcopy(m.models["w4a4_g16"])
    ids = torch.randint(0, 2048, (2, 32))
    batch = {"input_ids": ids, "labels": ids}
    m.log = lambda *a, **k: None
    m.training_step(batch, 0).backward()
    solo(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for (n, p), q in zip(m.models["w4a4_g16"].named_parameters(), solo.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-7, rtol=1e-5), n
    norm_fp = torch.nn.utils.get_total_norm([p.grad for p in m.models["fp"].parameters()])
    m.configure_gradient_clipping(None, gradient_clip_val=float(norm_fp) / 2)
    after_fp = torch.nn.utils.get_total_norm([p.grad for p in m.models["fp"].parameters()])
    after_q = torch.nn.utils.get_total_norm([p.grad for p in m.models["w4a4_g16"].parameters()])
    assert math.isclose(float(after_fp), float(norm_fp) / 2, rel_tol=1e-4)
    assert float(after_q) <= float(norm_fp) / 2 * (1 + 1e-4)


def test_qat_law_tiny_smoke(tmp_path):
    value, metrics = run_experiment("qat_law_tiny", tmp_path, overrides=(
        "debug=smoke", "data.max_val_sequences=8", "data.seq_len=64", "data.batch_size=4", "data.eval_batch_size=8"))
    assert metrics["status"] == "ok" and metrics["global_step"] == 20
    assert math.isfinite(value)
    final = metrics["final"]
    for key in ("fp", "w4a4_g64", "w4a16_g64", "w16a4_g64", "w4a4_fc2a8_g64"):
        assert final[f"train/loss/{key}"] < math.log(2048) - 0.5  # every variant trains
        assert math.isfinite(final[f"test/loss/{key}"])
    res = metrics["results"]["qat_law"]
    assert res["N"] == 295_552 and res["D"] == 20 * 4 * 64
    rows = {r["variant"]: r for r in res["rows"]}
    assert rows["fp"]["delta"] == 0.0
    for key in ("w4a4_g64", "w4a16_g64", "w16a4_g64"):
        assert math.isclose(rows[key]["delta"], final[f"test/loss/{key}"] - final["test/loss/fp"], abs_tol=1e-5)
        assert math.isclose(final[f"test/delta/{key}"], rows[key]["delta"], abs_tol=1e-5)
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert state["global_step"] == 20
    assert any(k.startswith("models.w4a4_g64.") for k in state["state_dict"])
    assert state["hyper_parameters"]["precisions"] == ["fp", "w4a4", "w4a16", "w16a4", "w4a4_fc2a8"]


@pytest.mark.parametrize("name,target", [("llama_qat_74m", 74e6), ("llama_qat_145m", 145e6),
                                         ("llama_qat_297m", 297e6), ("llama_qat_595m", 595e6),
                                         ("llama_qat_973m", 973e6)])
def test_paper_scale_sizes_hit_the_papers_non_embedding_counts(name, target):
    s = spec(name)
    model = build_backbone(s, meta=True)
    n = count_parameters(model, non_embedding=True)
    assert abs(n - target) / target < 0.01, f"{name}: N = {n:,}"
    # G = 256 (the grid's coarsest) divides every linear input, so every cell of the paper grid builds
    cfg = s["config"]
    assert cfg["hidden_size"] % 256 == 0 and cfg["intermediate_size"] % 256 == 0
