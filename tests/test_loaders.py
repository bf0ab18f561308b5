"""Local-file loaders: text / jsonl / parquet through `datasets`, with one clear line for bad input."""
from __future__ import annotations

import json

import pytest

from datamodules.common.loaders import MalformedRecordError, load_local, local_documents


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_loads_in_order(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": f"doc {i}", "id": i} for i in range(5)])
    ds = load_local(str(f))
    assert ds["text"] == [f"doc {i}" for i in range(5)]
    assert ds["id"] == list(range(5))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": broken}\n{"text": "after"}\n')
    with pytest.raises(MalformedRecordError) as info:
        load_local(str(f))
    msg = str(info.value)
    assert f"{f}:4:" in msg  # the blank line 2 still counts as a line
    assert "\n" not in msg


def test_missing_field_names_file_line_and_key(tmp_path):
    f = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}, {"text": "y"}, {"body": "z"}])
    with pytest.raises(MalformedRecordError, match=rf"{f}:3: .*'text'.*data.text_field"):
        load_local(str(f))
    # asking for the other key fails at the first record that lacks it
    with pytest.raises(MalformedRecordError, match=rf"{f}:1: .*'body'"):
        load_local(str(f), field="body")


def test_non_object_record_is_malformed(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "x"}\n["text"]\n')
    with pytest.raises(MalformedRecordError, match=rf"{f}:2:"):
        load_local(str(f))


def test_missing_files_say_where_to_put_them(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"data.files"):
        load_local(str(tmp_path / "nothing" / "*.jsonl"))


def test_unknown_type_and_mixed_types(tmp_path):
    (tmp_path / "a.csv").write_text("text\nx\n")
    with pytest.raises(ValueError, match=r"unknown data file type '.csv'"):
        load_local(str(tmp_path / "a.csv"))
    (tmp_path / "b.txt").write_text("x\n")
    write_jsonl(tmp_path / "c.jsonl", [{"text": "y"}])
    with pytest.raises(ValueError, match=r"mixes file types"):
        load_local([str(tmp_path / "b.txt"), str(tmp_path / "c.jsonl")])


def test_text_files_and_globs(tmp_path):
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "b.txt").write_text("third line\n")
    ds = load_local(str(tmp_path / "*.txt"))
    assert ds["text"] == ["first line", "second line", "third line"]  # sorted by path, one row a line


def test_parquet(tmp_path):
    import pandas as pd

    pd.DataFrame({"content": ["alpha", "beta", ""], "n": [1, 2, 3]}).to_parquet(tmp_path / "p.parquet")
    ds = load_local(str(tmp_path / "p.parquet"), field="content")
    assert ds["content"] == ["alpha", "beta", ""]
    assert local_documents(str(tmp_path / "p.parquet"), field="content") == ["alpha", "beta"]  # empty dropped
    with pytest.raises(MalformedRecordError, match=r"no column 'text'.*data.text_field"):
        load_local(str(tmp_path / "p.parquet"))


def test_text_datamodule_on_local_files(tmp_path, tiny_tokenizer, monkeypatch):
    """source=files: documents from local jsonl, split by document, packed into seq_len blocks of the corpus."""
    import numpy as np

    from datamodules.text import TextDataModule

    monkeypatch.setenv("PAPERLAB_CACHE", str(tmp_path / "cache"))
    docs = [f"Document number {i} talks about topic {i % 7} with some words repeated {i}." for i in range(200)]
    write_jsonl(tmp_path / "corpus.jsonl", [{"text": d} for d in docs])
    dm = TextDataModule(tiny_tokenizer, source="files", files=str(tmp_path / "*.jsonl"), seq_len=32,
                        batch_size=4, val_fraction=0.1, seed=0)
    dm.setup("fit")
    tokens = dm.split_tokens()
    train, val, test = tokens["train"], tokens["val"], tokens["test"]
    eos = tiny_tokenizer.eos_token_id
    all_tokens = np.concatenate([train, val, test])
    assert int((all_tokens == eos).sum()) == len(docs)  # every document once, each closed by EOS
    assert len(train) > len(val) > 0 and len(train) > len(test) > 0
    assert len(dm.train_set) == len(train) // 32
    # the packed blocks are the token stream, in order, decoded back to the documents' text
    block = dm.train_set[1]["input_ids"]
    assert block.tolist() == train[32:64].tolist()
    text = tiny_tokenizer.decode(all_tokens.tolist())
    assert sorted(t for t in text.split(tiny_tokenizer.eos_token) if t) == sorted(docs)
    # cached: a second module reads the same arrays from disk
    assert any((tmp_path / "cache" / "tokens").glob("*.npz"))
    dm2 = TextDataModule(tiny_tokenizer, source="files", files=str(tmp_path / "*.jsonl"), seq_len=32, val_fraction=0.1)
    t2 = dm2.split_tokens()
    assert all(np.array_equal(t2[s], tokens[s]) for s in tokens)


def test_text_datamodule_bad_record_fails_at_setup(tmp_path, tiny_tokenizer, monkeypatch):
    from datamodules.text import TextDataModule

    monkeypatch.setenv("PAPERLAB_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "corpus.jsonl"
    f.write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    dm = TextDataModule(tiny_tokenizer, source="files", files=str(f), seq_len=8)
    with pytest.raises(MalformedRecordError, match=rf"{f}:2:"):
        dm.setup("fit")
    with pytest.raises(ValueError, match=r"data.source='hub'"):
        TextDataModule(tiny_tokenizer, source="hub").documents()


def test_gzipped_jsonl_is_checked_and_loaded(tmp_path):
    import gzip

    f = tmp_path / "a.jsonl.gz"
    with gzip.open(f, "wt") as fh:
        fh.write('{"text": "one"}\n{"text": "two"}\n')
    assert load_local(str(f))["text"] == ["one", "two"]
    bad = tmp_path / "b.jsonl.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write('{"text": "one"}\n{"text": \n')
    with pytest.raises(MalformedRecordError, match=rf"{bad}:2:"):
        load_local(str(bad))
