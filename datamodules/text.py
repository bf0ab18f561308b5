"""Language-modelling data: documents → tokens → packed fixed-length sequences.

Sources: the embedded corpus (``source: embedded``, no download) or local files (``source: files`` with
``files:`` a path or glob of .txt / .jsonl / .parquet). Documents are split into three disjoint sets, train /
val / test, by a hash of each document (``datamodules.common.splits``); ``val_files`` / ``test_files`` give a
split from its own files instead (then the training files hold no documents of that split). Each split is
tokenized once (cached by corpus, tokenizer and fractions), joined with EOS and cut into ``seq_len`` blocks.
Checkpoints are selected on val; ``test_dataloader`` serves the test split, which nothing else reads.
The training order comes from ``StepStreamSampler``: a function of seed and optimizer step, so resumed and
paired runs see the same batches.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.common.cache import cache_root, stable_hash
from datamodules.common.errors import ConfigError
from datamodules.common.sampling import StepStreamSampler
from datamodules.common.splits import SPLITS, check_fractions, split_items


class PackedTokens(Dataset):
    """Fixed-length blocks over one flat token array (labels = inputs; the model shifts)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = len(tokens) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.from_numpy(self.tokens[i * self.seq_len:(i + 1) * self.seq_len].astype(np.int64))
        return {"input_ids": x, "labels": x.clone()}


def tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha1(repr((vocab, tokenizer.eos_token)).encode()).hexdigest()[:16]


def tokenize_documents(docs: list[str], tokenizer) -> np.ndarray:
    """One flat array: each document's tokens followed by EOS."""
    eos = tokenizer.eos_token_id
    out = []
    for i in range(0, len(docs), 256):
        for ids in tokenizer(docs[i:i + 256], add_special_tokens=False)["input_ids"]:
            out.extend(ids)
            out.append(eos)
    dtype = np.uint16 if len(tokenizer) < 2**16 else np.int32
    return np.asarray(out, dtype=dtype)


class TextDataModule(L.LightningDataModule):
    def __init__(self, tokenizer, source: str = "embedded", files=None, text_field: str = "text",
                 seq_len: int = 256, batch_size: int = 8, eval_batch_size: int | None = None,
                 val_fraction: float = 0.05, test_fraction: float = 0.05, val_files=None, test_files=None,
                 max_val_sequences: int | None = 64, num_workers: int = 0, seed: int = 0):
        super().__init__()
        check_fractions(val_fraction, test_fraction)
        self.tokenizer = tokenizer
        self.source, self.files, self.text_field = source, files, text_field
        self.val_files, self.test_files = val_files, test_files
        self.seq_len, self.batch_size = seq_len, batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.val_fraction, self.test_fraction, self.max_val_sequences = val_fraction, test_fraction, max_val_sequences
        self.num_workers, self.seed = num_workers, seed
        self.train_set = self.val_set = self.test_set = None
        self.check_files()

    def check_files(self) -> None:
        """Files named but not there fail now, as one line, before the model is built or anything is tokenised."""
        from datamodules.common.loaders import expand_files

        for key, files in (("data.files", self.files if self.source == "files" else None),
                           ("data.val_files", self.val_files), ("data.test_files", self.test_files)):
            if files:
                expand_files(files, key)

    # --- documents and tokens --------------------------------------------------------------------
    def documents(self, files=None) -> list[str]:
        if files is not None:
            from datamodules.common.loaders import local_documents

            return local_documents(files, self.text_field)
        if self.source == "embedded":
            from datamodules.common.corpus import embedded_documents

            return embedded_documents()
        if self.source == "files":
            from datamodules.common.loaders import local_documents

            return local_documents(self.files, self.text_field)
        raise ConfigError(f"data.source={self.source!r} is unknown — use 'embedded' or 'files' "
                          "(with data.files=<path or glob>)")

    def split_documents(self) -> dict[str, list[str]]:
        """Train / val / test documents: hashed out of the main source, except a split given by its own files."""
        own = {"val": self.val_files, "test": self.test_files}
        docs = split_items(self.documents(), 0.0 if own["val"] else self.val_fraction,
                           0.0 if own["test"] else self.test_fraction)
        for split, files in own.items():
            if files:
                docs[split] = self.documents(files)
        return docs

    def split_tokens(self) -> dict[str, np.ndarray]:
        """``{"train", "val", "test"}`` -> one flat token array each (cached)."""
        from datamodules.common.corpus import corpus_key

        def files_key(files):
            return files and stable_hash(files, [Path(f).stat().st_mtime for f in _expand(files)])

        src = corpus_key() if self.source == "embedded" else files_key(self.files)
        key = stable_hash(src, self.text_field, tokenizer_fingerprint(self.tokenizer), self.val_fraction,
                          self.test_fraction, files_key(self.val_files), files_key(self.test_files))
        path = cache_root() / "tokens" / f"{key}.npz"
        if path.exists():
            z = np.load(path)
            return {s: z[s] for s in SPLITS}
        tokens = {s: tokenize_documents(d, self.tokenizer) for s, d in self.split_documents().items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.stem + ".tmp.npz")
        np.savez(tmp, **tokens)
        tmp.replace(path)
        return tokens

    def setup(self, stage: str | None = None):
        if self.train_set is not None:
            return
        tokens = self.split_tokens()
        self.train_set, self.val_set, self.test_set = (PackedTokens(tokens[s], self.seq_len) for s in SPLITS)
        for split in ("val", "test"):
            if len(getattr(self, f"{split}_set")) == 0:
                raise ValueError(f"the {split} split holds fewer than data.seq_len={self.seq_len} tokens; "
                                 f"raise data.{split}_fraction or lower data.seq_len")

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    # --- loaders ---------------------------------------------------------------------------------
    def _rank_world(self):
        t = self._trainer if hasattr(self, "_trainer") else None
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def train_dataloader(self):
        trainer = self.trainer
        rank, world = self._rank_world()
        accum = trainer.accumulate_grad_batches if trainer is not None else 1
        if trainer is not None and trainer.max_steps and trainer.max_steps > 0:
            total = trainer.max_steps * accum * self.batch_size
            start = trainer.global_step * accum * self.batch_size
        else:  # epoch-based: one pass per epoch, no mid-epoch resume
            total, start = len(self.train_set) // world, 0
        sampler = StepStreamSampler(len(self.train_set), total, seed=self.seed, start=start, rank=rank, world_size=world)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers,
                          drop_last=True, persistent_workers=self.num_workers > 0)

    def _eval_loader(self, dataset):
        rank, world = self._rank_world()
        n = len(dataset) if self.max_val_sequences is None else min(len(dataset), self.max_val_sequences)
        n -= n % world  # equal shares, so a sum over ranks counts every sequence once
        idx = list(range(rank, n, world))
        return DataLoader(torch.utils.data.Subset(dataset, idx), batch_size=self.eval_batch_size, shuffle=False,
                          num_workers=self.num_workers)

    def val_dataloader(self):
        return self._eval_loader(self.val_set)

    def test_dataloader(self):
        return self._eval_loader(self.test_set)


def _expand(files) -> list[str]:
    import glob

    pats = [files] if isinstance(files, str) else list(files or [])
    return sorted(p for pat in pats for p in glob.glob(str(Path(pat).expanduser())))
