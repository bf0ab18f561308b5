"""A data mixture over quality buckets with finite unique pools (InfoLaw, ../shared/papers/infolaw.md).

``buckets``: ``[{name, source, unique_tokens, quality, noise}]``. Bucket k is a pool of U_k unique tokens
(``unique_tokens``, rounded down to whole ``seq_len`` windows): consecutive windows of its ``source``, either the
module's own training split (``source: null``: the embedded corpus or ``files``, as ``data=corpus``) or a
pretokenized shard dir (``data=shards``' build, its train split, memory-mapped). Buckets that share a source take
disjoint slices of it, in order. ``noise`` replaces that share of a pool's tokens by uniform random ones, fixed per
window (a repeat sees the same tokens): the tiny experiment's low-quality bucket. ``quality`` is the score s_k the
law reads (a user-supplied classifier score at paper scale); the data module only records it.

Training draws the bucket of every sequence with weight w_k (``weights``: a mapping name -> w, one entry may be
null for the remainder) from a low-discrepancy stream (a golden-ratio Weyl sequence through the cumulative
weights): every prefix of the stream holds w_k of its sequences from bucket k within a few sequences, where
i.i.d. draws would stray by √n. Within a bucket the pool is read in a fresh permutation each epoch (the
permutations of ``StepStreamSampler``), so bucket k repeats exactly its U_k tokens, e_k = w_k D / U_k times.
Like ``StepStreamSampler``, the stream is a function of seed and position, so a resumed run sees the same
batches. Validation and test read the clean held-out splits of the module's own source (``TextDataModule``) or,
with ``eval_shard_dir``, the val / test shards of a pretokenized corpus.
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from datamodules.common.miniature import register_layout
from datamodules.common.sampling import StepStreamSampler
from datamodules.common.splits import unit_hash
from datamodules.text import PackedTokens, TextDataModule

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def check_weights(names: list[str], weights) -> np.ndarray:
    """Weights in bucket order, on the simplex; a mapping may leave one bucket null (the remainder)."""
    if isinstance(weights, Mapping):
        unknown = sorted(set(weights) - set(names))
        if unknown:
            raise ValueError(f"data.weights names unknown bucket(s) {unknown}: the buckets are {names}")
        nulls = [n for n in names if weights.get(n) is None]
        if len(nulls) > 1:
            raise ValueError(f"data.weights leaves {nulls} unset: give every bucket a weight but at most one (the rest)")
        given = {n: float(weights[n]) for n in names if weights.get(n) is not None}
        w = np.array([given.get(n, 1.0 - sum(given.values())) for n in names])
    else:
        w = np.asarray(list(weights), dtype=np.float64)
        if len(w) != len(names):
            raise ValueError(f"data.weights has {len(w)} entries for {len(names)} buckets {names}")
    if (w < -1e-12).any() or abs(w.sum() - 1.0) > 1e-6:
        raise ValueError(f"data.weights {dict(zip(names, w.round(6).tolist()))} are off the simplex: "
                         "each must be >= 0 and they must sum to 1")
    return np.clip(w, 0.0, None)


class BucketPool(Dataset):
    """``n`` windows of a source from window ``start``; with ``noise`` > 0 a fixed share of tokens replaced."""

    def __init__(self, source: Dataset, start: int, n: int, noise: float = 0.0, vocab_size: int = 0, seed: int = 0):
        self.source, self.start, self.n = source, start, n
        self.noise, self.vocab_size, self.seed = noise, vocab_size, seed

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        x = self.source[self.start + j]["input_ids"]
        if self.noise > 0:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + j)  # a window's noise is fixed: repeats match
            mask = torch.rand(x.shape, generator=g) < self.noise
            x = torch.where(mask, torch.randint(0, self.vocab_size, x.shape, generator=g), x)
        return {"input_ids": x, "labels": x.clone()}


class MixtureDataset(Dataset):
    """The bucket pools end to end: item ``offsets[k] + j`` is window j of bucket k."""

    def __init__(self, pools: list[BucketPool]):
        self.pools = pools
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in pools])]).astype(np.int64)

    def __len__(self):
        return int(self.offsets[-1])

    def __getitem__(self, i):
        k = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return self.pools[k][i - int(self.offsets[k])]


class MixtureSampler(Sampler[int]):
    """Indices into a ``MixtureDataset``: position m of the global stream comes from bucket
    ``searchsorted(cumsum(w), frac(u0 + m·φ))``; bucket k's c-th draw is item c mod n_k of its (c div n_k)-th
    permutation. Rank r of w takes every w-th position; ``start`` (per rank) resumes mid-stream."""

    def __init__(self, sizes: list[int], weights: np.ndarray, total_samples: int, seed: int = 0, start: int = 0,
                 rank: int = 0, world_size: int = 1):
        self.sizes, self.total, self.start, self.rank, self.world = list(sizes), total_samples, start, rank, world_size
        self.cum = np.cumsum(weights)[:-1]
        self.u0 = unit_hash(f"mixture-{seed}")
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.streams = [StepStreamSampler(n, n, seed=seed * 1009 + k) if n else None for k, n in enumerate(sizes)]

    def buckets(self, lo: int, hi: int) -> np.ndarray:
        """The bucket of every global stream position in [lo, hi)."""
        m = np.arange(lo, hi, dtype=np.float64)
        return np.searchsorted(self.cum, np.mod(self.u0 + m * GOLDEN, 1.0), side="right")

    def counts(self, n: int, chunk: int = 1 << 22) -> np.ndarray:
        """Sequences drawn from each bucket in the first ``n`` global positions."""
        out = np.zeros(len(self.sizes), dtype=np.int64)
        for lo in range(0, n, chunk):
            out += np.bincount(self.buckets(lo, min(n, lo + chunk)), minlength=len(self.sizes))
        return out

    def __len__(self) -> int:
        return self.total

    def __iter__(self):
        pos, end = self.start * self.world, (self.start + self.total) * self.world
        drawn = self.counts(pos)
        perms: dict[tuple[int, int], torch.Tensor] = {}
        while pos < end:
            hi = min(end, pos + 4096)
            for m, k in zip(range(pos, hi), self.buckets(pos, hi)):
                p, j = divmod(int(drawn[k]), self.sizes[k])
                if (k, p) not in perms:
                    perms = {key: v for key, v in perms.items() if key[0] != k}  # one epoch per bucket in memory
                    perms[(k, p)] = self.streams[k]._pass(p)
                drawn[k] += 1
                if m % self.world == self.rank:
                    yield int(self.offsets[k] + perms[(k, p)][j])
            pos = hi


class MixtureDataModule(TextDataModule):
    """Quality buckets with finite unique pools mixed by ``weights``; loaders and eval as ``TextDataModule``.

    Args (beyond ``TextDataModule``'s, which define the default source and the clean val / test splits):
        buckets: ``[{name, source: null | <shard dir>, unique_tokens, quality, noise: 0}]``.
        weights: name -> w_k (one may be null: 1 − the others), or a list in bucket order; on the simplex.
        eval_shard_dir: val / test from this pretokenized corpus instead of the module's own source.
    """

    def __init__(self, tokenizer, buckets: list[Mapping], weights, eval_shard_dir: str | None = None, **kw):
        super().__init__(tokenizer, **kw)
        if not buckets:
            raise ValueError("data.buckets is empty: give [{name, unique_tokens, quality}, ...]")
        self.buckets = []
        for b in buckets:
            missing = {"name", "unique_tokens"} - set(b)
            if missing:
                raise ValueError(f"data.buckets entry {dict(b)} lacks {sorted(missing)}")
            unknown = set(b) - {"name", "source", "unique_tokens", "quality", "noise"}
            if unknown:
                raise ValueError(f"data.buckets entry {b['name']!r}: unknown key(s) {sorted(unknown)} "
                                 "(name, source, unique_tokens, quality, noise)")
            if not 0.0 <= float(b.get("noise", 0.0)) <= 1.0:
                raise ValueError(f"bucket {b['name']!r}: noise={b['noise']} must be in [0, 1]")
            if int(b["unique_tokens"]) < self.seq_len:
                raise ValueError(f"bucket {b['name']!r}: unique_tokens={b['unique_tokens']} is below one sequence "
                                 f"(data.seq_len={self.seq_len})")
            self.buckets.append({"source": None, "quality": None, "noise": 0.0, **b})
        self.names = [str(b["name"]) for b in self.buckets]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"data.buckets names repeat: {self.names}")
        self.weights = check_weights(self.names, weights)
        self.eval_shard_dir = eval_shard_dir
        self.pool_windows = [int(b["unique_tokens"]) // self.seq_len for b in self.buckets]

    @property
    def unique_tokens(self) -> list[int]:
        """U_k as realised: whole windows."""
        return [n * self.seq_len for n in self.pool_windows]

    def setup(self, stage: str | None = None):
        if self.train_set is not None:
            return
        from datamodules.common.shards import TokenShards

        if self.eval_shard_dir:
            self.val_set, self.test_set = (TokenShards(self.eval_shard_dir, s, self.seq_len) for s in ("val", "test"))
            own = None
        else:
            super().setup(stage)
            own = self.train_set
        sources, used, pools = {}, {}, []
        for k, b in enumerate(self.buckets):
            key = b["source"]
            if key not in sources:
                if key is None and own is None:
                    own = PackedTokens(self.split_tokens()["train"], self.seq_len)
                sources[key] = own if key is None else TokenShards(key, "train", self.seq_len)
            src, start, n = sources[key], used.get(key, 0), self.pool_windows[k]
            if start + n > len(src):
                where = "the training split of data.source" if key is None else f"the train shards of {key}"
                raise ValueError(f"bucket {b['name']!r} asks for {n * self.seq_len} unique tokens but {where} has "
                                 f"{(len(src) - start) * self.seq_len} left after the buckets before it: lower "
                                 f"unique_tokens or give it a larger source")
            used[key] = start + n
            pools.append(BucketPool(src, start, n, float(b["noise"]), self.vocab_size, seed=k + 1))
        self.train_set = MixtureDataset(pools)

    def sampler(self, total: int, start: int = 0, rank: int = 0, world: int = 1) -> MixtureSampler:
        return MixtureSampler(self.pool_windows, self.weights, total, seed=self.seed, start=start, rank=rank,
                              world_size=world)

    def train_dataloader(self):
        from torch.utils.data import DataLoader

        trainer = self.trainer
        rank, world = self._rank_world()
        accum = trainer.accumulate_grad_batches if trainer is not None else 1
        if trainer is None or not trainer.max_steps or trainer.max_steps <= 0:
            raise ValueError("a data mixture trains for a number of tokens: set trainer.max_steps (D = steps x batch "
                             "x seq_len x devices x accumulation)")
        total = trainer.max_steps * accum * self.batch_size
        sampler = self.sampler(total, trainer.global_step * accum * self.batch_size, rank, world)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers,
                          drop_last=True, persistent_workers=self.num_workers > 0)

    def mixture_stats(self, sequences: int) -> dict:
        """What ``sequences`` global training sequences held: D, and per bucket w_k, U_k, s_k, D_k, e_k."""
        drawn = self.sampler(sequences).counts(sequences)
        out = {"D": sequences * self.seq_len}
        for b, w, U, c in zip(self.buckets, self.weights, self.unique_tokens, drawn):
            name, D_k = b["name"], int(c) * self.seq_len
            out.update({f"w_{name}": float(w), f"U_{name}": U, f"D_{name}": D_k, f"e_{name}": D_k / U})
            if b["quality"] is not None:
                out[f"s_{name}"] = float(b["quality"])
        return out


@register_layout("infolaw/shards/*")
def write_bucket_shards(target, cfg) -> None:
    """A quality bucket (or the clean ``eval`` set) as ``python -m datamodules.common.shards`` builds it, from
    miniature documents tokenized with the run's tokenizer; ``eval`` gets its val and test splits."""
    from hydra.utils import instantiate

    from datamodules.common.miniature import documents, write_jsonl
    from datamodules.common.shards import build_shards

    source = target.parent / f"{target.name}.text.jsonl"
    source.parent.mkdir(parents=True, exist_ok=True)
    seed = sum(map(ord, target.name))  # a different text per bucket, the same every run
    write_jsonl(source, [{"text": d} for d in documents(seed=seed)])
    fraction = 0.3 if target.name == "eval" else 0.0
    build_shards([source], instantiate(cfg.data.tokenizer), target, val_fraction=fraction, test_fraction=fraction,
                 progress=False)
