"""Shrunk twins (``lightning_modules/common/shrunk.py``): every ``conf/backbone/*.yaml`` gets a CPU-sized checkpoint
of its own transformers class, GQA ratio, tying, MoE routing and vision tower, with a tokenizer carrying the family's
special tokens and chat template, that loads the way the real checkpoint does and runs a forward pass."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lightning_modules.common.backbone import build_backbone, build_config

BACKBONES = Path(__file__).resolve().parents[1] / "conf" / "backbone"
# One spec of each family and feature (GQA, tied, qk-norm, sliding/global, MoE, diffusion key maps, VLMs) in the
# default suite; the other specs of the same families with -m slow.
REPRESENTATIVE = {"llama31_8b", "qwen25_7b_instruct", "qwen3_4b_thinking", "gemma2_2b_it", "gemma3_12b", "ministral_8b",
                  "gpt2_xl", "pythia_2p8b", "olmoe_1b_7b", "tiny_mixtral", "llada_8b", "dream_7b",
                  "qwen2vl_7b_instruct", "llava15_7b"}
SPECS = [pytest.param(p.stem, marks=() if p.stem in REPRESENTATIVE else pytest.mark.slow)
         for p in sorted(BACKBONES.glob("*.yaml"))]


def _spec(name: str) -> dict:
    spec = yaml.safe_load((BACKBONES / f"{name}.yaml").read_text())
    # the tiny specs take their vocabulary from the data config (an interpolation): any number stands in for the class
    cfg = spec.get("config") or {}
    spec["config"] = {k: (2048 if isinstance(v, str) and "${" in v else v) for k, v in cfg.items()}
    return spec


def _text(cfg):
    return cfg.get_text_config()


@pytest.mark.parametrize("name", SPECS)
def test_twin_has_the_family_shape_and_runs(name):
    from transformers import AutoTokenizer

    from lightning_modules.common.shrunk import spec_flavour, twin_dir, twin_spec

    spec = _spec(name)
    small = twin_spec(spec)
    location = twin_dir(spec)
    full_model = build_backbone(spec, meta=True)
    full, cfg = build_config(spec), build_config(small)
    t_full, t_small = _text(full), _text(cfg)
    tok = AutoTokenizer.from_pretrained(str(location))

    # the same transformers class and config family, much smaller, the vocabulary the tokenizer's
    assert type(cfg) is type(full)
    assert t_small.num_hidden_layers <= 2 < t_full.num_hidden_layers or t_full.num_hidden_layers <= 4
    assert t_small.vocab_size == len(tok)
    kv_full = getattr(t_full, "num_key_value_heads", None) or t_full.num_attention_heads
    kv_small = getattr(t_small, "num_key_value_heads", None) or t_small.num_attention_heads
    assert t_full.num_attention_heads // kv_full == t_small.num_attention_heads // kv_small  # the GQA ratio
    assert t_small.num_attention_heads <= 8
    assert bool(getattr(cfg, "tie_word_embeddings", False)) == bool(getattr(full, "tie_word_embeddings", False))
    for flag in ("norm_topk_prob", "attn_logit_softcapping", "final_logit_softcapping", "rotary_pct",
                 "use_parallel_residual", "router_aux_loss_coef"):
        assert getattr(t_small, flag, None) == getattr(t_full, flag, None), flag
    assert getattr(t_small, "rope_parameters", {}).get("rope_type") == getattr(t_full, "rope_parameters", {}).get("rope_type")
    for experts in ("num_experts", "num_local_experts"):
        if isinstance(getattr(t_full, experts, None), int) and experts in (spec["config"].get("text_config") or spec["config"]):
            assert 1 < getattr(t_small, experts) <= 4
            assert 1 <= t_small.num_experts_per_tok <= getattr(t_small, experts)
            assert (t_small.num_experts_per_tok > 1) == (t_full.num_experts_per_tok > 1)
    if getattr(t_full, "layer_types", None):  # one layer of each attention type the family mixes
        assert set(t_small.layer_types) == set(t_full.layer_types)
        if "sliding_attention" in t_small.layer_types:
            assert t_small.sliding_window < 128
    for special in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(t_small, special, None) is not None:
            assert getattr(t_small, special) < len(tok), special

    # it loads as the real checkpoint would (LLaDA / Dream through their key maps) and runs
    if spec.get("diffusion"):
        from lightning_modules.common.diffusion import build_diffusion_backbone

        model = build_diffusion_backbone({**small, "dtype": "float32"})
        assert model.mask_token_id < len(tok)
        assert tok.convert_ids_to_tokens(model.mask_token_id) in ("<|mdm_mask|>", "<|mask|>")
        logits = model.logits(torch.tensor([tok("one two three")["input_ids"]]))
        assert type(model.model) is type(full_model)
    else:
        model = build_backbone({**small, "dtype": "float32"}) if small.get("pretrained") else build_backbone(small)
        assert type(model) is type(full_model)
        ids = torch.tensor([tok("one two three")["input_ids"]])
        logits = model(input_ids=ids).logits
    assert logits.shape[-1] >= len(tok) and torch.isfinite(logits.float()).all()

    flavour, chat = spec_flavour(spec)
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], tokenize=False,
                                       add_generation_prompt=True)
        assert "What is 2 + 2?" in text and text != "What is 2 + 2?"
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    else:
        assert tok.chat_template is None


def test_llava_twin_takes_an_image_through_its_processor():
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor

    from lightning_modules.common.shrunk import twin_dir, twin_spec

    spec = _spec("llava15_7b")
    processor = AutoProcessor.from_pretrained(str(twin_dir(spec)))
    model = build_backbone({**twin_spec(spec), "dtype": "float32"})
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
                                         add_generation_prompt=True)
    assert text == "USER: <image>\nWhat? ASSISTANT:"
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8))
    enc = processor(images=[image], text=[text], return_tensors="pt")
    plain = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                  pixel_values=torch.zeros_like(enc["pixel_values"])).logits
    seen = model(**enc).logits
    assert seen.shape == plain.shape and not torch.allclose(seen, plain)  # the image's tokens reach the LM


def test_flavours_follow_the_hub_ids():
    from datamodules.common.family_tokenizers import flavour_of

    assert flavour_of("meta-llama/Llama-2-7b-hf") == ("llama2", False)
    assert flavour_of("meta-llama/Llama-3.1-8B-Instruct") == ("llama3", True)
    assert flavour_of("Qwen/Qwen2.5-3B") == ("qwen2", True)  # Qwen's base checkpoints ship a template too
    assert flavour_of("Qwen/Qwen3-4B-Thinking-2507") == ("qwen3_thinking", True)
    assert flavour_of("google/gemma-2-2b-it") == ("gemma2", True)
    assert flavour_of("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B") == ("r1_distill", True)
    assert flavour_of("GSAI-ML/LLaDA-8B-Base") == ("llada", False)
    assert flavour_of(None, "olmoe") == ("olmoe", False)
    with pytest.raises(ValueError, match="no tokenizer flavour"):
        flavour_of(None, "bert")


def test_family_templates_render_the_family_markers():
    """The chat strings carry each family's own turn markers (what a real template produces for one user turn)."""
    from datamodules.common.family_tokenizers import build_family_tokenizer

    turn = [{"role": "user", "content": "Hi"}]
    want = {
        "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                  "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "qwen2": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "qwen3_thinking": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n",
        "gemma2": "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "mistral": "<s>[INST]Hi[/INST]",
        "llama2": "<s>[INST] Hi [/INST]",
        "r1_distill": "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n",
        "llava": "USER: Hi ASSISTANT:",
    }
    for flavour, text in want.items():
        tok = build_family_tokenizer(flavour, chat=True)
        assert tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) == text, flavour
    llama3 = build_family_tokenizer("llama3", chat=True)
    assert llama3("Hi")["input_ids"][0] == llama3.bos_token_id  # LLaMA prepends BOS, as released
    assert build_family_tokenizer("qwen2", chat=False).chat_template is None
