"""InBedder's instruction-awareness tests from local jsonl (lightning_modules/instemb/mteb_eval.py): V-measure and
cosine Spearman as mteb computes them, against a planted truth and scipy; bad files say file:line and what to fix;
``--tasks InBedder`` runs end to end without mteb. A stub stands in for the model: it embeds the attribute the
instruction asks about (colour or shape) as a one-hot, so which clustering it recovers shows the instruction got in."""
import itertools
import json
import sys
import types
import zlib

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from lightning_modules.instemb import mteb_eval
from lightning_modules.instemb.mteb_eval import INBEDDER, MtebEncoder, inbedder_mteb_task, load_inbedder, score_inbedder

COLOURS, SHAPES = ["red", "blue", "green"], ["cube", "ball", "cone"]
OBJECTS = [(c, s, k) for c, s in itertools.product(COLOURS, SHAPES) for k in range(2)]  # colour independent of shape
TEXTS = [f"Item {k}: a {c} {s} on the table." for c, s, k in OBJECTS]
# STS: five pairs whose cosines are cos(0), cos(.3), ... (decreasing); gold scores rank them with one adjacent swap
ANGLES = [0.0, 0.3, 0.6, 0.9, 1.2]
PAIRS = [(f"left {i}", f"right {i}") for i in range(len(ANGLES))]
GOLD = [5.0, 4.0, 2.5, 3.0, 1.0]  # Spearman = 1 - 6 * 2 / (5 * 24) = 0.9


class Stub:
    """``InstEmbModule.encode``'s signature; one-hot of the asked attribute's word, fixed unit vectors for PAIRS."""
    model = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=6))

    def __init__(self, constant: bool = False, noise: float = 0.0):
        self.constant, self.noise = constant, noise

    def vector(self, text: str, instruction: str) -> torch.Tensor:
        v = torch.zeros(6)
        if self.constant:
            return v + 1
        if text.startswith(("left ", "right ")):  # PAIRS: unit vectors at angle 0 and ANGLES[i]
            a = ANGLES[int(text.split()[1])] if text.startswith("right") else 0.0
            v[0], v[1] = np.cos(a), np.sin(a)
            return v
        words, off = (COLOURS, 0) if "colour" in instruction else (SHAPES, 3)
        for j, w in enumerate(words):
            if w in text:
                v[off + j] = 1
        if self.noise:  # deterministic per text, so the mteb and direct paths see the same vectors
            g = torch.Generator().manual_seed(zlib.crc32(text.encode()))
            v += self.noise * torch.randn(6, generator=g)
        return v

    def encode(self, texts, instructions, pooling=None):
        if isinstance(instructions, str):
            instructions = [instructions] * len(texts)
        return torch.stack([self.vector(t, q) for t, q in zip(texts, instructions)])


def clustering_data(attr: str) -> dict:
    return {"text": TEXTS, "label": [c if attr == "colour" else s for c, s, _ in OBJECTS]}


STS = {"sentence1": [a for a, _ in PAIRS], "sentence2": [b for _, b in PAIRS], "score": GOLD}


def test_v_measure_recovers_the_planted_clusters():
    enc = MtebEncoder(Stub())
    by_colour = clustering_data("colour")
    assert score_inbedder(enc, "IntentEmotion", by_colour, "What colour is it?") == pytest.approx(1.0)
    # the other instruction embeds shape, independent of colour by design: V-measure 0
    assert score_inbedder(enc, "IntentEmotion", by_colour, "What shape is it?") == pytest.approx(0.0, abs=1e-9)
    assert score_inbedder(enc, "NYTClustering", clustering_data("shape"), "What shape?") == pytest.approx(1.0)
    assert score_inbedder(MtebEncoder(Stub(constant=True)), "IntentEmotion", by_colour, "What colour?") == \
        pytest.approx(0.0, abs=1e-9)


def test_sts_spearman_matches_scipy():
    cos = np.cos(ANGLES)  # the stub's pairs: unit vectors at angle 0 and ANGLES[i]
    got = score_inbedder(MtebEncoder(Stub()), "InstructSTSB", STS, "anything")
    assert got == pytest.approx(spearmanr(cos, GOLD).statistic) and got == pytest.approx(0.9)


def write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_bad_files_say_where(tmp_path):
    with pytest.raises(ValueError, match=r"^IntentEmotion is read from a local file: set --inbedder-dir"):
        load_inbedder("IntentEmotion", None)
    with pytest.raises(ValueError) as exc:
        load_inbedder("NYTClustering", tmp_path)
    assert str(tmp_path / "NYTClustering.jsonl") in str(exc.value) and "--inbedder-dir" in str(exc.value)
    f = tmp_path / "IntentEmotion.jsonl"
    write(f, [{"text": "a", "label": "x"}, {"text": "b", "lable": "y"}])
    with pytest.raises(ValueError, match=rf"^{f}:2: record has no field 'label'; a clustering record is"):
        load_inbedder("IntentEmotion", tmp_path)
    write(f, [{"text": "a", "label": "x"}, "", "{oops"])
    with pytest.raises(ValueError, match=rf"^{f}:3: malformed JSON record"):
        load_inbedder("IntentEmotion", tmp_path)
    write(f, [{"text": "a", "label": "x"}, {"text": "b", "label": "x"}])
    with pytest.raises(ValueError, match="fewer than 2 distinct labels"):
        load_inbedder("IntentEmotion", tmp_path)
    g = tmp_path / "InstructSTSB.jsonl"
    write(g, [{"sentence1": "a", "sentence2": "b", "score": 1}, {"sentence1": "a", "sentence2": "c"}])
    with pytest.raises(ValueError, match=rf"^{g}:2: record has no field 'score'"):
        load_inbedder("InstructSTSB", tmp_path)
    write(g, [{"sentence1": "a", "sentence2": "b", "score": "high"}])
    with pytest.raises(ValueError, match=rf"^{g}:1: 'score' is 'high', not a number"):
        load_inbedder("InstructSTSB", tmp_path)


@pytest.mark.parametrize("with_mteb", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_cli(with_mteb, monkeypatch, tmp_path):
    if with_mteb:  # the files become mteb task objects and go through mteb.evaluate
        pytest.importorskip("mteb")
    else:  # not installed: the local tasks are scored directly
        monkeypatch.setitem(sys.modules, "mteb", None)
    monkeypatch.setattr(mteb_eval, "load_module", lambda *a, **k: Stub())
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # main() sets these; restored after
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run, data = tmp_path / "run", tmp_path / "inbedder"
    (run / ".hydra").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    (run / ".hydra" / "config.yaml").write_text("{}")
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    data.mkdir()
    for name, attr in (("IntentEmotion", "colour"), ("NYTClustering", "shape")):
        d = clustering_data(attr)
        write(data / f"{name}.jsonl", [{"text": t, "label": lab} for t, lab in zip(d["text"], d["label"])])
    write(data / "InstructSTSB.jsonl", [dict(zip(STS, r)) for r in zip(*STS.values())])
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"IntentEmotion": "What colour is it?"}))  # NYTClustering keeps its default
    assert "colour" not in INBEDDER["NYTClustering"][1]
    argv = ["--checkpoint", str(run), "--tasks", "InBedder", "--output", str(tmp_path / "out"), "--device", "cpu"]
    with pytest.raises(SystemExit, match="set --inbedder-dir"):
        mteb_eval.main(argv)
    summary = mteb_eval.main(argv + ["--inbedder-dir", str(data), "--prompts", str(prompts)])
    assert summary == pytest.approx({"IntentEmotion": 1.0, "InstructSTSB": 0.9, "NYTClustering": 1.0})
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())["main_score"]
    assert saved == summary
    record = json.loads((tmp_path / "out" / "IntentEmotion.json").read_text())
    if not with_mteb:  # else mteb's own TaskResult file
        assert record["instruction"] == "What colour is it?" and record["metric"] == "v_measure" and record["n"] == 18


@pytest.mark.slow
def test_mteb_task_objects_score_as_the_direct_path():
    """With mteb installed, the local files as mteb task objects give the scores computed without it."""
    mteb = pytest.importorskip("mteb")
    enc = MtebEncoder(Stub(noise=0.8))  # overlapping clusters: a V-measure strictly between 0 and 1
    sts = {**STS, "sentence2": [f"Item {i}: a red ball" for i in range(5)]}  # noisy vectors, unplanted ranks
    data = {"IntentEmotion": clustering_data("colour"), "InstructSTSB": sts}
    instruction = {"IntentEmotion": "What colour?", "InstructSTSB": "What colour?"}
    direct = {n: score_inbedder(enc, n, d, instruction[n]) for n, d in data.items()}
    tasks = [inbedder_mteb_task(n, d, instruction[n]) for n, d in data.items()]
    result = mteb.evaluate(enc, tasks, cache=None, overwrite_strategy="always", show_progress_bar=False)
    got = {tr.task_name: tr.get_score() for tr in result.task_results}
    assert 0.05 < direct["IntentEmotion"] < 0.95
    assert got == pytest.approx(direct, abs=1e-6)
