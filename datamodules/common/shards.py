"""Pretokenize-and-pack for corpora too large to hold in memory (FineWeb, C4, RedPajama, PG-19 from local files).

``build_shards(files, tokenizer, out_dir)`` reads each source file once, tokenizes its documents (each followed
by EOS) and writes the tokens as flat memory-mappable arrays, one shard per split and source file::

    out_dir/index.json          {"version", "dtype", "vocab_size", "eos_id", "tokenizer", "val_fraction",
                                 "test_fraction", ..., "sources": {<source>: {"train": {"file", "tokens", "docs"},
                                 "val": {...}, "test": {...}}}, "complete": true}
    out_dir/train-00000.bin     uint16 tokens when the vocabulary fits in 16 bits, else uint32
    out_dir/val-00000.bin
    out_dir/test-00000.bin

Documents are assigned to train / val / test by a hash of (source file name, row) (``datamodules.common.splits``),
so the split does not depend on the order files are processed or on how many there are. Resumable and atomic: a source's shards are written to ``.tmp``
files and renamed once complete, then the index is rewritten (tmp + rename) naming that source done; an
interrupted build restarts at the first source the index does not list. Source files are streamed, never
loaded whole: ``.jsonl`` (optionally ``.gz``) line by line (a malformed line names file:line), ``.parquet``
by row groups, and ``.txt`` one document per file (the PG-19 layout: a book a file).

``TokenShards(out_dir, split)`` opens them read-only with ``np.memmap`` and serves fixed-length windows that never
straddle two shards. Build once on a CPU node (``python -m datamodules.common.shards --files '<glob>'
--tokenizer <dir> --out <dir>``), then point ``data=shards data.shard_dir=<dir>`` at the result.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import numpy as np

from datamodules.common.loaders import MalformedRecordError, expand_files, iter_jsonl
from datamodules.common.splits import SPLITS, check_fractions, split_of

INDEX = "index.json"
VERSION = 2  # 2: three splits (train / val / test)


_expand = expand_files  # the corpus files: sorted, deduplicated; none is one line naming data.files


def iter_documents(path: Path, field: str = "text", batch_rows: int = 1024) -> Iterator[str]:
    """The documents of one source file, streamed; empty documents are skipped."""
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        for rec in iter_jsonl(path, field):
            text = rec[field]
            if isinstance(text, str) and text.strip():
                yield text
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise MalformedRecordError(f"{path}: no column {field!r} (have {pf.schema_arrow.names}); set data.text_field")
        for batch in pf.iter_batches(batch_size=batch_rows, columns=[field]):
            for text in batch.column(0).to_pylist():
                if isinstance(text, str) and text.strip():
                    yield text
    elif name.endswith((".txt", ".text", ".md")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text
    else:
        raise ValueError(f"{path}: unknown data file type; use .jsonl(.gz), .parquet or .txt (one document a file)")


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def document_split(source: str, row: int, val_fraction: float, test_fraction: float) -> str:
    """A document's split: a hash of (source file name, row), so it is stable across runs and orderings."""
    return split_of(f"{source}:{row}", val_fraction, test_fraction)


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_index(out_dir) -> dict | None:
    path = Path(out_dir) / INDEX
    return json.loads(path.read_text()) if path.exists() else None


def _fingerprint(tokenizer) -> str:
    from datamodules.text import tokenizer_fingerprint

    return tokenizer_fingerprint(tokenizer)


def build_shards(files, tokenizer, out_dir, text_field: str = "text", val_fraction: float = 0.0005,
                 test_fraction: float = 0.0005, batch_docs: int = 512, progress: bool = True) -> dict:
    """Tokenize ``files`` into ``out_dir`` once (see the module docstring); returns the index.

    Calling it again is cheap: finished sources are skipped, and a complete build is returned as is. A
    directory built with another tokenizer, field or split fraction is refused rather than mixed.
    """
    from tqdm.auto import tqdm

    check_fractions(val_fraction, test_fraction)
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths = _expand(files)
    vocab = len(tokenizer)
    dtype = token_dtype(vocab)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: documents are joined with EOS; set one on the tokenizer")
    header = {"version": VERSION, "dtype": np.dtype(dtype).name, "vocab_size": vocab, "eos_id": int(eos),
              "tokenizer": _fingerprint(tokenizer), "text_field": text_field, "val_fraction": val_fraction,
              "test_fraction": test_fraction}
    index = read_index(out)
    if index is not None:
        clash = {k: (index.get(k), v) for k, v in header.items() if index.get(k) != v}
        if clash:
            raise ValueError(f"{out} holds shards built with other settings {clash}: use another data.shard_dir "
                             "or delete that directory")
    else:
        index = {**header, "sources": {}, "complete": False}
    todo = [p for p in paths if str(p) not in index["sources"]]
    if not todo and index.get("complete"):
        return index
    index["complete"] = False
    bar = tqdm(total=len(paths), initial=len(paths) - len(todo), unit="file", desc=f"pretokenizing into {out}",
               disable=not progress)
    for path in todo:
        number = len(index["sources"])
        entry = {}
        handles, counts = {}, {s: [0, 0] for s in SPLITS}  # split -> [tokens, docs]
        for split in SPLITS:
            handles[split] = (out / f"{split}-{number:05d}.bin.tmp").open("wb")
        try:
            batch, splits = [], []

            def flush():
                for ids, split in zip(tokenizer(batch, add_special_tokens=False)["input_ids"], splits):
                    arr = np.asarray(ids + [eos], dtype=dtype)
                    arr.tofile(handles[split])
                    counts[split][0] += len(arr)
                    counts[split][1] += 1
                batch.clear()
                splits.clear()

            for row, text in enumerate(iter_documents(path, text_field)):
                batch.append(text)
                splits.append(document_split(path.name, row, val_fraction, test_fraction))
                if len(batch) >= batch_docs:
                    flush()
            if batch:
                flush()
        finally:
            for fh in handles.values():
                fh.close()
        for split in SPLITS:
            final = out / f"{split}-{number:05d}.bin"
            os.replace(out / f"{split}-{number:05d}.bin.tmp", final)
            entry[split] = {"file": final.name, "tokens": counts[split][0], "docs": counts[split][1]}
        index["sources"][str(path)] = entry
        _write_json_atomic(out / INDEX, index)
        bar.update(1)
    bar.close()
    index["complete"] = True
    _write_json_atomic(out / INDEX, index)
    return index


class TokenShards:
    """Fixed-length windows (``seq_len`` tokens, labels = inputs) over the memory-mapped shards of one split.

    Windows are cut within each shard, so none straddles two sources; a shard's last partial window is dropped.
    The memmaps are opened lazily in each process (DataLoader workers reopen them instead of pickling arrays).
    """

    def __init__(self, out_dir, split: str, seq_len: int):
        index = read_index(out_dir)
        if index is None or not index.get("complete"):
            raise FileNotFoundError(f"{out_dir} has no complete shard index: build it first (datamodules.common.shards.build_shards)")
        self.dir, self.split, self.seq_len = Path(out_dir), split, seq_len
        self.dtype = np.dtype(index["dtype"])
        self.vocab_size = index["vocab_size"]
        entries = [src[split] for _, src in sorted(index["sources"].items(), key=lambda kv: kv[1]["train"]["file"])]
        self.files = [e["file"] for e in entries if e["tokens"] >= seq_len]
        windows = [e["tokens"] // seq_len for e in entries if e["tokens"] >= seq_len]
        self.tokens = sum(e["tokens"] for e in entries)
        self.starts = np.concatenate([[0], np.cumsum(windows)]).astype(np.int64)
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard(self, k: int) -> np.ndarray:
        if k not in self._maps:
            self._maps[k] = np.memmap(self.dir / self.files[k], dtype=self.dtype, mode="r")
        return self._maps[k]

    def __getstate__(self):
        return {**self.__dict__, "_maps": {}}

    def __getitem__(self, i: int):
        import torch

        if not 0 <= i < len(self):
            raise IndexError(i)
        k = int(np.searchsorted(self.starts, i, side="right") - 1)
        off = (i - int(self.starts[k])) * self.seq_len
        x = torch.from_numpy(self.shard(k)[off:off + self.seq_len].astype(np.int64))
        return {"input_ids": x, "labels": x.clone()}


def main(argv=None) -> None:
    import argparse

    from datamodules.common.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description="Pretokenize a local corpus into memory-mapped token shards.")
    ap.add_argument("--files", required=True, nargs="+", help="paths or globs of .jsonl(.gz) / .parquet / .txt")
    ap.add_argument("--tokenizer", required=True, help="a dir with a tokenizer (or a hub id where reachable)")
    ap.add_argument("--out", required=True, help="output dir (data.shard_dir)")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--val-fraction", type=float, default=0.0005)
    ap.add_argument("--test-fraction", type=float, default=0.0005)
    args = ap.parse_args(argv)
    index = build_shards(args.files, load_tokenizer(pretrained=args.tokenizer), args.out, args.text_field,
                         args.val_fraction, args.test_fraction)
    total = {s: sum(v[s]["tokens"] for v in index["sources"].values()) for s in SPLITS}
    print(f"{args.out}: {len(index['sources'])} sources, "
          + " / ".join(f"{total[s]:,} {s}" for s in SPLITS) + " tokens")


if __name__ == "__main__":
    main()
