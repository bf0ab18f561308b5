"""TinyVLM (lightning_modules/real_vqa/vlm.py): text-only inputs reach the LM untouched, image features land exactly at
the ``<image>`` positions, gradients reach the projector, ``generate`` works; the backbone spec's ``kind``."""
from __future__ import annotations

import pytest
import torch

from lightning_modules.common.backbone import build_backbone
from lightning_modules.real_vqa.vlm import TinyVLM, add_image_token, check_vision


@pytest.fixture(scope="module")
def lm_and_tok(tiny_lm_dir):
    from datamodules.common.tokenizer import load_tokenizer

    torch.manual_seed(0)
    lm = build_backbone({"family": "llama", "pretrained": "tiny-lm", "dtype": "float32"}).eval()
    tok = load_tokenizer("tiny-lm")
    return lm, tok


@pytest.fixture(scope="module")
def vlm(lm_and_tok):
    lm, tok = lm_and_tok
    torch.manual_seed(0)
    return TinyVLM(lm, add_image_token(tok)).eval()


def test_image_token_is_outside_the_lm_vocabulary(lm_and_tok, vlm):
    lm, tok = lm_and_tok
    assert vlm.image_token_id == lm.config.vocab_size == len(tok) - 1
    assert add_image_token(tok) == vlm.image_token_id  # idempotent
    ids = tok("<image><image> a", add_special_tokens=False)["input_ids"]
    assert ids[:2] == [vlm.image_token_id] * 2


def test_text_only_logits_are_the_lms_exactly(lm_and_tok, vlm):
    lm, tok = lm_and_tok
    ids = torch.tensor([tok("the river flows into the sea", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(vlm(input_ids=ids).logits, lm(input_ids=ids).logits)


def test_image_features_land_exactly_at_the_placeholders(vlm, lm_and_tok):
    _, tok = lm_and_tok
    text = tok(" what is it?", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([text[:2] + [vlm.image_token_id] * vlm.num_patches + text[2:]])
    pix = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        emb = vlm.embed(ids, pix)
        feats = vlm.image_features(pix)[0]
        words = vlm.get_input_embeddings()(torch.tensor(text))
    assert torch.equal(emb[0, 2:2 + vlm.num_patches], feats)  # patches in order, at the placeholders
    assert torch.equal(emb[0, :2], words[:2]) and torch.equal(emb[0, 2 + vlm.num_patches:], words[2:])
    # the logits are the LM's on exactly these embeddings
    with torch.no_grad():
        assert torch.equal(vlm(input_ids=ids, pixel_values=pix).logits, vlm.lm(inputs_embeds=emb).logits)


def test_images_change_logits_and_gradients_reach_the_projector(vlm, lm_and_tok):
    ids = torch.tensor([[vlm.image_token_id] * vlm.num_patches + [5, 6, 7]])
    a, b = torch.randn(1, 3, 32, 32), torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        assert not torch.allclose(vlm(input_ids=ids, pixel_values=a).logits[0, -1], vlm(input_ids=ids, pixel_values=b).logits[0, -1])
    vlm.zero_grad()
    vlm(input_ids=ids, pixel_values=a).logits[0, -1].logsumexp(-1).backward()
    for mod in (vlm.projector, vlm.vision):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mod.parameters() if p.requires_grad)
    vlm.zero_grad()


def test_generate_with_an_image_matches_a_manual_greedy_loop(vlm):
    ids = torch.tensor([[vlm.image_token_id] * vlm.num_patches + [5, 6]])
    pix = torch.randn(1, 3, 32, 32)
    out = vlm.generate(ids, attention_mask=torch.ones_like(ids), pixel_values=pix, max_new_tokens=4, do_sample=False,
                       eos_token_id=None, pad_token_id=1)
    emb, manual = vlm.embed(ids, pix), []
    with torch.no_grad():
        for _ in range(4):
            t = int(vlm.lm(inputs_embeds=emb).logits[0, -1].argmax())
            manual.append(t)
            emb = torch.cat([emb, vlm.get_input_embeddings()(torch.tensor([[t]]))], dim=1)
    assert out[0, -4:].tolist() == manual


def test_bad_inputs_fail_in_one_line(vlm):
    with pytest.raises(ValueError, match="no pixel_values"):
        vlm(input_ids=torch.tensor([[vlm.image_token_id, 5]]))
    with pytest.raises(ValueError, match="exactly 16"):
        vlm.embed(torch.tensor([[vlm.image_token_id, 5]]), torch.randn(1, 3, 32, 32))
    with pytest.raises(ValueError, match="not divisible"):
        check_vision({"image_size": 30, "patch_size": 8})


def test_backbone_kind_is_checked():
    with pytest.raises(ValueError, match="backbone.kind"):
        build_backbone({"family": "llama", "kind": "seq2seq", "config": {}}, meta=True)
