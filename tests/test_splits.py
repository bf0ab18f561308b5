"""Three disjoint splits in every datamodule: no document or problem is in two of train / val / test (checked by a
hash of its content), test loaders serve the test split, and the RL warm-up draws from the train part only."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from datamodules.common.splits import SPLITS


def doc_hashes(tokens: np.ndarray, eos: int) -> list[str]:
    """A content hash per document of a token stream (documents end with EOS)."""
    cuts = np.flatnonzero(np.asarray(tokens) == eos) + 1
    return [hashlib.sha1(np.asarray(d, dtype=np.int64).tobytes()).hexdigest() for d in np.split(tokens, cuts) if len(d)]


def assert_disjoint(hashes: dict[str, list[str]]) -> None:
    for s in SPLITS:
        assert hashes[s], f"the {s} split is empty"
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1:]:
            assert not set(hashes[a]) & set(hashes[b]), f"{a} and {b} share content"


def write_docs(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


DOCS = [f"Document {i} is about topic {i % 7}, with {i * 3} words and a tail {i % 11}." for i in range(300)]


def test_text_embedded_corpus_splits_are_disjoint_and_test_is_served(tiny_tokenizer):
    from datamodules.text import TextDataModule

    dm = TextDataModule(tiny_tokenizer, seq_len=256)
    dm.setup()
    tokens = dm.split_tokens()
    assert_disjoint({s: doc_hashes(tokens[s], tiny_tokenizer.eos_token_id) for s in SPLITS})
    assert dm.test_dataloader().dataset.dataset is dm.test_set and dm.val_dataloader().dataset.dataset is dm.val_set
    assert not np.array_equal(dm.test_set[0]["input_ids"], dm.val_set[0]["input_ids"])


def test_text_files_with_own_val_and_test_files(tmp_path, tiny_tokenizer, monkeypatch):
    from datamodules.text import TextDataModule

    monkeypatch.setenv("PAPERLAB_CACHE", str(tmp_path / "cache"))
    write_docs(tmp_path / "train.jsonl", DOCS[:200])
    write_docs(tmp_path / "test.jsonl", DOCS[200:])
    dm = TextDataModule(tiny_tokenizer, source="files", files=str(tmp_path / "train.jsonl"),
                        test_files=str(tmp_path / "test.jsonl"), seq_len=16, val_fraction=0.1)
    docs = dm.split_documents()
    assert docs["test"] == DOCS[200:]  # the test file, only
    assert sorted(docs["train"] + docs["val"]) == sorted(DOCS[:200]) and 0 < len(docs["val"]) < 50
    tokens = dm.split_tokens()
    assert_disjoint({s: doc_hashes(tokens[s], tiny_tokenizer.eos_token_id) for s in SPLITS})


def test_long_context_evaluates_the_test_split(tmp_path, tiny_tokenizer, monkeypatch):
    from lightning_modules.hici.data import LongContextDataModule

    monkeypatch.setenv("PAPERLAB_CACHE", str(tmp_path / "cache"))
    write_docs(tmp_path / "docs.jsonl", DOCS)
    dm = LongContextDataModule(tiny_tokenizer, source="files", files=str(tmp_path / "docs.jsonl"), seq_len=32,
                               val_fraction=0.2, test_fraction=0.2, passkey_fraction=0.1)
    dm.setup()
    tokens = dm.split_tokens()
    assert_disjoint({s: doc_hashes(tokens[s], tiny_tokenizer.eos_token_id) for s in SPLITS})
    assert dm.eval_tokens().tolist() == tokens["test"].tolist()


def test_shard_splits_are_disjoint(tmp_path, tiny_tokenizer, monkeypatch):
    from datamodules.common.shards import read_index
    from datamodules.shards import ShardDataModule

    monkeypatch.setenv("PAPERLAB_CACHE", str(tmp_path / "cache"))
    write_docs(tmp_path / "a.jsonl", DOCS[:150])
    write_docs(tmp_path / "b.jsonl", DOCS[150:])
    dm = ShardDataModule(tiny_tokenizer, files=str(tmp_path / "*.jsonl"), seq_len=16, val_fraction=0.2,
                         test_fraction=0.2, progress=False)
    dm.setup()
    index = read_index(dm.shard_dir)
    hashes = {s: [h for src in index["sources"].values() for h in doc_hashes(
        np.fromfile(dm.shard_dir / src[s]["file"], dtype=np.uint16), tiny_tokenizer.eos_token_id)] for s in SPLITS}
    assert_disjoint(hashes)
    assert sum(map(len, hashes.values())) == len(DOCS)
    assert dm.test_set.split == "test" and len(dm.test_set) > 0


def test_generated_problems_split_by_their_computation_and_warmup_sees_train_only(tiny_tokenizer):
    from datamodules.verifiable import VerifiableDataModule
    from lightning_modules.common.rl.warmup import warmup_problems

    for task in ("arithmetic", "word_problems"):
        dm = VerifiableDataModule(tiny_tokenizer, task=task, digits=1, n_train=2000, n_val=64, n_test=64)
        problems = dm.all_problems()
        keys = {s: [p["key"] for p in problems[s]] for s in SPLITS}
        assert_disjoint(keys)
        assert len(set(keys["val"])) == len(keys["val"]) and len(set(keys["test"])) == len(keys["test"])
        dm.setup()
        assert [it["answer"] for it in dm.test_dataloader().dataset] == [p["answer"] for p in problems["test"]]
    # the 1-digit space is small (155 sums and differences): the warm-up draws 6,400 problems, never a held-out one
    warm = warmup_problems({"steps": 200, "batch_size": 32, "task": "arithmetic", "digits": 1, "seed": 0,
                            "val_fraction": 0.2, "test_fraction": 0.2})
    dm = VerifiableDataModule(tiny_tokenizer, task="arithmetic", digits=1)
    held = {p["key"] for s in ("val", "test") for p in dm.all_problems()[s]}
    assert len(warm) == 6400 and held and not held & {p["key"] for p in warm}
    with pytest.raises(ValueError, match="val_fraction and test_fraction"):
        warmup_problems({"steps": 1, "task": "arithmetic"})


def test_gsm8k_files_test_file_only_tested_and_val_never_trained(tmp_path, tiny_tokenizer):
    from datamodules.verifiable import VerifiableDataModule

    def write(path, qs):
        path.write_text("".join(json.dumps({"question": q, "answer": f"so\n#### {i}"}) + "\n" for i, q in enumerate(qs)))

    train_qs, test_qs = [f"train question {i}?" for i in range(60)], [f"test question {i}?" for i in range(12)]
    write(tmp_path / "train.jsonl", train_qs)
    write(tmp_path / "test.jsonl", test_qs)
    dm = VerifiableDataModule(tiny_tokenizer, task="gsm8k", files=str(tmp_path / "train.jsonl"),
                              test_files=str(tmp_path / "test.jsonl"), val_fraction=0.2, n_test=None)
    p = dm.all_problems()
    q = {s: [x["question"] for x in p[s]] for s in SPLITS}
    assert q["test"] == test_qs
    assert sorted(q["train"] + q["val"]) == sorted(train_qs)  # validation is held out of the train file
    assert_disjoint(q)
    # without test_files, test is hashed out of the train file too: still three disjoint parts of it
    p2 = VerifiableDataModule(tiny_tokenizer, task="gsm8k", files=str(tmp_path / "train.jsonl"), n_val=None,
                              n_test=None).all_problems()
    q2 = {s: [x["question"] for x in p2[s]] for s in SPLITS}
    assert_disjoint(q2)
    assert sorted(q2["train"] + q2["val"] + q2["test"]) == sorted(train_qs)
