"""Long-range key–value retrieval across segments: the probe that separates segment-local attention from attention
that carries information between segments (HiCI's global slots, S²-Attn's shifted groups, full attention).

A sample is ``seq_len`` token ids cut into ``num_segments`` equal segments (the attention segments of HiCI / local /
S²-Attn): random filler tokens, ``n_pairs`` single-token ``key value`` pairs planted at seeded positions inside the
first segment (distinct keys), and, closing the last segment, one of those keys followed by its value — the target.
Keys and values never occur in the filler, so the query key is the only cue and the value can only be read from
the first segment: with ``num_segments`` ≥ 2, attention confined to the last segment sits at chance, 1/len(values).

Token ids, not text: the caller picks the key / value / filler id sets (``split_vocab``), so a tiny tokenizer's
merges cannot split a key into several tokens.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch
from torch.utils.data import Dataset


def split_vocab(vocab_size: int, n_keys: int, n_values: int, first_id: int = 260) -> dict[str, list[int]]:
    """Disjoint id sets from a vocabulary: values are the last ``n_values`` ids, keys the ``n_keys`` before them,
    filler everything from ``first_id`` (past special and byte tokens of a byte-level BPE) up to the keys."""
    filler = list(range(first_id, vocab_size - n_keys - n_values))
    if n_keys < 1 or n_values < 2 or len(filler) < 2:
        raise ValueError(f"split_vocab: vocab_size={vocab_size} cannot hold {n_keys} keys (>= 1), {n_values} values "
                         f"(>= 2) and filler from id {first_id}; use fewer keys/values or a lower first_id")
    keys = list(range(filler[-1] + 1, filler[-1] + 1 + n_keys))
    return {"keys": keys, "values": list(range(keys[-1] + 1, vocab_size)), "filler": filler}


def kv_retrieval_sample(seq_len: int, num_segments: int, seed: int, keys: Sequence[int], values: Sequence[int],
                        filler: Sequence[int], n_pairs: int = 1) -> dict:
    """One sample: ``input_ids`` (seq_len,), ``labels`` (-100 except the final value), ``answer`` (the value id),
    ``key``, ``planted_at`` (index of the queried pair's key) and ``query_at`` (index of the final key)."""
    seg = seq_len // num_segments
    if seq_len % num_segments or num_segments < 2:
        raise ValueError(f"seq_len={seq_len} must split into num_segments={num_segments} >= 2 equal segments")
    if not 1 <= n_pairs <= len(keys) or 2 * n_pairs > seg or seg < 3:
        raise ValueError(f"n_pairs={n_pairs} needs 1..{len(keys)} distinct keys and 2*n_pairs <= segment length "
                         f"{seg} (>= 3 for the query)")
    rng = random.Random(seed)
    ids = [rng.choice(filler) for _ in range(seq_len)]
    pair_keys = rng.sample(list(keys), n_pairs)
    pair_values = [rng.choice(values) for _ in range(n_pairs)]
    # non-overlapping 2-token slots in the first segment
    starts = sorted(2 * s for s in rng.sample(range(seg // 2), n_pairs))
    for start, k, v in zip(starts, pair_keys, pair_values):
        ids[start], ids[start + 1] = k, v
    target = rng.randrange(n_pairs)
    ids[-2], ids[-1] = pair_keys[target], pair_values[target]
    x = torch.tensor(ids, dtype=torch.long)
    labels = torch.full_like(x, -100)
    labels[-1] = x[-1]
    return {"input_ids": x, "labels": labels, "answer": pair_values[target], "key": pair_keys[target],
            "planted_at": starts[target], "query_at": seq_len - 2}


class KVRetrievalDataset(Dataset):
    """``length`` samples, sample ``i`` drawn from seed ``(seed, i)``: the same data for every arm given a seed."""

    def __init__(self, length: int, seq_len: int, num_segments: int, vocab: dict, n_pairs: int = 1, seed: int = 0):
        self.length, self.seq_len, self.num_segments = length, seq_len, num_segments
        self.vocab, self.n_pairs, self.seed = vocab, n_pairs, seed

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        s = kv_retrieval_sample(self.seq_len, self.num_segments, self.seed * 1_000_003 + i, self.vocab["keys"],
                                self.vocab["values"], self.vocab["filler"], self.n_pairs)
        return {"input_ids": s["input_ids"], "labels": s["labels"], "answer": s["answer"]}
