"""Long-document language modelling at a target context (LongLoRA / HiCI style).

Documents (the embedded corpus, or PG-19 / proof-pile / RedPajama samples from local files via the core's loaders)
are joined with EOS and cut into ``seq_len`` blocks — the target context, e.g. 4× the backbone's native one.

``passkey_fraction`` > 0 replaces that fraction of training blocks (chosen by a seeded hash of the index) with
passkey-retrieval prompts of the same length followed by their answer (``datamodules.synthetic.passkey_sample``):
the planted-key task a tiny model must be taught before it can be scored on it. Paper-scale configs keep 0.

``eval_tokens()`` is the stream the long-context evaluator scores (sliding perplexity): with ``test_files`` (PG-19
test, Proof-pile test: never the training files) the first ``test_documents`` documents of those files in order, each
of at least ``test_min_tokens`` tokens and cut to ``test_max_tokens`` (Proof-pile as in PI/LongLoRA: 128 documents of
>= 32,768 tokens, cut to 32,768), joined with EOS; without, the test split of the training documents (tiny runs),
which neither training nor checkpoint selection sees.

``LongContextShardDataModule`` is the same over memory-mapped token shards (``data=long_shards``): pretraining-scale
samples (the ~1B-token RedPajama sample) stream from disk instead of one in-memory token list per rank.
``LongAlpacaDataModule`` is the SFT stage's data (LongAlpaca-12k: instruction -> output, loss on the output only).
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from datamodules.common.cache import cache_root, stable_hash
from datamodules.common.miniature import concrete, documents, register_layout, write_jsonl
from datamodules.shards import ShardDataModule
from datamodules.text import PackedTokens, TextDataModule, tokenizer_fingerprint


class PasskeyMix(Dataset):
    """Packed LM blocks with a seeded fraction replaced by passkey prompt + answer blocks of the same length."""

    def __init__(self, base: PackedTokens, tokenizer, fraction: float, seed: int = 0):
        self.base, self.tokenizer, self.fraction, self.seed = base, tokenizer, fraction, seed

    def __len__(self):
        return len(self.base)

    def is_passkey(self, i: int) -> bool:
        h = int(hashlib.sha1(f"{self.seed}:{i}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return h < self.fraction

    def passkey_block(self, i: int) -> dict:
        from datamodules.synthetic import passkey_sample

        n = self.base.seq_len
        s = passkey_sample(self.tokenizer, n - 8, seed=self.seed * 1_000_003 + i)
        ids = self.tokenizer(s["prompt"] + " " + s["answer"] + ".", add_special_tokens=False)["input_ids"][:n]
        eos = self.tokenizer.eos_token_id
        x = torch.full((n,), eos, dtype=torch.long)
        x[: len(ids)] = torch.tensor(ids)
        return {"input_ids": x, "labels": x.clone()}

    def __getitem__(self, i):
        return self.passkey_block(i) if self.is_passkey(i) else self.base[i]


def eval_stream(files, tokenizer, text_field: str = "text", documents: int | None = None, min_tokens: int = 0,
                max_tokens: int | None = None) -> np.ndarray:
    """The evaluation stream: the first ``documents`` documents of ``files`` (sorted paths, rows in order) with at
    least ``min_tokens`` tokens, each cut to ``max_tokens``, joined with EOS. Cached by files, tokenizer and counts."""
    from datamodules.common.shards import _expand, iter_documents

    paths = _expand(files)
    key = stable_hash([(str(p), p.stat().st_size, p.stat().st_mtime) for p in paths], tokenizer_fingerprint(tokenizer),
                      text_field, documents, min_tokens, max_tokens)
    cached = cache_root() / "tokens" / f"test-{key}.npy"
    if cached.exists():
        return np.load(cached)
    out, taken = [], 0
    for path in paths:
        for text in iter_documents(path, text_field):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) < min_tokens:
                continue
            out.append(np.asarray(ids[:max_tokens] + [tokenizer.eos_token_id], dtype=np.int64))
            taken += 1
            if taken == documents:
                break
        if taken == documents:
            break
    if documents and taken < documents:
        raise ValueError(f"data.test_files={files} hold {taken} documents of >= {min_tokens} tokens, fewer than "
                         f"data.test_documents={documents}: point test_files at the full test split or lower the count")
    if not out:
        raise ValueError(f"data.test_files={files} hold no document of >= {min_tokens} tokens")
    stream = np.concatenate(out)
    cached.parent.mkdir(parents=True, exist_ok=True)
    np.save(cached, stream)
    return stream


class EvalStream:
    """``eval_tokens()`` from ``test_files`` (see ``eval_stream``), else from the subclass's held-out split."""

    def _init_test(self, test_files, test_documents, test_min_tokens, test_max_tokens):
        if test_documents is not None and test_documents < 1:
            raise ValueError(f"data.test_documents={test_documents} must be >= 1 (or null: every document)")
        if test_max_tokens is not None and test_max_tokens < max(test_min_tokens, 2):
            raise ValueError(f"data.test_max_tokens={test_max_tokens} must be >= data.test_min_tokens={test_min_tokens} and >= 2")
        self.test_files, self.test_documents = test_files, test_documents
        self.test_min_tokens, self.test_max_tokens = test_min_tokens, test_max_tokens
        self._test_tokens = None

    def heldout_tokens(self) -> np.ndarray:
        raise NotImplementedError

    def eval_tokens(self) -> torch.Tensor:
        if self._test_tokens is None:
            self._test_tokens = (eval_stream(self.test_files, self.tokenizer, self.text_field, self.test_documents,
                                             self.test_min_tokens, self.test_max_tokens)
                                 if self.test_files else self.heldout_tokens())
        return torch.from_numpy(np.asarray(self._test_tokens, dtype=np.int64))


class LongContextDataModule(EvalStream, TextDataModule):
    """``TextDataModule`` at a long target context, with optional passkey mixing and the evaluation stream."""

    def __init__(self, tokenizer, passkey_fraction: float = 0.0, seq_len: int = 1024, test_files=None,
                 test_documents: int | None = None, test_min_tokens: int = 0, test_max_tokens: int | None = None, **kw):
        super().__init__(tokenizer, seq_len=seq_len, **kw)
        if not 0.0 <= passkey_fraction < 1.0:
            raise ValueError(f"data.passkey_fraction={passkey_fraction} must be in [0, 1)")
        self.passkey_fraction = passkey_fraction
        self._init_test(test_files, test_documents, test_min_tokens, test_max_tokens)

    def setup(self, stage: str | None = None):
        if self.train_set is not None:
            return
        super().setup(stage)
        if self.passkey_fraction > 0:
            self.train_set = PasskeyMix(self.train_set, self.tokenizer, self.passkey_fraction, self.seed)

    def heldout_tokens(self) -> np.ndarray:
        """The test split of the training documents as one token stream (documents joined with EOS): held out of
        training and of checkpoint selection."""
        self.setup()
        return self.test_set.tokens


class LongContextShardDataModule(EvalStream, ShardDataModule):
    """``ShardDataModule`` (memory-mapped pretokenized shards) with the long-context evaluation stream."""

    def __init__(self, tokenizer, test_files=None, test_documents: int | None = None, test_min_tokens: int = 0,
                 test_max_tokens: int | None = None, **kw):
        super().__init__(tokenizer, **kw)
        self._init_test(test_files, test_documents, test_min_tokens, test_max_tokens)

    def heldout_tokens(self) -> np.ndarray:
        """The test shards joined (they are small: ``test_fraction`` of the documents)."""
        self.setup()
        return np.concatenate([np.asarray(self.test_set.shard(k)) for k in range(len(self.test_set.files))])


class InstructionPairs(Dataset):
    """Instruction -> output records as prompt + answer token ids; the loss is on the answer (and its EOS) only."""

    def __init__(self, records: list[dict], tokenizer, template: str, seq_len: int):
        self.records, self.tokenizer, self.template, self.seq_len = records, tokenizer, template, seq_len

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        # the tokenizer's own special tokens on the prompt (Llama-2: BOS), as the release's SFT script tokenizes it
        prompt = self.tokenizer(self.template.format_map(r))["input_ids"]
        answer = self.tokenizer(r["output"], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        ids = torch.tensor((prompt + answer)[: self.seq_len])
        labels = ids.clone()
        labels[: len(prompt)] = -100
        return {"input_ids": ids, "labels": labels}


def pad_collate(items: list[dict], pad_id: int, multiple: int) -> dict:
    """Right-pad a batch to its longest row rounded up to ``multiple`` (HiCI/S² cut sequences into equal segments)."""
    width = -(-max(len(x["input_ids"]) for x in items) // multiple) * multiple
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for j, x in enumerate(items):
        n = len(x["input_ids"])
        ids[j, :n], labels[j, :n], mask[j, :n] = x["input_ids"], x["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


class LongAlpacaDataModule(TextDataModule):
    """The SFT stage: LongAlpaca-12k (a JSON list or .jsonl of {instruction, output}) formatted with ``template``
    (``{instruction}`` and any other record field), truncated to ``seq_len``, padded per batch to ``pad_multiple``.
    Records are split train/val/test by a hash of their instruction; loaders and the resumable order as ``TextDataModule``."""

    def __init__(self, tokenizer, files, template: str = "[INST]{instruction}[/INST]", seq_len: int = 16384,
                 pad_multiple: int = 64, **kw):
        kw.setdefault("val_fraction", 0.01)
        kw.setdefault("test_fraction", 0.01)
        if "{instruction}" not in template:  # checked first: a wrong template is wrong whatever the files
            raise ValueError(f"data.template={template!r} must contain {{instruction}}")
        super().__init__(tokenizer, source="files", files=files, seq_len=seq_len, **kw)
        self.template, self.pad_multiple = template, pad_multiple

    def records(self) -> list[dict]:
        from datamodules.common.loaders import iter_jsonl
        from datamodules.common.shards import _expand

        out = []
        for path in _expand(self.files):
            if path.suffix == ".json":
                rows = json.loads(path.read_text(encoding="utf-8"))
            else:
                rows = list(iter_jsonl(path))
            for k, r in enumerate(rows):
                if not isinstance(r, dict) or not isinstance(r.get("instruction"), str) or not isinstance(r.get("output"), str):
                    raise ValueError(f"{path} record {k}: SFT records need string fields 'instruction' and 'output'")
                out.append(r)
        return out

    def setup(self, stage: str | None = None):
        if self.train_set is not None:
            return
        from datamodules.common.splits import split_items

        recs = self.records()
        parts = split_items(recs, self.val_fraction, self.test_fraction, key=lambda r: r["instruction"])
        if not all(parts.values()):
            raise ValueError(f"data.val_fraction={self.val_fraction} / data.test_fraction={self.test_fraction} leave "
                             f"an empty train, val or test split of {len(recs)} records: change them")
        self.train_set, self.val_set, self.test_set = (
            InstructionPairs(parts[k], self.tokenizer, self.template, self.seq_len) for k in ("train", "val", "test"))

    def _collate(self, loader):
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        loader.collate_fn = functools.partial(pad_collate, pad_id=pad, multiple=self.pad_multiple)
        return loader

    def train_dataloader(self):
        return self._collate(super().train_dataloader())

    def _eval_loader(self, dataset):
        return self._collate(super()._eval_loader(dataset))


# --- debug=dryrun miniatures (datamodules/common/miniature.py) ----------------------------------------------------------
@register_layout("longalpaca/*.json")
def write_long_alpaca(target: Path, cfg) -> None:
    """LongAlpaca-12k: one JSON list of {instruction, output}; a document with a question, a short answer. Half the
    documents are longer than a dry run's sequences (their answers are cut off, as over-long records are)."""
    docs = documents(n=15, min_chars=3000, seed=11) + [d[:500] for d in documents(n=15, min_chars=500, seed=13)]
    records = [{"instruction": f"{doc}\n\nWhat is the text above about? Answer in one sentence.",
                "output": doc.split(".")[0].strip()[:200] + "."} for doc in docs]
    concrete(target, "LongAlpaca-12k").write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")


@register_layout("longbench/data")
@register_layout("longbench/config")
def write_longbench(target: Path, cfg) -> None:
    """LongBench v1 as released: ``data/<task>.jsonl`` ({input, context, answers, all_classes, length, dataset,
    language, _id}) and ``config/dataset2{prompt,maxlen}.json``; both written together (one writer per root)."""
    from lightning_modules.hici.longbench import METRICS

    root = target.parent
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "config").mkdir(parents=True, exist_ok=True)
    docs = documents(n=8, min_chars=3000, seed=12)
    prompts, budgets = {}, {}
    for task, metric in METRICS.items():
        classes = ["Description", "Entity", "Location"] if metric == "classification" else None
        rows = []
        for i, doc in enumerate(docs[:4]):
            first = doc.split(".")[0].strip()
            answer = {"retrieval": f"Paragraph {i + 1}", "count": str(i + 1), "code_sim": "return x"}.get(metric, first)
            if classes:
                answer = classes[i % 3]
            rows.append({"input": "What does the text begin with?", "context": doc, "answers": [answer],
                         "all_classes": classes, "length": len(doc.split()), "dataset": task, "language": "en",
                         "_id": f"{task}-{i}"})
        write_jsonl(root / "data" / f"{task}.jsonl", rows)
        prompts[task] = "Read the text and answer the question.\n\n{context}\n\nQuestion: {input}\nAnswer:"
        budgets[task] = 16
    (root / "config" / "dataset2prompt.json").write_text(json.dumps(prompts, indent=1), encoding="utf-8")
    (root / "config" / "dataset2maxlen.json").write_text(json.dumps(budgets, indent=1), encoding="utf-8")


@register_layout("longeval/topics/*_topics.jsonl")
def write_topics(target: Path, cfg) -> None:
    """LongEval's topic test cases, ``<n>_topics.jsonl`` for n = 2 and 3: {prompt, topics}, a conversation over n
    topics that ends in the question for the first."""
    docs = documents(n=6, min_chars=400, seed=14)
    names = ["the river trip", "the old library", "a chess match", "the harvest", "a night train", "the lighthouse"]
    for n in (2, 3):
        rows = []
        for i in range(4):
            topics = [names[(i + k) % len(names)] for k in range(n)]
            turns = "".join(f"USER: Let us talk about {t}. {docs[(i + k) % len(docs)][:300]}\nASSISTANT: Sure.\n"
                            for k, t in enumerate(topics))
            rows.append({"prompt": turns + "USER: What was the first topic we discussed?\nASSISTANT:", "topics": topics})
        write_jsonl(concrete(target, str(n)), rows)
