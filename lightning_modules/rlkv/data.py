"""Multi-passkey sequences for DuoAttention's retrieval distillation (RLKV's baseline probe).

Each item is one right-padded row with ``supervise`` = 1 on the positions whose last-layer hidden states the gated
model must reproduce. ``layout``:

- ``qa_span`` (default, the release's ``base/duo_attn/data.py`` ``MultiplePasskeyRetrievalDataset``): ``n_keys``
  numbered pass keys inserted at sorted random depths in [0.05, 0.95] of a haystack (a local text file, BookSum in
  the release, or synthetic filler), then one question + key + separator per pass key, in order; the whole QA span is
  supervised (questions and separators too). Context lengths run over ``length_intervals`` evenly spaced values from
  ``n_tokens_min`` to ``n_tokens`` (the release: 50 from 1K to 32K), item i taking the (i mod intervals)-th. Keys are
  5-digit numbers, or ``passkey_words`` words of the NATO alphabet (the release: 32). The wording is ours.
- ``recite``: ours before (``datamodules.synthetic.multi_passkey_sample``): one question, the keys recited in order as
  the answer, only the answer supervised.

Train and val use disjoint seeds.
"""
from __future__ import annotations

import random

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from datamodules.synthetic import filler_text, multi_passkey_sample

LAYOUTS = ("qa_span", "recite")
NATO = ("alfa bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike november oscar papa quebec romeo "
        "sierra tango uniform victor whiskey xray yankee zulu").split()
INTRO = "Below is a long text. Pass keys are hidden in it; remember each of them.\n\n"


def context_lengths(n_min: int, n_max: int, intervals: int) -> list[int]:
    return [int(x) for x in torch.linspace(n_min, n_max, max(1, intervals)).tolist()]


def qa_span_sample(tokenizer, haystack: list[int], n_tokens: int, n_keys: int, rng: random.Random,
                   passkey_words: int = 0) -> tuple[list[int], list[int]]:
    """(token ids, supervise flags) of one release-layout sample with a context of about ``n_tokens`` tokens."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    keys = [" ".join(rng.choice(NATO) for _ in range(passkey_words)) if passkey_words
            else str(rng.randint(10_000, 99_999)) for _ in range(n_keys)]
    sep = enc("\n\n")
    needles = [sep + enc(f"Pass key number {j + 1} is: {k}.") + sep for j, k in enumerate(keys)]
    intro, close = enc(INTRO), enc("\n\nEnd of the text.\n\n")
    budget = n_tokens - len(intro) - sum(map(len, needles))
    if budget < 0:
        raise ValueError(f"data.n_tokens={n_tokens} is too short for {n_keys} pass keys: use at least "
                         f"{n_tokens - budget}")
    hay = haystack[:budget]
    depths = sorted(0.05 + 0.9 * d / 999 for d in rng.sample(range(1000), n_keys))
    context, last = [], 0
    for depth, needle in zip(depths, needles):
        cut = int(len(hay) * depth)
        context += hay[last:cut] + needle
        last = cut
    context += hay[last:]
    qa = [t for j, k in enumerate(keys) for t in enc(f"What is pass key number {j + 1}? Pass key:") + enc(f" {k}") + sep]
    prefix = intro + context + close
    return prefix + qa, [0] * len(prefix) + [1] * len(qa)


def load_haystack(tokenizer, files, n_tokens: int) -> list[int]:
    """At least ``n_tokens`` tokens of haystack: local text files (``text`` field), else repeated synthetic filler."""
    if not files:
        return tokenizer(filler_text(tokenizer, n_tokens + 64), add_special_tokens=False)["input_ids"]
    from datamodules.common.loaders import local_documents

    out: list[int] = []
    for doc in local_documents(files):
        out += tokenizer(doc + "\n\n", add_special_tokens=False)["input_ids"]
        if len(out) >= n_tokens:
            return out
    raise ValueError(f"data.haystack_files={files}: {len(out)} tokens, fewer than data.n_tokens={n_tokens}")


class MultiPasskeys(Dataset):
    """``n`` samples, each built on demand from ``seed + i`` (a paper-scale set of 2,000 x up to 32K tokens would not
    sit well in memory)."""

    def __init__(self, tokenizer, n: int, n_tokens: int, n_keys: int, seed: int, layout: str = "qa_span",
                 haystack: list[int] | None = None, lengths: list[int] | None = None, passkey_words: int = 0):
        self.tokenizer, self.n, self.n_tokens, self.n_keys, self.seed = tokenizer, n, n_tokens, n_keys, seed
        self.layout, self.haystack, self.lengths, self.passkey_words = layout, haystack, lengths, passkey_words
        if n:
            self[0]  # fail on a too-short length here, not in the first training step

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.layout == "recite":
            s = multi_passkey_sample(self.tokenizer, self.n_tokens, self.seed + i, self.n_keys)
            prompt = self.tokenizer(s["prompt"], add_special_tokens=False)["input_ids"]
            answer = self.tokenizer(s["answer"], add_special_tokens=False)["input_ids"]
            return prompt + answer, [0] * len(prompt) + [1] * len(answer)
        length = self.lengths[i % len(self.lengths)] if self.lengths else self.n_tokens
        return qa_span_sample(self.tokenizer, self.haystack, length, self.n_keys, random.Random(self.seed + i),
                              self.passkey_words)


def collate(rows, pad_id: int) -> dict:
    width = max(len(ids) for ids, _ in rows)
    pad = lambda xs, v: xs + [v] * (width - len(xs))  # noqa: E731
    return {"input_ids": torch.tensor([pad(ids, pad_id) for ids, _ in rows]),
            "attention_mask": torch.tensor([pad([1] * len(ids), 0) for ids, _ in rows]),
            "supervise": torch.tensor([pad(sup, 0) for _, sup in rows], dtype=torch.bool)}


class MultiPasskeyDataModule(L.LightningDataModule):
    def __init__(self, tokenizer, n_tokens: int = 1024, n_keys: int = 10, n_train: int = 2000, n_val: int = 16,
                 batch_size: int = 1, seed: int = 0, layout: str = "qa_span", n_tokens_min: int | None = None,
                 length_intervals: int = 50, haystack_files=None, passkey_words: int = 0):
        super().__init__()
        if n_keys < 1 or n_tokens < 1:
            raise ValueError(f"data.n_keys={n_keys}, data.n_tokens={n_tokens}: both must be positive")
        if layout not in LAYOUTS:
            raise ValueError(f"data.layout={layout!r}: choose qa_span (the release) or recite")
        if n_tokens_min is not None and not 0 < n_tokens_min <= n_tokens:
            raise ValueError(f"data.n_tokens_min={n_tokens_min}: between 1 and data.n_tokens={n_tokens}, or null")
        self.tokenizer, self.n_tokens, self.n_keys = tokenizer, n_tokens, n_keys
        self.n_train, self.n_val, self.batch_size, self.seed = n_train, n_val, batch_size, seed
        self.layout, self.haystack_files, self.passkey_words = layout, haystack_files, passkey_words
        self.lengths = context_lengths(n_tokens_min, n_tokens, length_intervals) if n_tokens_min else None
        self.train_set = self.val_set = None

    def setup(self, stage: str | None = None):
        if self.train_set is None:
            base = self.seed * 1_000_003
            hay = load_haystack(self.tokenizer, self.haystack_files, self.n_tokens) if self.layout == "qa_span" else None
            make = lambda n, seed: MultiPasskeys(self.tokenizer, n, self.n_tokens, self.n_keys, seed, self.layout,  # noqa: E731
                                                 hay, self.lengths, self.passkey_words)
            self.train_set = make(self.n_train, base)
            self.val_set = make(self.n_val, base + 500_009)

    def _loader(self, ds, shuffle):
        return DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle,
                          collate_fn=lambda rows: collate(rows, self.tokenizer.pad_token_id))

    def train_dataloader(self):
        return self._loader(self.train_set, True)

    def val_dataloader(self):
        return self._loader(self.val_set, False)

    def test_dataloader(self):
        return self._loader(self.val_set, False)
