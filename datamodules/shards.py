"""Language-modelling data from memory-mapped token shards: large local corpora (FineWeb, C4, RedPajama, PG-19).

``prepare_data`` (rank 0 of each node) pretokenizes ``files`` once into ``shard_dir`` with
``datamodules.common.shards.build_shards`` (resumable; skipped when complete), ``setup`` opens the shards, and
training streams fixed-length ``seq_len`` windows in the order of ``StepStreamSampler``, the same step-keyed
sampler ``TextDataModule`` uses: a resumed or paired run sees exactly the batches it would have seen.

``shard_dir: null`` puts the shards in the user cache keyed by the source files (names, sizes, mtimes), the
tokenizer and the split, so a changed corpus or tokenizer never reads stale shards. Set ``shard_dir`` to a
directory built beforehand (``python -m datamodules.common.shards``) on shared storage for multi-node jobs.
"""
from __future__ import annotations

from pathlib import Path

from datamodules.common.cache import cache_root, stable_hash
from datamodules.common.shards import TokenShards, _expand, build_shards, read_index
from datamodules.text import TextDataModule, tokenizer_fingerprint


class ShardDataModule(TextDataModule):
    """Packed windows over pretokenized shards; loaders (train sampler, rank-sharded eval) as in ``TextDataModule``.

    Args:
        tokenizer: the run's tokenizer (the pretrained model's own at paper scale).
        files: path or glob(s) of .jsonl(.gz) / .parquet / .txt (a document a file); may be null when
            ``shard_dir`` already holds a complete build.
        shard_dir: where the shards are (or go); null = the user cache, keyed as above.
        val_fraction, test_fraction: shares of documents held out for validation and for test (by a hash of
            file name and row; ``datamodules.common.splits``).
    """

    def __init__(self, tokenizer, files=None, shard_dir: str | None = None, text_field: str = "text",
                 seq_len: int = 2048, batch_size: int = 8, eval_batch_size: int | None = None,
                 val_fraction: float = 0.0005, test_fraction: float = 0.0005, max_val_sequences: int | None = 256,
                 num_workers: int = 0, seed: int = 0, progress: bool = True):
        super().__init__(tokenizer, source="files", files=files, text_field=text_field, seq_len=seq_len,
                         batch_size=batch_size, eval_batch_size=eval_batch_size, val_fraction=val_fraction,
                         test_fraction=test_fraction, max_val_sequences=max_val_sequences, num_workers=num_workers, seed=seed)
        self.shard_dir_arg, self.progress = shard_dir, progress

    @property
    def shard_dir(self) -> Path:
        if self.shard_dir_arg:
            return Path(self.shard_dir_arg).expanduser()
        if not self.files:
            raise ValueError("data=shards needs data.files=<path or glob of your corpus> or data.shard_dir=<built shards>")
        stats = [(str(p), p.stat().st_size, p.stat().st_mtime) for p in _expand(self.files)]
        key = stable_hash(stats, tokenizer_fingerprint(self.tokenizer), self.text_field, self.val_fraction,
                         self.test_fraction)
        return cache_root() / "shards" / key

    def prepare_data(self):
        index = read_index(self.shard_dir)
        if self.files is None:
            if index is None or not index.get("complete"):
                raise FileNotFoundError(f"data.shard_dir={self.shard_dir} holds no complete shards and data.files is "
                                        "not set: set data.files=<your corpus> to build them")
            return
        build_shards(self.files, self.tokenizer, self.shard_dir, self.text_field, self.val_fraction,
                     self.test_fraction, progress=self.progress)

    def setup(self, stage: str | None = None):
        if self.train_set is not None:
            return
        if read_index(self.shard_dir) is None or not read_index(self.shard_dir).get("complete"):
            self.prepare_data()  # used without a Trainer (tests, notebooks)
        self.train_set = TokenShards(self.shard_dir, "train", self.seq_len)
        self.val_set = TokenShards(self.shard_dir, "val", self.seq_len)
        self.test_set = TokenShards(self.shard_dir, "test", self.seq_len)
        if self.train_set.vocab_size != len(self.tokenizer):
            raise ValueError(f"{self.shard_dir} was built with a vocabulary of {self.train_set.vocab_size}, the run's "
                             f"tokenizer has {len(self.tokenizer)}: rebuild the shards or point data.shard_dir elsewhere")
        if len(self.train_set) == 0:
            raise ValueError(f"the shards in {self.shard_dir} hold no full window of data.seq_len={self.seq_len} tokens")
        for split in ("val", "test"):
            if len(getattr(self, f"{split}_set")) == 0:
                raise ValueError(f"the {split} shards hold fewer than data.seq_len={self.seq_len} tokens per source; "
                                 f"raise data.{split}_fraction or lower data.seq_len")
