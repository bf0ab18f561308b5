"""Long-document language modelling at a target context (LongLoRA / HiCI style).

Documents (the embedded corpus, or PG-19 / proof-pile / RedPajama samples from local files via the core's loaders)
are joined with EOS and cut into ``seq_len`` blocks — the target context, e.g. 4× the backbone's native one.

``passkey_fraction`` > 0 replaces that fraction of training blocks (chosen by a seeded hash of the index) with
passkey-retrieval prompts of the same length followed by their answer (``datamodules.synthetic.passkey_sample``):
the planted-key task a tiny model must be taught before it can be scored on it. Paper-scale configs keep 0.

``eval_tokens()`` is the test stream the long-context evaluator scores (sliding perplexity): held-out documents
that neither training nor checkpoint selection sees.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch.utils.data import Dataset

from datamodules.text import PackedTokens, TextDataModule


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


class LongContextDataModule(TextDataModule):
    """``TextDataModule`` at a long target context, with optional passkey mixing and the eval token stream."""

    def __init__(self, tokenizer, passkey_fraction: float = 0.0, seq_len: int = 1024, **kw):
        super().__init__(tokenizer, seq_len=seq_len, **kw)
        if not 0.0 <= passkey_fraction < 1.0:
            raise ValueError(f"data.passkey_fraction={passkey_fraction} must be in [0, 1)")
        self.passkey_fraction = passkey_fraction
        self._test_tokens = None

    def setup(self, stage: str | None = None):
        if self.train_set is not None:
            return
        super().setup(stage)
        self._test_tokens = self.test_set.tokens
        if self.passkey_fraction > 0:
            self.train_set = PasskeyMix(self.train_set, self.tokenizer, self.passkey_fraction, self.seed)

    def eval_tokens(self) -> torch.Tensor:
        """The test split as one token stream (documents joined with EOS)."""
        if self._test_tokens is None:
            self.setup()
        return torch.from_numpy(np.asarray(self._test_tokens, dtype=np.int64))
