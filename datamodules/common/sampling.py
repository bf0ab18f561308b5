"""A sampler whose position is a function of the optimizer step, so a resumed run sees exactly the batches
it would have seen, and paired runs with one seed see one data order.

Each pass over the data is a permutation seeded by (seed, pass); the stream of passes is cut into batches;
rank r of w takes every w-th sample. Resuming at step s starts the stream at sample s·batch·accum·w.
"""
from __future__ import annotations

import torch
from torch.utils.data import Sampler


class StepStreamSampler(Sampler[int]):
    def __init__(self, num_items: int, total_samples: int, seed: int = 0, shuffle: bool = True,
                 start: int = 0, rank: int = 0, world_size: int = 1):
        if num_items <= 0:
            raise ValueError("the training split is empty: the corpus is smaller than one sequence; lower data.seq_len")
        self.num_items, self.total, self.seed, self.shuffle = num_items, total_samples, seed, shuffle
        self.start, self.rank, self.world_size = start, rank, world_size

    def _pass(self, p: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_items)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + p)
        return torch.randperm(self.num_items, generator=g)

    def __len__(self) -> int:  # the whole run's length: Lightning counts resumed batches against it
        return self.total

    def __iter__(self):
        g0 = self.start * self.world_size  # global position in the stream
        p, offset = divmod(g0, self.num_items)
        perm = self._pass(p)
        produced = self.start
        pos = g0
        while produced < self.total:
            if offset >= self.num_items:
                p, offset = p + 1, 0
                perm = self._pass(p)
            if pos % self.world_size == self.rank:
                yield int(perm[offset])
                produced += 1
            offset += 1
            pos += 1
