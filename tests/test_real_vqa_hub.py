"""REAL's hub-VLM path (issue 23) offline: a tiny LLaVA (``LlavaForConditionalGeneration`` with a 1-layer CLIP tower
and a 2-layer Llama on tiny-lm's tokenizer) and its ``LlavaProcessor``, saved to a temp dir and loaded the way the
paper-scale configs load Qwen2-VL / LLaVA (``build_backbone`` with ``kind: image_text_to_text`` + ``AutoProcessor``).

Qwen2-VL: ``Qwen2VLProcessor`` cannot be built here (transformers requires its video processor, which needs
torchvision, not installed: its PyPI wheel needs a CUDA torch), so its adapter test feeds the model hand-expanded
ids and ``Qwen2VLImageProcessor``'s tensors; it checks the adapter against the raw model and cached contrastive
decoding (M-RoPE offsets per cache).
"""
from __future__ import annotations

import random

import pytest
import torch

from lightning_modules.real_vqa.data import entities, make_item
from lightning_modules.real_vqa.decoding import ContrastProcessor, cad_logits, greedy_decode, rpgd_logits
from lightning_modules.real_vqa.target import mask_spans, prompt_text, target_segments

# the llava-1.5-hf template's shape: "USER: <image>\n{text} ASSISTANT:"
CHAT_TEMPLATE = ("{% for m in messages %}USER: {% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
                 "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %} ASSISTANT:"
                 "{% endif %}")
IMAGE_TOKENS = 4  # (16 / 8)^2 patches, CLS dropped (vision_feature_select_strategy "default")


def _item(kind="true", seed=0):
    return make_item(entities(0), 3, "country", "river", kind, random.Random(seed))


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory, tiny_lm_dir):
    """The saved dir of a random tiny LLaVA + processor (~1 s to build)."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    from datamodules.common.tokenizer import load_tokenizer
    from lightning_modules.real_vqa.vlm import add_image_token

    tok = load_tokenizer("tiny-lm")
    image_id = add_image_token(tok)  # LLaVA's <image> lives inside the LM's vocabulary: the last row
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=1, num_attention_heads=2, projection_dim=32),
        text_config=LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id),
        image_token_index=image_id, vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny_llava")
    LlavaForConditionalGeneration(config).save_pretrained(out)
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 16},
                                                                   crop_size={"height": 16, "width": 16}),
                               tokenizer=tok, patch_size=8, vision_feature_select_strategy="default",
                               num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return out


def _spec(path, **kw):
    return {"family": "llava", "kind": "image_text_to_text", "pretrained": str(path), "dtype": "float32", **kw}


@pytest.fixture(scope="module")
def hub(tiny_llava):
    from lightning_modules.real_vqa.vlm import build_hub_vlm

    return build_hub_vlm(_spec(tiny_llava)).eval()


def test_hub_adapter_logits_equal_the_hf_model_on_the_processor_output(hub):
    from PIL import Image

    it = _item()
    text = prompt_text(it, "")
    ids = hub.prompt_ids(text, it["image"])
    assert ids.count(hub.image_token_id) == IMAGE_TOKENS
    # the reference: transformers' own chat-template path, images in the messages, on the raw model
    ref = hub.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image", "image": Image.fromarray(it["image"])},
                                      {"type": "text", "text": text.lstrip()}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    assert ref["input_ids"][0].tolist() == ids
    with torch.no_grad():
        want = hub.hf(**ref).logits
        got = hub(input_ids=torch.tensor([ids]), pixel_values=hub.image_inputs([it["image"]])).logits
        other = hub(input_ids=torch.tensor([ids]), pixel_values=hub.image_inputs([255 - it["image"]])).logits
    assert torch.equal(got, want)
    assert not torch.allclose(other[0, -1], got[0, -1])  # the image reaches the logits
    with pytest.raises(ValueError, match="no pixel_values"):
        hub(input_ids=torch.tensor([ids]))


def _hub_module(path, **kw):
    from lightning_modules.real_vqa.module import REALModule

    return REALModule(_spec(path), vision=None, **kw)


def test_hub_loss_supervises_the_target_only_and_lora_stays_on_the_lm(tiny_llava):
    from datamodules.common.tokenizer import load_tokenizer

    m = _hub_module(tiny_llava, sft={"lambda_p": 2.0, "lambda_c": 1.0, "lambda_a": 1.0},
                    lora={"r": 2, "alpha": 4, "targets": ["q_proj", "v_proj"]})
    tok = load_tokenizer(str(tiny_llava))
    m.set_tokenizer(tok)
    m.configure_model()
    m.log = lambda *a, **k: None
    items = [_item("true"), _item("clean", seed=3)]
    batch = m.sft_batch(items)
    seg = batch["segments"]
    for row, it in enumerate(items):
        prompt = m.prompt_ids(it)
        target = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for _, t in target_segments(it, "rpa")) + 1
        assert batch["input_ids"][row, :len(prompt)].tolist() == prompt
        assert (seg[row, :len(prompt)] == -1).all()  # the prompt (image tokens included) is never a label
        assert (seg[row, len(prompt):len(prompt) + target] >= 0).all() and (seg[row, len(prompt) + target:] == -1).all()
    # the loss by hand from the raw model: λ-weighted token-mean CE of each segment over the supervised positions
    logits = m.model.hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        **batch["pixel_values"]).logits[:, :-1].float()
    labels, s = batch["input_ids"][:, 1:], seg[:, 1:]
    want = sum(lam * torch.nn.functional.cross_entropy(logits[s == i], labels[s == i])
               for i, lam in enumerate((2.0, 1.0, 1.0)))
    loss = m.compute_loss(batch)
    assert torch.allclose(loss, want, atol=1e-5)
    # LoRA on the language model's q/v only: the CLIP tower's q_proj / v_proj and the projector stay frozen
    trainable = [n for n, p in m.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "language_model" in n for n in trainable)
    assert not any("lora_" in n for n, _ in m.model.named_parameters() if "vision_tower" in n)
    loss.backward()
    assert all(p.grad is not None for n, p in m.model.named_parameters() if p.requires_grad and "lora_B" in n)


def test_hub_vcd_noises_the_image_tensors_only(tiny_llava):
    from datamodules.common.tokenizer import load_tokenizer

    m = _hub_module(tiny_llava, decoding="vcd", eval={"vcd_noise": 0.5, "max_new_tokens": 6, "answer_tokens": 3})
    m.set_tokenizer(load_tokenizer(str(tiny_llava)))
    m.configure_model()
    m.eval()
    it = _item()
    clean = m.pixels([it])
    ids, noised = m.contrast_inputs(it, {}, clean)
    assert ids == m.prompt_ids(it) and set(noised) == set(clean)
    noise = (noised["pixel_values"] - 0.5 * clean["pixel_values"]) / 0.5  # (1 - g)·image + g·N(0, 1), g = 0.5
    assert abs(float(noise.mean())) < 0.1 and abs(float(noise.std()) - 1) < 0.1
    assert torch.equal(m.contrast_inputs(it, {}, clean)[1]["pixel_values"], noised["pixel_values"])  # seeded per item
    assert m.answer(it)["contrast"]


@pytest.mark.parametrize("mode", ["rpgd", "cad", "vcd"])
def test_hub_cached_contrast_equals_uncached_recomputation(hub, mode):
    it = _item()
    prompt = hub.prompt_ids(prompt_text(it, ""), it["image"])
    pix = hub.image_inputs([it["image"]])
    other_pix = pix
    if mode == "vcd":
        other_pix = {**pix, "pixel_values": 0.5 * pix["pixel_values"] + 0.5 * torch.randn_like(pix["pixel_values"])}
        contrast = prompt
    else:
        passages = [] if mode == "cad" else mask_spans(it["passages"], it["values"])
        contrast = hub.prompt_ids(prompt_text(it, "", passages), it["image"])
    proc = ContrastProcessor(hub, torch.tensor([contrast]), mode, alpha=1.5, beta=0.0, pixel_values=other_pix)
    cached = greedy_decode(hub, torch.tensor([prompt]), 4, eos_id=None, pixel_values=pix, processor=proc)
    seq, manual = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(4):  # both contexts from scratch on the raw model at every step
            z = hub.hf(input_ids=seq, **pix).logits[:, -1].double()
            zc = hub.hf(input_ids=torch.cat([torch.tensor([contrast]), seq[:, len(prompt):]], 1),
                        **other_pix).logits[:, -1].double()
            out = rpgd_logits(z, zc, 1.5, 0.0) if mode == "rpgd" else cad_logits(z, zc, 1.5)  # vcd at beta 0 = cad
            t = int(out.argmax())
            manual.append(t)
            seq = torch.cat([seq, torch.tensor([[t]])], 1)
    assert cached == manual and proc.fed == 3


def test_hub_bad_input():
    from lightning_modules.real_vqa.vlm import build_hub_vlm
    from lightning_modules.real_vqa.module import REALModule

    with pytest.raises(ValueError, match="needs backbone.pretrained"):
        build_hub_vlm({"family": "llava", "kind": "image_text_to_text", "pretrained": None})
    with pytest.raises(ValueError, match="kind: image_text_to_text"):
        REALModule({"family": "llama", "pretrained": "tiny-lm"}, vision=None).setup("fit")


def test_hub_processor_without_torchvision_says_what_to_install(tiny_llava, monkeypatch):
    """Qwen2-VL's AutoProcessor raises transformers' torchvision ImportError on a machine without it (this one):
    the error names the install and the CPU index; other import errors pass through unchanged."""
    import transformers

    from lightning_modules.real_vqa.vlm import build_hub_vlm

    spec = {"family": "llava", "kind": "image_text_to_text", "pretrained": str(tiny_llava)}

    def fails(msg):
        def from_pretrained(*a, **k):
            raise ImportError(msg)
        return from_pretrained

    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained",
                        fails("Qwen2VLVideoProcessor requires the Torchvision library but it was not found"))
    with pytest.raises(ImportError, match=r"needs torchvision.*download.pytorch.org/whl/cpu"):
        build_hub_vlm(spec)
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", fails("no module named foo"))
    with pytest.raises(ImportError, match="^no module named foo$"):
        build_hub_vlm(spec)


def test_real_vqa_llava_experiment_runs_on_a_tiny_saved_llava(tiny_llava, tmp_path):
    """The paper-scale config itself (real_vqa_llava15_7b), its backbone pointed at the tiny saved LLaVA and shrunk
    to one CPU: hub loading, processor prompts, RPA-SFT with LoRA and the RPGD test loop end to end, on its file
    data (a tiny E-VQA / InfoSeek / A-OKVQA set written here; the processor resizes the 40x24 images)."""
    from tests.helpers import run_experiment
    from tests.test_kivqa_files import annotated, plain, write

    root = tmp_path / "data" / "real_vqa"
    for split in ("train", "val", "test"):
        write(root, "evqa", split, [plain(0), plain(1, "blue")])
        write(root, "infoseek", split, [annotated(False), annotated(True)])
        write(root, "aokvqa", split, [plain(2)])
    value, metrics = run_experiment("real_vqa_llava15_7b", tmp_path / "run", [
        f"local.data_root={tmp_path / 'data'}",
        "debug=smoke", "trainer=cpu", "trainer.devices=1", "trainer.accumulate_grad_batches=1", "trainer.max_steps=4",
        "trainer.val_check_interval=4",
        f"backbone.pretrained={tiny_llava}", "backbone.dtype=float32", "backbone.gradient_checkpointing=false",
        "data.batch_size=4", "data.eval_batch_size=2",
        "data.annotator=null",  # offline: E-VQA / A-OKVQA train on answers; InfoSeek's triples carry the conflicts
        "model.eval.max_new_tokens=12", "model.eval.answer_tokens=4", "model.rpgd.trigger=always"])
    test = metrics["results"]["test"]
    assert 0.0 <= value <= 1.0 and value == pytest.approx(test["answer_accuracy"])
    assert {"acc_evqa", "acc_clean", "acc_true", "conflict_accuracy"} <= set(test)  # 4 of the 5 test items (2 batches)
    assert test["contrast_rate"] == 1.0  # trigger=always: RPGD's second context ran on every item


# --- Qwen2-VL: the model and its image processor (its processor needs torchvision, see the module docstring) ----------
@pytest.fixture(scope="module")
def tiny_qwen2vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from lightning_modules.real_vqa.vlm import HubVLM

    config = Qwen2VLConfig(
        text_config={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "bos_token_id": 0, "eos_token_id": 1,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 32, "mlp_ratio": 2, "num_heads": 2, "patch_size": 4,
                       "spatial_merge_size": 2, "temporal_patch_size": 2},
        vision_start_token_id=60, vision_end_token_id=61, image_token_id=62, video_token_id=63)
    torch.manual_seed(0)
    return HubVLM(Qwen2VLForConditionalGeneration(config).eval(), processor=None)


def _qwen_inputs(image, text_ids):
    """Hand-expanded ids (what Qwen2VLProcessor writes: vision_start, one image_pad per merged 2x2 patch group,
    vision_end, then the text) and Qwen2VLImageProcessor's tensors for one image."""
    from transformers import Qwen2VLImageProcessor

    proc = Qwen2VLImageProcessor(min_pixels=16 * 16, max_pixels=64 * 64, patch_size=4, merge_size=2,
                                 temporal_patch_size=2)
    pix = dict(proc(images=[image], return_tensors="pt"))
    n = int(pix["image_grid_thw"].prod()) // 4
    return [5, 60] + [62] * n + [61] + text_ids, pix


def test_qwen2vl_adapter_logits_equal_the_hf_model(tiny_qwen2vl):
    it = _item()
    ids, pix = _qwen_inputs(it["image"], [7, 8, 11, 12])
    x = torch.tensor([ids])
    with torch.no_grad():
        want = tiny_qwen2vl.hf(input_ids=x, mm_token_type_ids=(x == 62).long(), **pix).logits
        got = tiny_qwen2vl(input_ids=x, pixel_values=pix).logits
    assert torch.equal(got, want)


def _two_contexts():
    """A prompt and a contrast context whose images differ in shape, so their M-RoPE offsets differ."""
    import numpy as np

    it = _item()
    prompt, pix = _qwen_inputs(it["image"], [7, 8, 11, 12])
    contrast, cpix = _qwen_inputs(np.concatenate([it["image"], it["image"]], axis=1), [7, 9, 12])
    return prompt, pix, contrast, cpix


def test_qwen2vl_each_cache_keeps_its_own_mrope_offset(tiny_qwen2vl):
    """Two contexts prefilled in turn, then one cached step each: the logits equal a from-scratch forward of each
    (transformers keeps one offset on the model, the second prefill's; the adapter keeps one per cache)."""
    model = tiny_qwen2vl
    prompt, pix, contrast, cpix = _two_contexts()
    with torch.no_grad():
        caches = [model(input_ids=torch.tensor([ids]), pixel_values=p, use_cache=True).past_key_values
                  for ids, p in ((prompt, pix), (contrast, cpix))]
        for (ids, p), cache in zip(((prompt, pix), (contrast, cpix)), caches):
            step = model(input_ids=torch.tensor([[13]]), past_key_values=cache, use_cache=True).logits[0, -1]
            x = torch.tensor([ids + [13]])
            full = model.hf(input_ids=x, mm_token_type_ids=(x == 62).long(), **p).logits[0, -1]
            assert torch.allclose(step, full, atol=1e-5)


@pytest.mark.parametrize("mode", ["rpgd", "cad"])
def test_qwen2vl_cached_contrast_equals_uncached_recomputation(tiny_qwen2vl, mode):
    prompt, pix, contrast, cpix = _two_contexts()
    model = tiny_qwen2vl
    proc = ContrastProcessor(model, torch.tensor([contrast]), mode, alpha=1.5, beta=0.0, pixel_values=cpix)
    cached = greedy_decode(model, torch.tensor([prompt]), 5, eos_id=None, pixel_values=pix, processor=proc)
    seq, manual = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(5):
            c = torch.cat([torch.tensor([contrast]), seq[:, len(prompt):]], 1)
            z = model.hf(input_ids=seq, mm_token_type_ids=(seq == 62).long(), **pix).logits[:, -1].double()
            zc = model.hf(input_ids=c, mm_token_type_ids=(c == 62).long(), **cpix).logits[:, -1].double()
            t = int((rpgd_logits(z, zc, 1.5, 0.0) if mode == "rpgd" else cad_logits(z, zc, 1.5)).argmax())
            manual.append(t)
            seq = torch.cat([seq, torch.tensor([[t]])], 1)
    assert cached == manual
