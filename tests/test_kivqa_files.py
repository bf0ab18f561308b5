"""real_vqa's file-backed data (lightning_modules/real_vqa/data_files.py, data.source=files): records, images, bad input, a run."""
from __future__ import annotations

import json

import numpy as np
import pytest

from lightning_modules.real_vqa.data import KIVQADataModule, to_pixels
from lightning_modules.real_vqa.data_files import load_splits

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
    assert {"acc_evqa", "acc_aokvqa", "acc_infoseek", "acc_clean", "acc_true", "conflict_accuracy",
            "conflict_f1"} <= set(test)
    assert (5 * test["answer_accuracy"]).is_integer() and (2 * test["conflict_accuracy"]).is_integer()


# --- REAL-VQA by injection (data.inject) ---------------------------------------------------------------------------
COUNTRIES, LANGS = ("Japan", "Peru", "Chile", "Italy"), ("Latin", "Malay", "Welsh")


def triple_records():
    """Annotated clean records (pivot triple entity / relation / value = answer) plus three ineligible ones."""
    recs = []
    for i, c in enumerate(COUNTRIES * 2):
        e, lang = f"Mount M{i}", LANGS[i % 3]
        recs.append({"image": "img/red.png", "question": f"Which country is {e} in?", "answer": c,
                     "passages": [f"{e} lies in {c}; people there speak {lang}.", f"{e} is {3000 + i} m high.",
                                  f"Most visitors of {e} are Japanese; it is a {c} landmark."],
                     "entity": e, "relation": "country", "conflict": False})
    for i, lang in enumerate(LANGS):
        recs.append({"image": "img/blue.png", "question": f"What do people speak in town T{i}?", "answer": lang,
                     "passages": [f"In T{i} people speak {lang}."], "entity": f"T{i}", "relation": "language",
                     "conflict": False})
    recs.append(plain(9))  # no triple
    recs.append({**triple_records_base(), "value": "Kenya"})  # the value is stated nowhere
    recs.append(annotated(True))  # already a labelled conflict
    return recs


def triple_records_base():
    return {**annotated(False), "question": "Which country hosts the mountain?"}


def items_of(records):
    from lightning_modules.real_vqa.data_files import parse_record

    return [parse_record(json.dumps(r), f"t:{n}", "realvqa", 3) for n, r in enumerate(records)]


def changed(old, new):
    """The indices of the passages that differ."""
    return [i for i, (a, b) in enumerate(zip(old, new)) if a != b]


def test_injection_true_on_the_pivot_false_off_it_ineligible_clean():
    import re

    from lightning_modules.real_vqa.data_files import _spans, inject_conflicts
    from lightning_modules.real_vqa.target import format_target, parse_output

    items = items_of(triple_records())
    pool = {"country": {*COUNTRIES, "Kenya"}, "language": set(LANGS)}  # every record's value of the relation
    seen = {"true": 0, "false": 0, "clean": 0}
    for seed in range(8):
        out, counts = inject_conflicts(items, seed, true_frac=0.4, false_frac=0.4)
        assert (counts["eligible"], counts["no_triple"], counts["no_value"], counts["labelled"]) == (11, 1, 1, 1)
        assert counts["true"] + counts["false"] + counts["clean"] == 11
        assert out[-3:] == items[-3:]  # ineligible items untouched
        for old, new in zip(items[:11], out[:11]):
            assert set(new) == set(old) and new["answer"] == old["answer"]  # the same keys, the gold unchanged
            seen[new["kind"]] += 1
            if new["kind"] == "clean":
                assert new == old
                continue
            (j,) = changed(old["passages"], new["passages"])  # exactly one passage altered
            v, a, b = old["value"], old["passages"][j], new["passages"][j]
            if new["kind"] == "true":
                (sub,) = set(new["values"]) - {v}
                assert sub in pool[old["relation"]] and new["values"] == sorted([v, sub])
                assert (new["conflict"], new["pivot"]) == (True, old["relation"])
                assert re.sub(rf"(?<!\w){v}(?!\w)", sub, a) == b and not _spans(v, b)  # only the pivot value moved
                parsed = parse_output(format_target(new, "rpa"))  # the RPA target round-trips
                assert (parsed["conflict"], parsed["pivot"], parsed["values"], parsed["answer"], parsed["malformed"]) \
                    == (True, old["relation"], new["values"], old["answer"], False)
                assert parsed["pivots"] == f"{old['entity']}; {old['relation']}"
            else:
                assert (new["conflict"], new["pivot"], new["values"]) == (False, "", [])
                lo = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the edited region of the passage
                hi = len(a) - next(i for i, (x, y) in enumerate(zip(a[::-1], b[::-1])) if x != y)
                assert all(e <= lo or s >= hi for s, e in _spans(v, a))  # the pivot value untouched
                assert len(_spans(v, a)) == len(_spans(v, b))
                parsed = parse_output(format_target(new, "rpa"))
                assert (parsed["conflict"], parsed["values"], parsed["answer"]) == (False, [], old["answer"])
    assert min(seen.values()) > 5  # every kind drawn
    # "Japanese" is not "Japan": a whole-word match only, so the third passage never counts as stating the pivot
    assert not _spans("Japan", "Most visitors are Japanese.")


def test_injection_is_seeded_and_per_item():
    from lightning_modules.real_vqa.data_files import inject_conflicts

    items = items_of(triple_records())
    a, _ = inject_conflicts(items, 3)
    assert a == inject_conflicts(items, 3)[0]
    assert a != inject_conflicts(items, 4)[0]
    assert inject_conflicts(items[::-1], 3)[0] == a[::-1]  # an item's draw depends on the seed and its key only
    assert inject_conflicts(items, 3, 0.0, 0.0)[0] == items
    every, counts = inject_conflicts(items, 3, 1.0, 0.0)
    assert counts["true"] == 11 and all(o["kind"] == "true" for o in every[:11])


def test_inject_switch_through_the_datamodule(tmp_path, caplog):
    import logging

    root = tmp_path / "real_vqa"
    for split in ("train", "val", "test"):
        write(root, "realvqa", split, triple_records())
    with caplog.at_level(logging.INFO, logger="lightning_modules.real_vqa.data_files"):
        dm = KIVQADataModule(None, source="files", root=str(root), datasets=["realvqa"], inject=True, true_frac=1.0,
                             false_frac=0.0, seed=1)
    assert "data.inject test: 11 of 14 items eligible" in caplog.text
    assert [it["kind"] for it in dm.file_splits["test"].items][:11] == ["true"] * 11
    off = KIVQADataModule(None, source="files", root=str(root), datasets=["realvqa"])
    assert {it["kind"] for it in off.file_splits["test"].items[:11]} == {"clean"}
    with pytest.raises(ValueError, match="data.inject=true .* set data.source=files"):
        KIVQADataModule(None, inject=True)
    with pytest.raises(ValueError, match="their sum <= 1"):
        KIVQADataModule(None, source="files", root=str(root), datasets=["realvqa"], inject=True, true_frac=0.7,
                        false_frac=0.5)


# --- pivots from an annotator model (data.annotator) ---------------------------------------------------------------
class FakeEndpoint:
    """Stands in for the endpoint client behind EndpointJudge: replies by the question it sees, counts calls."""

    def __init__(self, replies):
        self.replies, self.calls = replies, []

    def _key(self):  # the judge's check() reads the key before any call; this stand-in needs none
        return None

    def chat(self, text):
        q = next(line for line in text.splitlines() if line.startswith("Question: "))[len("Question: "):]
        self.calls.append(q)
        if q not in self.replies:
            from lightning_modules.common.endpoint import EndpointError

            raise EndpointError("503 after retries")
        return self.replies[q]


def annotator(replies):
    from lightning_modules.common.judge import EndpointJudge

    judge = EndpointJudge(endpoint={"url": "http://unused", "model": "m"}, rubric="pivot")
    judge._client = FakeEndpoint(replies)
    return judge


def test_parse_pivot_reads_json_in_prose_and_flags_the_rest():
    from lightning_modules.real_vqa.data_files import pivot_prompt
    from lightning_modules.common.judge import parse_pivot

    got = parse_pivot('Sure.\n```json\n{"entity": "Mount Fuji", "relation": "Country", "value": "Japan"}\n```')
    assert got == {"entity": "Mount Fuji", "relation": "country", "value": "Japan", "failed": False}
    assert parse_pivot('{"entity": "Fuji", "relation": "country", "value": null}')["value"] is None
    assert not parse_pivot('{"entity": "Fuji", "relation": "country", "value": null}')["failed"]
    for bad in ("no json here", '{"entity": "Fuji", "value": "Japan"}', '{"entity": "", "relation": "c", "value": "J"}'):
        assert parse_pivot(bad)["failed"], bad
    assert pivot_prompt("Where?", ["a.", "b."]) == "Question: Where?\nPassage 1: a.\nPassage 2: b."


def test_annotator_gives_plain_records_a_verified_pivot_cached_and_resumable(tmp_path):
    from lightning_modules.real_vqa.data_files import annotate_pivots

    P0 = ["Mount M0 lies in Peru.", "It is 3000 m high."]
    recs = [{**plain(0), "passages": P0, "answer": "Peru"},  # annotated: the value is stated in a passage
            {**plain(1), "passages": P0, "answer": "Chile"},  # the annotator's value appears nowhere: not a pivot
            {**plain(2), "passages": P0},  # the endpoint fails: not cached, retried next time
            {**plain(3), "passages": P0, "answer": "Peru"},  # the annotator finds no stating passage (null)
            triple_records_base()]  # already annotated: never sent
    items = items_of(recs)
    reply = lambda e, r, v: json.dumps({"entity": e, "relation": r, "value": v})  # noqa: E731
    replies = {"Where is mountain 0?": reply("Mount M0", "country", "Peru"),
               "Where is mountain 1?": reply("Mount M0", "country", "Chile"),
               "Where is mountain 3?": reply("Mount M0", "country", None)}
    judge, cache = annotator(replies), tmp_path / "pivots.jsonl"
    out, counts = annotate_pivots(items, judge, cache)
    assert dict(counts) == {"annotated": 1, "no_value": 2, "failed": 1}
    assert judge._client.calls == [f"Where is mountain {i}?" for i in range(4)]
    a = out[0]
    assert (a["task"], a["kind"], a["dataset"], a["conflict"]) == ("vqa", "clean", "realvqa", False)
    assert (a["entity"], a["relation"], a["value"], a["pivot"], a["values"]) == ("Mount M0", "country", "Peru", "", [])
    assert out[1:4] == items[1:4] and out[4] == items[4]
    assert [json.loads(line)["key"] for line in cache.read_text().splitlines()] == \
        [items[i]["key"] for i in (0, 1, 3)]
    # a second load sends only the failed record; the cached replies give the same items
    judge2 = annotator({**replies, "Where is mountain 2?": reply("Mount M2", "country", "Japan")})
    out2, counts2 = annotate_pivots(items, judge2, cache)
    assert judge2._client.calls == ["Where is mountain 2?"]
    assert (counts2["cached"], counts2["annotated"], counts2["no_value"]) == (3, 1, 3)  # "Japan" is in no passage
    assert out2[0] == a
    # an annotated record is then eligible for the REAL-VQA injection like a Wikidata triple
    from lightning_modules.real_vqa.data_files import inject_conflicts

    pool = items_of(triple_records())
    planted, c = inject_conflicts([a], seed=0, true_frac=1.0, false_frac=0.0, pool=pool + [a])
    assert c["true"] == 1 and planted[0]["conflict"] and "Peru" in planted[0]["values"]
    cache.write_text(cache.read_text() + "not json\n")
    with pytest.raises(ValueError, match=r"pivots.jsonl:5: not a pivot annotation"):
        annotate_pivots(items, judge2, cache)


def test_annotator_through_the_datamodule(tmp_path):
    root = tmp_path / "real_vqa"
    rec = {**plain(0), "passages": ["Mount M0 lies in Peru."], "answer": "Peru"}
    for split in ("train", "val", "test"):
        write(root, "evqa", split, [rec])
    judge = annotator({"Where is mountain 0?": json.dumps({"entity": "M0", "relation": "country", "value": "Peru"})})
    dm = KIVQADataModule(None, source="files", root=str(root), datasets=["evqa"], annotator=judge,
                         annotation_cache=str(root / "pivots.jsonl"))
    (it,) = dm.file_splits["test"].items
    assert (it["task"], it["relation"], it["value"], it["dataset"]) == ("vqa", "country", "Peru", "evqa")
    assert len(judge._client.calls) == 1  # one record, three splits: the same key is asked once
    with pytest.raises(ValueError, match="data.annotator .* set data.source=files"):
        KIVQADataModule(None, annotator=judge)


# --- the paper-scale experiments build the conflicts (issue 39) ------------------------------------------------------
def test_paper_scale_builds_conflicts_or_refuses(tmp_path):
    """real_vqa_*_7b inject conflicts and annotate triple-less records by default; with neither possible the run is
    refused in one line (before: RPA-SFT trained answers only and RPGD never triggered, silently)."""
    from tests.helpers import compose

    for name in ("real_vqa_qwen2vl_7b", "real_vqa_llava15_7b"):
        data = compose(name).data
        assert data.inject and data.require_conflicts
        assert data.annotator._target_.endswith("EndpointJudge") and data.annotator.rubric == "pivot"
    plain_root, triples_root = tmp_path / "plain", tmp_path / "triples"
    for split in ("train", "val", "test"):
        write(plain_root, "evqa", split, [plain(0), plain(1, "blue")])
        write(triples_root, "infoseek", split, triple_records())
    kw = dict(source="files", inject=True, require_conflicts=True, true_frac=0.5, false_frac=0.25)
    with pytest.raises(ValueError, match="data.require_conflicts: the train split holds no pivot conflict"):
        KIVQADataModule(None, root=str(plain_root), datasets=["evqa"], **kw)      # no triple, no annotator
    from lightning_modules.common.judge import EndpointJudge

    no_url = EndpointJudge(endpoint=None, rubric="pivot")                        # the default without an endpoint
    with pytest.raises(ValueError, match=r"data.annotator cannot run .*6 records have no pivot triple"):
        KIVQADataModule(None, root=str(plain_root), datasets=["evqa"], annotator=no_url, **kw)
    dm = KIVQADataModule(None, root=str(triples_root), datasets=["infoseek"], **kw)
    assert sum(it["conflict"] is True for it in dm.file_splits["train"].items) > 0   # triples: conflicts built


def test_the_base_mllm_arm_is_the_untrained_model_on_the_same_items():
    """The main table compares REAL with the base MLLM: real_vqa_<model>_base evaluates the model as is (no LoRA, no
    RPA-SFT, greedy) on the REAL arm's data pipeline."""
    from tests.helpers import compose

    for model in ("qwen2vl_7b", "llava15_7b"):
        real, base = compose(f"real_vqa_{model}"), compose(f"real_vqa_{model}_base")
        assert base.task == "test" and base.model.lora is None and base.model.decoding == "greedy"
        assert base.model.sft.target == "answer_only" and base.backbone == real.backbone
        assert base.data.inject == real.data.inject and base.data.datasets == real.data.datasets
        assert "Table main" in base.paper.reproduces
