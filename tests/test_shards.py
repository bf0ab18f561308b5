"""Pretokenize-and-pack: shards hold exactly the tokenized documents, builds resume atomically, and the
shard datamodule streams windows in the resumable step-keyed order."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from datamodules.common import shards as S
from datamodules.common.loaders import MalformedRecordError


def docs_for(k: int, n: int = 40) -> list[str]:
    return [f"Source {k} document {i}: the quick brown fox {i * k} jumps over {i % 5} lazy dogs." for i in range(n)]


@pytest.fixture()
def corpus(tmp_path):
    """Three sources in three formats: jsonl, jsonl.gz, parquet; plus one .txt book."""
    import pandas as pd

    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs_for(1)))
    with gzip.open(d / "b.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps({"text": t, "meta": 1}) + "\n" for t in docs_for(2)))
    pd.DataFrame({"text": docs_for(3)}).to_parquet(d / "c.parquet")
    return d


def expected_tokens(tokenizer, source: str, docs: list[str], val_fraction: float, test_fraction: float):
    out = {"train": [], "val": [], "test": []}
    for row, text in enumerate(docs):
        split = S.document_split(source, row, val_fraction, test_fraction)
        out[split] += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return out


def test_shards_hold_exactly_the_tokenized_documents(corpus, tmp_path, tiny_tokenizer):
    out = tmp_path / "shards"
    files = [str(corpus / "a.jsonl"), str(corpus / "b.jsonl.gz"), str(corpus / "c.parquet")]
    index = S.build_shards(files, tiny_tokenizer, out, val_fraction=0.2, test_fraction=0.2, batch_docs=7,
                           progress=False)
    assert index["complete"] and index["dtype"] == "uint16" and index["vocab_size"] == len(tiny_tokenizer)
    for k, name in enumerate(["a.jsonl", "b.jsonl.gz", "c.parquet"], 1):
        entry = index["sources"][str(corpus / name)]
        want = expected_tokens(tiny_tokenizer, name, docs_for(k), 0.2, 0.2)
        for split in ("train", "val", "test"):
            got = np.fromfile(out / entry[split]["file"], dtype=np.uint16)
            assert got.tolist() == want[split], (name, split)
            assert entry[split]["tokens"] == len(want[split])
        assert entry["train"]["docs"] + entry["val"]["docs"] + entry["test"]["docs"] == 40
        assert 0 < entry["val"]["docs"] < 20 and 0 < entry["test"]["docs"] < 20  # ~20% each held out by hash
    assert not list(out.glob("*.tmp"))
    assert json.loads((out / "index.json").read_text()) == index


def test_split_is_stable_and_near_the_fraction():
    rows = [S.document_split("f.jsonl", i, 0.1, 0.05) for i in range(20000)]
    assert abs(rows.count("val") / len(rows) - 0.1) < 0.01 and abs(rows.count("test") / len(rows) - 0.05) < 0.01
    assert rows == [S.document_split("f.jsonl", i, 0.1, 0.05) for i in range(20000)]
    # a document held out for validation stays held out whatever the test share
    assert [r == "val" for r in rows] == [S.document_split("f.jsonl", i, 0.1, 0.0) == "val" for i in range(20000)]
    assert {S.document_split("f.jsonl", i, 0.0, 0.0) for i in range(1000)} == {"train"}


def test_dtype_widens_for_large_vocabularies():
    assert S.token_dtype(2048) is np.uint16 and S.token_dtype(65536) is np.uint16
    assert S.token_dtype(65537) is np.uint32 and S.token_dtype(152064) is np.uint32


def test_interrupted_build_resumes_without_redoing_finished_sources(corpus, tmp_path, tiny_tokenizer, monkeypatch):
    files = str(corpus / "*")
    ref = S.build_shards(files, tiny_tokenizer, tmp_path / "ref", val_fraction=0.1, progress=False)

    out = tmp_path / "shards"
    real = S.iter_documents
    calls = []

    def crash_on_second(path, field="text", batch_rows=1024):
        calls.append(path.name)
        if len(calls) == 2:
            yield next(real(path, field))
            raise KeyboardInterrupt("killed mid-source")
        yield from real(path, field, batch_rows)

    monkeypatch.setattr(S, "iter_documents", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        S.build_shards(files, tiny_tokenizer, out, val_fraction=0.1, progress=False)
    partial = S.read_index(out)
    assert not partial["complete"] and list(partial["sources"]) == [str(corpus / "a.jsonl")]
    assert sorted(p.name for p in out.glob("*.bin")) == ["test-00000.bin", "train-00000.bin", "val-00000.bin"]  # no half shard visible
    with pytest.raises(FileNotFoundError, match="no complete shard index"):
        S.TokenShards(out, "train", 16)

    def counting(path, field="text", batch_rows=1024):
        calls.append(path.name)
        yield from real(path, field, batch_rows)

    calls.clear()
    monkeypatch.setattr(S, "iter_documents", counting)
    index = S.build_shards(files, tiny_tokenizer, out, val_fraction=0.1, progress=False)
    assert calls == ["b.jsonl.gz", "c.parquet"]  # a.jsonl was not read again
    assert index["sources"] == ref["sources"]
    for f in (tmp_path / "ref").glob("*.bin"):
        assert (out / f.name).read_bytes() == f.read_bytes()
    calls.clear()
    S.build_shards(files, tiny_tokenizer, out, val_fraction=0.1, progress=False)
    assert calls == []  # complete: nothing read


def test_other_settings_are_refused(corpus, tmp_path, tiny_tokenizer):
    out = tmp_path / "shards"
    S.build_shards(str(corpus / "a.jsonl"), tiny_tokenizer, out, val_fraction=0.1, progress=False)
    with pytest.raises(ValueError, match="other settings.*val_fraction"):
        S.build_shards(str(corpus / "a.jsonl"), tiny_tokenizer, out, val_fraction=0.2, progress=False)


def test_bad_sources_name_the_fix(tmp_path, tiny_tokenizer):
    f = tmp_path / "x.jsonl"
    f.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(MalformedRecordError, match=rf"{f}:2: .*'text'"):
        S.build_shards(str(f), tiny_tokenizer, tmp_path / "s", progress=False)
    with pytest.raises(FileNotFoundError, match="data.files"):
        S.build_shards(str(tmp_path / "none*.jsonl"), tiny_tokenizer, tmp_path / "s2", progress=False)


def test_txt_is_one_document_per_file(tmp_path):
    (tmp_path / "book.txt").write_text("Chapter 1\n\nIt was a dark night.\n")
    assert list(S.iter_documents(tmp_path / "book.txt")) == ["Chapter 1\n\nIt was a dark night.\n"]


def test_windows_never_straddle_shards(corpus, tmp_path, tiny_tokenizer):
    out = tmp_path / "shards"
    index = S.build_shards(str(corpus / "*"), tiny_tokenizer, out, val_fraction=0.0, test_fraction=0.0, progress=False)
    seq = 32
    ds = S.TokenShards(out, "train", seq)
    entries = sorted(index["sources"].values(), key=lambda e: e["train"]["file"])
    assert len(ds) == sum(e["train"]["tokens"] // seq for e in entries)
    flat = [np.fromfile(out / e["train"]["file"], dtype=np.uint16) for e in entries]
    i = 0
    for arr in flat:
        for w in range(len(arr) // seq):
            assert ds[i]["input_ids"].tolist() == arr[w * seq:(w + 1) * seq].tolist()
            i += 1
    with pytest.raises(IndexError):
        ds[len(ds)]
    import pickle

    ds2 = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker gets: no arrays inside
    assert not ds2._maps and torch.equal(ds2[5]["input_ids"], ds[5]["input_ids"])


class _FakeTrainer:
    def __init__(self, step, max_steps):
        self.global_step, self.max_steps = step, max_steps
        self.accumulate_grad_batches, self.global_rank, self.world_size = 1, 0, 1


def test_datamodule_streams_resumable_windows(corpus, tmp_path, tiny_tokenizer, monkeypatch):
    from datamodules.shards import ShardDataModule

    monkeypatch.setenv("PAPERLAB_CACHE", str(tmp_path / "cache"))
    kw = dict(files=str(corpus / "*"), seq_len=16, batch_size=4, val_fraction=0.2, test_fraction=0.2, seed=3,
              progress=False)
    dm = ShardDataModule(tiny_tokenizer, **kw)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.shard_dir.parent == tmp_path / "cache" / "shards"
    assert len(dm.val_dataloader()) > 0 and len(dm.train_set) > 8

    def batches(step, max_steps=12):
        dm.trainer = _FakeTrainer(step, max_steps)
        monkeypatch.setattr(ShardDataModule, "_rank_world", lambda self: (0, 1))
        return [b["input_ids"] for b in dm.train_dataloader()]

    full = batches(0)
    assert len(full) == 12 and all(b.shape == (4, 16) for b in full)
    resumed = batches(7)
    assert len(resumed) == 5 and all(torch.equal(a, b) for a, b in zip(full[7:], resumed))
    # the same seed gives the same order in a fresh module (paired runs stay paired); another seed does not
    dm2 = ShardDataModule(tiny_tokenizer, **kw)
    dm2.setup("fit")
    assert dm2.shard_dir == dm.shard_dir
    dm2.trainer = _FakeTrainer(0, 12)
    assert all(torch.equal(a["input_ids"], b) for a, b in zip(dm2.train_dataloader(), full))
    dm3 = ShardDataModule(tiny_tokenizer, **{**kw, "seed": 4})
    dm3.setup("fit")
    dm3.trainer = _FakeTrainer(0, 12)
    assert not all(torch.equal(a["input_ids"], b) for a, b in zip(dm3.train_dataloader(), full))
    # a built shard_dir is usable without the source files
    dm4 = ShardDataModule(tiny_tokenizer, shard_dir=str(dm.shard_dir), seq_len=16, progress=False)
    dm4.setup("fit")
    assert len(dm4.train_set) == len(dm.train_set)
    with pytest.raises(FileNotFoundError, match="data.files"):
        ShardDataModule(tiny_tokenizer, shard_dir=str(tmp_path / "empty"), progress=False).setup("fit")


def test_shards_experiment_config_composes(tmp_path):
    from omegaconf import OmegaConf

    from tests.helpers import compose

    cfg = compose("lm_tiny", ["data=shards", f"data.files={tmp_path}/*.jsonl"], output_dir=tmp_path)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    assert data["_target_"] == "datamodules.shards.ShardDataModule"
    assert data["files"] == f"{tmp_path}/*.jsonl" and data["shard_dir"] is None


@pytest.mark.slow
def test_lm_tiny_trains_on_shards_through_run_py(tmp_path):
    """The whole path: run.py's runner builds the shards in prepare_data and trains on them (a worker process
    reads the memmaps), and the loss falls."""
    import math

    from tests.helpers import run_experiment

    rng = np.random.default_rng(0)
    words = "def class return import value list dict string module function argument result".split()
    lines = [json.dumps({"text": " ".join(rng.choice(words, size=60))}) for _ in range(300)]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    value, metrics = run_experiment("lm_tiny", tmp_path / "run", overrides=(
        "debug=smoke", "data=shards", f"data.files={tmp_path}/corpus.jsonl", f"data.shard_dir={tmp_path}/shards",
        "data.seq_len=64", "data.val_fraction=0.1", "data.test_fraction=0.1", "data.num_workers=1", "data.progress=false",
        "++callbacks.export=null"))
    assert metrics["status"] == "ok" and metrics["global_step"] == 20
    assert S.read_index(tmp_path / "shards")["complete"]
    assert math.isfinite(value) and metrics["final"]["train/loss"] < math.log(2048) - 1.0
