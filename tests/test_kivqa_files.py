"""real_vqa's file-backed data (datamodules/kivqa_files.py, data.source=files): records, images, bad input, a run."""
from __future__ import annotations

import json

import numpy as np
import pytest

from datamodules.kivqa import KIVQADataModule, to_pixels
from datamodules.kivqa_files import load_splits

P = ["Mount Fuji is in Japan.", "Fuji rises 3776 m.", "It last erupted in 1707.", "A fourth passage."]
RED, BLUE = (200, 30, 30), (20, 40, 220)


def plain(i, colour="red"):
    return {"image": f"img/{colour}.png", "question": f"Where is mountain {i}?", "answer": "Japan",
            "aliases": ["JP"], "passages": P}


def annotated(conflict):
    rec = {"image": "img/blue.png", "question": "Which country is the mountain in?", "answer": "Japan",
           "passages": P[:3], "entity": "Fuji", "relation": "country", "conflict": conflict}
    if conflict:
        rec.update(pivot="country", values=["Japan", "Peru"], passages=[P[0], "Mount Fuji is in Peru.", P[2]])
    return rec


def write(root, dataset, split, records, raw_lines=()):
    d = root / dataset
    (d / "img").mkdir(parents=True, exist_ok=True)
    from PIL import Image

    # 40x24, solid: a resize to 32x32 keeps the colour exactly, so the expected pixels are known by hand
    Image.new("RGB", (40, 24), RED).save(d / "img" / "red.png")
    Image.new("RGB", (40, 24), BLUE).save(d / "img" / "blue.png")
    lines = [json.dumps(r) for r in records] + list(raw_lines)
    (d / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return d / f"{split}.jsonl"


@pytest.fixture
def data_root(tmp_path):
    root = tmp_path / "data" / "real_vqa"
    for split in ("train", "val", "test"):
        write(root, "evqa", split, [plain(0), plain(1, "blue")])
        write(root, "infoseek", split, [annotated(False), annotated(True)])
    write(root, "aokvqa", "test", [plain(2)])  # a test-only benchmark: no train / val files
    return root


def test_items_match_the_records(data_root):
    splits = load_splits(data_root, ["evqa", "infoseek"], k=2, image_size=32)
    test = splits["test"]
    assert len(test) == 4 and len(splits["train"]) == 4
    a, b, c, d = (test[i] for i in range(4))
    # plain E-VQA: answer-only target, unlabelled conflict, first k passages, aliases scored correct
    assert a["task"] == "answer" and a["kind"] == "evqa" and a["conflict"] is None
    assert a["passages"] == P[:2] and a["answer"] == "Japan" and a["answers"] == ["Japan", "JP"]
    assert a["question"] == "Where is mountain 0?"
    # annotated: the synthetic items' keys, so RPA-SFT targets and the conflict scoring apply unchanged
    assert (c["task"], c["kind"], c["conflict"], c["pivot"], c["values"]) == ("vqa", "clean", False, "", [])
    assert (d["task"], d["kind"], d["conflict"], d["pivot"], d["values"]) == ("vqa", "true", True, "country",
                                                                              ["Japan", "Peru"])
    assert d["passages"] == [P[0], "Mount Fuji is in Peru."] and d["entity"] == "Fuji" and d["relation"] == "country"
    from lightning_modules.real_vqa.target import format_target

    assert format_target(a, "rpa") == "<answer>Japan</answer>"
    assert format_target(d, "rpa") == ("<pivots>Fuji; country</pivots><conflict>yes; pivot=country; values=Japan|Peru"
                                       "</conflict><answer>Japan</answer>")
    # images: resized to 32x32, then TinyVLM's normalisation of the solid colour
    for item, colour in ((a, RED), (b, BLUE), (c, BLUE)):
        assert item["image"].shape == (32, 32, 3) and item["image"].dtype == np.uint8
        px = to_pixels(item["image"])
        assert px.shape == (3, 32, 32)
        assert np.allclose(px.numpy(), (np.array(colour, float) / 127.5 - 1.0)[:, None, None], atol=1e-6)
    assert load_splits(data_root, ["evqa"], k=3)["val"][0]["image"].shape == (24, 40, 3)  # no image_size: as stored
    assert a["key"] != b["key"] and a["key"] == splits["test"][0]["key"]
    with_test_only = load_splits(data_root, ["evqa", "aokvqa"])
    assert [len(with_test_only[s]) for s in ("train", "val", "test")] == [2, 2, 3]


def test_bad_input_names_the_file_line_and_field(data_root, tmp_path):
    path = write(data_root, "evqa", "train", [plain(0)], ['{"image": "img/red.png", "question": "q", "passages": []}'])
    with pytest.raises(ValueError, match=rf"^{path}:2: missing field 'answer'$"):
        load_splits(data_root, ["evqa"])
    bad = {**annotated(True)}
    del bad["values"]
    path = write(data_root, "evqa", "train", [plain(0), plain(1), bad])
    with pytest.raises(ValueError, match=rf"^{path}:3: missing field 'values'"):
        load_splits(data_root, ["evqa"])
    path = write(data_root, "evqa", "train", [{**plain(0), "image": "img/nope.png"}])
    with pytest.raises(ValueError, match=rf"{path}:1: image {data_root / 'evqa' / 'img' / 'nope.png'} does not exist"):
        load_splits(data_root, ["evqa"])
    with pytest.raises(ValueError, match="local.data_root"):
        load_splits(tmp_path / "nowhere", ["evqa"])
    with pytest.raises(ValueError, match="local.data_root"):
        load_splits(None, ["evqa"])
    with pytest.raises(ValueError, match="data.source='web'"):
        KIVQADataModule(None, source="web")


def test_real_vqa_tiny_runs_on_files(data_root, tmp_path):
    from tests.helpers import run_experiment

    # debug=smoke shortens training; these shrink what it does not: batch sizes and the decoding lengths
    value, metrics = run_experiment("real_vqa_tiny", tmp_path / "run", [
        "debug=smoke", "trainer.max_steps=4", "trainer.val_check_interval=4", "data.source=files",
        f"local.data_root={data_root.parent}", "data.datasets=[evqa,infoseek,aokvqa]", "data.batch_size=4",
        "data.eval_batch_size=3", "model.eval.max_new_tokens=12", "model.eval.answer_tokens=4"])
    test = metrics["results"]["test"]
    assert value == pytest.approx(test["answer_accuracy"])
    # 5 test items: 2 plain E-VQA + 1 A-OKVQA (answer only: acc_evqa, acc_aokvqa) and 2 annotated InfoSeek (the
    # discriminator is scored on these two only)
    assert {"acc_evqa", "acc_aokvqa", "acc_clean", "acc_true", "conflict_accuracy", "conflict_f1"} <= set(test)
    assert (5 * test["answer_accuracy"]).is_integer() and (2 * test["conflict_accuracy"]).is_integer()
