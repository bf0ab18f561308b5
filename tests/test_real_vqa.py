"""REAL (issue 23): RPGD / CAD / VCD operators, the cached contrast processor, the target format, the KI-VQA data's
planted conflicts and splits, the segment-weighted loss, bad input, and the tiny run end to end."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from lightning_modules.real_vqa.data import KIVQADataModule, RELATIONS, entities, generate_items, make_item, shuffle_patches
from lightning_modules.real_vqa.decoding import (ContrastProcessor, cad_logits, greedy_decode, orthogonal_part,
                                                 plausibility_cut, rpgd_logits, vcd_logits)
from lightning_modules.real_vqa.target import (consistent_passages, format_target, keyword_mismatch, mask_spans,
                                               parse_output, target_segments)
from tests.helpers import run_experiment


# --- RPGD / CAD / VCD ------------------------------------------------------------------------------
def test_rpgd_alpha_zero_and_identical_contexts_give_z_full():
    torch.manual_seed(0)
    z, zp = torch.randn(4, 50, dtype=torch.float64), torch.randn(4, 50, dtype=torch.float64)
    assert torch.equal(rpgd_logits(z, zp, alpha=0.0, beta=0.0), z)
    assert torch.equal(rpgd_logits(z, z, alpha=1.7, beta=0.0), z)
    cut = rpgd_logits(z, z, alpha=1.7, beta=0.1)  # with the cut: z_full on the kept tokens, -inf elsewhere
    keep = torch.isfinite(cut)
    assert torch.equal(cut[keep], z[keep]) and keep.any(1).all()


def test_orthogonal_part_is_orthogonal_and_hand_worked():
    torch.manual_seed(1)
    z, d = torch.randn(8, 300, dtype=torch.float64), torch.randn(8, 300, dtype=torch.float64)
    assert (orthogonal_part(d, z) * z).sum(-1).abs().max() < 1e-10
    # z = (3, 4, 0), d = (1, 0, 0): <d, z_hat> = 0.6, d_perp = (0.64, -0.48, 0); alpha 2 adds twice that
    zf, zp = torch.tensor([3.0, 4.0, 0.0], dtype=torch.float64), torch.tensor([4.0, 4.0, 0.0], dtype=torch.float64)
    assert torch.allclose(rpgd_logits(zf, zp, alpha=2.0, beta=0.0), torch.tensor([4.28, 3.04, 0.0], dtype=torch.float64))
    assert torch.allclose(rpgd_logits(zf, zp, alpha=2.0, beta=0.0, orthogonalize=False),
                          torch.tensor([5.0, 4.0, 0.0], dtype=torch.float64))


def test_no_token_under_the_plausibility_cut_is_chosen():
    torch.manual_seed(2)
    z, zp = torch.randn(64, 40), 20 * torch.randn(64, 40)
    for beta in (0.1, 0.5):
        pick = rpgd_logits(z, zp, alpha=2.0, beta=beta).argmax(-1)
        p = torch.softmax(z, -1)
        assert (p.gather(1, pick[:, None]).squeeze(1) >= beta * p.max(-1).values).all()
        pick = vcd_logits(z, zp, alpha=2.0, beta=beta).argmax(-1)
        assert (p.gather(1, pick[:, None]).squeeze(1) >= beta * p.max(-1).values).all()
    # without the cut a large contrast does pick such tokens here: the cut is what prevents it
    pick = rpgd_logits(z, zp, alpha=2.0, beta=0.0).argmax(-1)
    assert (torch.softmax(z, -1).gather(1, pick[:, None]).squeeze(1) < 0.1 * torch.softmax(z, -1).max(-1).values).any()


def test_cad_and_vcd_hand_worked():
    assert torch.equal(cad_logits(torch.tensor([2.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0]), 1.0),
                       torch.tensor([3.0, 1.0, -1.0]))
    # VCD, alpha 0.5: 1.5·(2, 1, -3) − 0.5·(0, 2, 0) = (3, 0.5, -4.5); p_clean(3rd) = 0.0049 < 0.1·0.730: cut
    out = vcd_logits(torch.tensor([2.0, 1.0, -3.0]), torch.tensor([0.0, 2.0, 0.0]), 0.5, 0.1)
    assert torch.equal(out, torch.tensor([3.0, 0.5, float("-inf")]))
    assert torch.equal(plausibility_cut(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]), 0.99), torch.tensor([1.0, 2.0]))


@pytest.fixture(scope="module")
def small_lm():
    from lightning_modules.common.backbone import build_backbone

    torch.manual_seed(0)
    return build_backbone({"family": "llama", "config": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                                                          "num_hidden_layers": 2, "num_attention_heads": 2,
                                                          "num_key_value_heads": 2}}).eval()


@pytest.mark.parametrize("mode", ["rpgd", "cad"])
def test_cached_contrast_equals_uncached_recomputation(small_lm, mode):
    prompt, contrast = torch.tensor([[3, 9, 12, 5, 7]]), torch.tensor([[3, 9, 40, 7]])
    proc = ContrastProcessor(small_lm, contrast, mode, alpha=1.5, beta=0.0)
    cached = greedy_decode(small_lm, prompt, 8, eos_id=None, processor=proc)
    seq, manual = prompt, []
    with torch.no_grad():
        for _ in range(8):  # both contexts recomputed from scratch at every step
            z = small_lm(input_ids=seq).logits[:, -1].double()
            zc = small_lm(input_ids=torch.cat([contrast, seq[:, prompt.shape[1]:]], 1)).logits[:, -1].double()
            out = rpgd_logits(z, zc, 1.5, 0.0) if mode == "rpgd" else cad_logits(z, zc, 1.5)
            t = int(out.argmax())
            manual.append(t)
            seq = torch.cat([seq, torch.tensor([[t]])], 1)
    assert cached == manual and len(cached) == 8
    assert proc.fed == 7  # the contrast cache fed one token per later step


# --- target format -------------------------------------------------------------------------------
def _item(kind="true", rel="country", other="river", e=3, seed=0):
    import random

    return make_item(entities(0), e, rel, other, kind, random.Random(seed))


def test_target_round_trips():
    for kind in ("clean", "true", "false", "patch_shuffle"):
        it = _item(kind)
        out = parse_output(format_target(it, "rpa"))
        assert out["conflict"] == it["conflict"] and not out["malformed"]
        assert out["answer"] == it["answer"] and out["pivots"] == f"{it['entity']}; {it['relation']}"
        if it["conflict"]:
            assert out["pivot"] == it["pivot"] and out["values"] == it["values"]
    assert [s for s, _ in target_segments(_item(), "conflict_only")] == ["conflict", "answer"]
    assert [s for s, _ in target_segments(_item(), "answer_only")] == ["answer"]


def test_malformed_output_parses_as_no_conflict_flagged():
    for text in ("<conflict>maybe</conflict><answer>Peru</answer>", "<pivots>x</pivots><answer>Peru", ""):
        out = parse_output(text)
        assert out["conflict"] is False and out["malformed"] is True


# --- data ------------------------------------------------------------------------------------------
def _facts(p: str) -> dict:
    return dict(re.findall(r"its (\w+) is (\w+)", p))


def test_true_conflicts_differ_on_the_pivot_only_false_ones_off_it():
    for seed in range(20):
        for kind in ("clean", "true", "false"):
            it = _item(kind, seed=seed)
            facts = [_facts(p) for p in it["passages"]]
            piv = {f[it["relation"]] for f in facts}
            oth = {f[it["other"]] for f in facts}
            assert len(piv) == (2 if kind == "true" else 1) and len(oth) == (2 if kind == "false" else 1)
            assert it["answer"] in piv and it["conflict"] == (kind == "true")
    # keyword mismatch flags both kinds; a pivot-aware rule would flag only the true one
    assert keyword_mismatch(_item("true")["passages"]) and keyword_mismatch(_item("false")["passages"])
    assert not keyword_mismatch(_item("clean")["passages"])


def test_contrast_contexts():
    it = _item("true")
    masked = mask_spans(it["passages"], it["values"])
    assert all(v not in p for p in masked for v in it["values"]) and all("___" in p for p in masked)
    kept = consistent_passages(it["passages"], it["values"])
    assert len(kept) == 2 and all(_facts(p)[it["relation"]] == it["answer"] for p in kept)


def test_patch_shuffle_keeps_the_pixel_multiset():
    import random

    it = _item("patch_shuffle")
    ent = next(e for e in entities(0) if e["name"] == it["entity"])
    from lightning_modules.real_vqa.data import draw

    clean = draw(ent["shape"], ent["colour"], ent["glyph"])
    shuffled = shuffle_patches(clean, 8, random.Random(0))
    assert not np.array_equal(clean, shuffled)
    key = lambda a: np.sort(a.reshape(-1, 3).view([("r", "u1"), ("g", "u1"), ("b", "u1")]).ravel())  # noqa: E731
    assert np.array_equal(key(clean), key(shuffled)) and np.array_equal(key(clean), key(it["image"]))
    assert it["conflict"] and it["pivot"] == "entity" and it["entity"] not in it["passages"][0]


def test_held_out_relations_never_reach_training(tiny_tokenizer):
    dm = KIVQADataModule(tiny_tokenizer, n_train=200, n_val=20, n_test=40, seed=0)
    dm.setup()
    held = set(dm.held_out_relations)
    train_rels = {r for it in dm.train for r in (it.get("relation"), it.get("other")) if r}
    train_text = " ".join(" ".join(it["passages"]) + it["question"] for it in dm.train)
    assert not train_rels & held and not any(h in train_text for h in held)
    assert any(it["held_out"] for it in dm.eval_items["test"]) and not any(it["held_out"] for it in dm.eval_items["val"])
    keys = {s: {it["key"] for it in items} for s, items in [("train", dm.train), *dm.eval_items.items()]}
    assert not keys["train"] & keys["test"] and not keys["train"] & keys["val"] and not keys["val"] & keys["test"]
    assert set(RELATIONS) - held <= train_rels
    with pytest.raises(ValueError, match="held_out_relations"):
        KIVQADataModule(tiny_tokenizer, held_out_relations=["colour"])
    assert len(generate_items(10, 0, "test")) == 10


# --- the module --------------------------------------------------------------------------------------
def _module(**kw):
    from lightning_modules.real_vqa.module import REALModule

    spec = {"family": "llama", "pretrained": "tiny-lm", "dtype": "float32"}
    return REALModule(spec, vision={"image_size": 32, "patch_size": 8}, **kw)


def test_loss_is_the_weighted_sum_of_segment_ces(tiny_lm_dir):
    from datamodules.common.tokenizer import load_tokenizer

    m = _module(sft={"lambda_p": 2.0, "lambda_c": 0.0, "lambda_a": 1.0})
    m.set_tokenizer(load_tokenizer("tiny-lm"))
    m.configure_model()
    items = [_item("true"), _item("clean", seed=3)]
    batch = m.sft_batch(items)
    seg = batch["segments"]
    prompt_len = m.model.num_patches + len(m.tokenizer(" ").input_ids)
    assert (seg[:, :prompt_len] == -1).all() and set(seg.unique().tolist()) == {-1, 0, 1, 2}
    parts = m.segment_losses(batch)
    m.log = lambda *a, **k: None
    assert torch.allclose(m.compute_loss(batch), 2 * parts["pivots"] + parts["answer"])
    # the answer CE by hand: next-token CE over the answer tokens only
    logits = m.model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"]).logits[:, :-1]
    mask = seg[:, 1:] == 2
    ce = torch.nn.functional.cross_entropy(logits[mask], batch["input_ids"][:, 1:][mask])
    assert torch.allclose(parts["answer"], ce, atol=1e-5)


@pytest.mark.parametrize("kw, match", [
    ({"decoding": "beam"}, "model.decoding"),
    ({"sft": {"target": "pivots_only"}}, "model.sft.target"),
    ({"rpgd": {"contrast": "drop_all"}}, "model.rpgd.contrast"),
    ({"rpgd": {"alpha": -0.5}}, "alpha"),
    ({"rpgd": {"beta": 1.0}}, "beta"),
    ({"sft": {"target": "answer_only"}}, "answer_only trains no"),
])
def test_bad_config_fails_at_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        _module(**kw)


def test_vcd_needs_images_and_patches_tile_the_image():
    from lightning_modules.real_vqa.module import REALModule

    with pytest.raises(ValueError, match="vcd"):
        REALModule({"family": "llama", "pretrained": "tiny-lm"}, vision=None, decoding="vcd")
    with pytest.raises(ValueError, match="not divisible"):
        REALModule({"family": "llama", "pretrained": "tiny-lm"}, vision={"image_size": 30, "patch_size": 8})


def test_real_vqa_tiny_runs(tmp_path):
    # debug=smoke shortens training; these shrink what it does not: the data pools and the decoding lengths. A best
    # checkpoint is kept (debug=smoke keeps none), so its monitor is read at validation, as a real run's is
    value, metrics = run_experiment("real_vqa_tiny", tmp_path, [
        "debug=smoke", "data.n_train=64", "data.n_val=4", "data.n_test=8", "data.eval_batch_size=4",
        "data.batch_size=8", "model.eval.max_new_tokens=20", "model.eval.answer_tokens=6",
        "callbacks.model_checkpoint.save_top_k=1"])
    test = metrics["results"]["test"]
    assert 0.0 <= value <= 1.0 and value == pytest.approx(metrics["results"]["val"]["answer_accuracy"])
    assert metrics["best"]["metric"] == "val/answer_accuracy" and metrics["best"]["step"] in (10, 20)
    assert list((tmp_path / "checkpoints").glob("best-step*.ckpt"))  # the test loop ran on the best checkpoint
    assert {"conflict_accuracy", "conflict_f1", "malformed", "contrast_rate"} <= set(test)
