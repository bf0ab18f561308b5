"""Backbones at both scales.

Paper scale: every ``conf/backbone/*.yaml`` that is not ``tiny_*`` is built on the meta device and its parameter
count compared with the released checkpoint's. The core's files are checked exactly against the published count
(``PUBLISHED``); a file another paper adds is checked against its own ``# 6.74B parameters`` header to the
precision written there. A paper-scale file with neither fails: nothing is skipped silently.

Tiny scale: every ``tiny_*`` backbone builds, runs a forward pass and takes one training step that lowers its
loss on the batch it trained on.
"""
from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lightning_modules.common.backbone import build_backbone, count_parameters

BACKBONES = Path(__file__).resolve().parents[1] / "conf" / "backbone"

# Exact counts of the released checkpoints (sum of numel over the safetensors, tied embeddings counted once).
PUBLISHED = {
    "llama2_7b": 6_738_415_616,            # meta-llama/Llama-2-7b-hf
    "llama2_13b": 13_015_864_320,          # meta-llama/Llama-2-13b-hf
    "qwen3_8b": 8_190_735_360,             # Qwen/Qwen3-8B
    "gpt2_xl": 1_557_611_200,              # openai-community/gpt2-xl (tied LM head)
    "gpt2_small": 124_439_808,             # openai-community/gpt2 (tied LM head)
    "pythia_2p8b": 2_775_208_960,          # EleutherAI/pythia-2.8b
    "llama31_8b": 8_030_261_248,           # meta-llama/Llama-3.1-8B(-Instruct)
    "llama3_8b": 8_030_261_248,            # meta-llama/Meta-Llama-3-8B
    "llama3_70b": 70_553_706_496,          # meta-llama/Meta-Llama-3-70B
    "llama32_1b": 1_235_814_400,           # meta-llama/Llama-3.2-1B (tied LM head)
    "qwen25_7b_instruct": 7_615_616_512,   # Qwen/Qwen2.5-7B-Instruct
}

_HEADER = re.compile(r"^#\s*([0-9]+(?:\.[0-9]+)?)\s*([KMBT])\s+param", re.IGNORECASE | re.MULTILINE)
_SCALE = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def header_count(text: str) -> tuple[int, int] | None:
    """(count, tolerance) from a ``# 6.74B parameters`` comment: the tolerance is half the last written digit."""
    m = _HEADER.search(text)
    if m is None:
        return None
    number, unit = Decimal(m.group(1)), _SCALE[m.group(2).upper()]
    exponent = number.as_tuple().exponent
    return int(number * unit), int(Decimal(10) ** exponent * unit / 2)


def paper_scale_files() -> list[str]:
    return sorted(p.stem for p in BACKBONES.glob("*.yaml") if not p.stem.startswith("tiny_"))


def tiny_files() -> list[str]:
    return sorted(p.stem for p in BACKBONES.glob("tiny_*.yaml"))


def load_spec(name: str, vocab_size: int = 2048) -> dict:
    cfg = OmegaConf.load(BACKBONES / f"{name}.yaml")
    root = OmegaConf.create({"backbone": cfg, "data": {"tokenizer": {"vocab_size": vocab_size}}})
    return OmegaConf.to_container(root.backbone, resolve=True)


def test_header_parser():
    assert header_count("# 6.74B parameters (checked)") == (6_740_000_000, 5_000_000)
    assert header_count("# 355M parameters") == (355_000_000, 500_000)
    assert header_count("# 1.5b params\nfamily: x") == (1_500_000_000, 50_000_000)
    assert header_count("family: llama\n") is None


def test_core_backbones_are_present():
    missing = sorted(set(PUBLISHED) - set(paper_scale_files()))
    assert not missing, f"conf/backbone lacks {missing}"


@pytest.mark.parametrize("name", paper_scale_files())
def test_paper_scale_parameter_count(name):
    text = (BACKBONES / f"{name}.yaml").read_text()
    header = header_count(text)
    if name not in PUBLISHED and header is None:
        pytest.fail(f"conf/backbone/{name}.yaml has no '# <N>B parameters' header: add the released model's "
                    "count there (tests/test_backbones.py checks the built model against it)")
    spec = load_spec(name)
    model = build_backbone(spec, meta=True)
    assert all(p.device.type == "meta" for p in model.parameters())
    n = count_parameters(model)
    if name in PUBLISHED:
        assert n == PUBLISHED[name], f"{name}: built {n:,} parameters, the released model has {PUBLISHED[name]:,}"
    if header is not None:
        expected, tol = header
        assert abs(n - expected) <= tol, f"{name}: built {n:,} parameters, its header says {expected:,} (±{tol:,})"
    # the paper-scale dtype is a real low-precision or fp32 dtype the loader understands
    assert spec.get("dtype") in (None, "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")


def test_non_embedding_count_excludes_embeddings():
    model = build_backbone(load_spec("llama2_7b"), meta=True)
    emb = 32000 * 4096
    assert count_parameters(model) - count_parameters(model, non_embedding=True) == 2 * emb  # untied head
    tied = build_backbone(load_spec("llama32_1b"), meta=True)
    assert count_parameters(tied) - count_parameters(tied, non_embedding=True) == 128256 * 2048


@pytest.mark.parametrize("name", tiny_files())
def test_tiny_backbone_forward_and_train_step(name):
    torch.manual_seed(0)
    spec = load_spec(name, vocab_size=256)
    V = spec["config"]["vocab_size"]  # the data's (256 here), or the backbone's own closed vocabulary (tiny_mdlm)
    model = build_backbone(spec)
    assert model.config.vocab_size == V
    ids = torch.randint(0, V, (2, 16))
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits.shape == (2, 16, V)
    assert torch.isfinite(out.loss)
    # the model's loss is the mean next-token cross-entropy of its own logits
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    assert torch.allclose(out.loss, ref, atol=1e-5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert not [n for n, g in grads.items() if g is None], "every trainable parameter gets a gradient"
    assert all(torch.isfinite(g).all() for g in grads.values())
    opt.step()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert after < out.loss  # one step on a batch lowers the loss on that batch


def test_vlm_backbones_build_as_image_text_to_text_on_meta():
    """``kind: image_text_to_text`` specs (Qwen2-VL, LLaVA) build a VLM with a vision tower on the meta device (their
    counts are checked against the header above)."""
    vlms = [n for n in paper_scale_files() if load_spec(n).get("kind") == "image_text_to_text"]
    assert {"qwen2vl_7b_instruct", "llava15_7b"} <= set(vlms)
    for name in vlms:
        model = build_backbone(load_spec(name), meta=True)
        assert any("vision" in n or "visual" in n for n, _ in model.named_modules()), f"{name}: no vision tower"
        assert all(p.device.type == "meta" for p in model.parameters())
