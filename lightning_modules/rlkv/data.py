"""Multi-passkey sequences for DuoAttention's retrieval distillation (``datamodules.synthetic.multi_passkey_sample``).

Each item is prompt + answer as one right-padded row with ``supervise`` = 1 on the answer tokens (the positions
whose last-layer hidden states the gated model must reproduce). Train and val use disjoint seeds.
"""
from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.synthetic import multi_passkey_sample


class MultiPasskeys(Dataset):
    def __init__(self, tokenizer, n: int, n_tokens: int, n_keys: int, seed: int):
        self.rows = []
        for i in range(n):
            s = multi_passkey_sample(tokenizer, n_tokens, seed + i, n_keys)
            prompt = tokenizer(s["prompt"], add_special_tokens=False)["input_ids"]
            answer = tokenizer(s["answer"], add_special_tokens=False)["input_ids"]
            self.rows.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(rows, pad_id: int) -> dict:
    width = max(len(ids) for ids, _ in rows)
    pad = lambda xs, v: xs + [v] * (width - len(xs))  # noqa: E731
    return {"input_ids": torch.tensor([pad(ids, pad_id) for ids, _ in rows]),
            "attention_mask": torch.tensor([pad([1] * len(ids), 0) for ids, _ in rows]),
            "supervise": torch.tensor([pad(sup, 0) for _, sup in rows], dtype=torch.bool)}


class MultiPasskeyDataModule(L.LightningDataModule):
    def __init__(self, tokenizer, n_tokens: int = 1024, n_keys: int = 10, n_train: int = 2000, n_val: int = 16,
                 batch_size: int = 1, seed: int = 0):
        super().__init__()
        if n_keys < 1 or n_tokens < 1:
            raise ValueError(f"data.n_keys={n_keys}, data.n_tokens={n_tokens}: both must be positive")
        self.tokenizer, self.n_tokens, self.n_keys = tokenizer, n_tokens, n_keys
        self.n_train, self.n_val, self.batch_size, self.seed = n_train, n_val, batch_size, seed
        self.train_set = self.val_set = None

    def setup(self, stage: str | None = None):
        if self.train_set is None:
            base = self.seed * 1_000_003
            self.train_set = MultiPasskeys(self.tokenizer, self.n_train, self.n_tokens, self.n_keys, base)
            self.val_set = MultiPasskeys(self.tokenizer, self.n_val, self.n_tokens, self.n_keys, base + 500_009)

    def _loader(self, ds, shuffle):
        return DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle,
                          collate_fn=lambda rows: collate(rows, self.tokenizer.pad_token_id))

    def train_dataloader(self):
        return self._loader(self.train_set, True)

    def val_dataloader(self):
        return self._loader(self.val_set, False)

    def test_dataloader(self):
        return self._loader(self.val_set, False)
