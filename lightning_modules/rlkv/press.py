"""The head-wise full / constant KV cache of RLKV and DuoAttention, on the shared press interface.

``allocate(gates, sparsity)``: the heads with the lowest gates over the whole model (global, not per layer; ties by
position) become *streaming* heads, which keep ``sink`` + ``recent`` cache entries (inference: 16 + 64), the rest keep
the full cache; how many is ``head_count``: ``quantile`` (default, the release's s-quantile threshold, ceil(s·(n−1))
heads of n) or ``round`` (round(s·n), ours before; one head more at e.g. s = 0.6 of 256). Gates are clipped to [0, 1]
on loading, released ``adapter_weights.tsv`` files included. KV reduction ≈ s·(1 − (sink+recent)/L).

``HeadMixedPress(gates, sparsity, sink, recent, storage, source)``: prefill attends over the whole context (the
press contract, as for every token-dropping baseline); from then on a streaming head sees its first ``sink`` and
latest ``recent`` entries, counted from a row's first real token, and the token being decoded.

- ``storage: masked``: the cache keeps every entry; evicted positions are hidden through AdaKV's
  ``masked_attention`` (``module.press_evicted``, rewritten after every decoding step by ``on_decode``).
- ``storage: split``: the streaming heads' entries move into a constant-size buffer (``HeadSplitLayer`` replaces the
  layer's cache): the real memory saving. Attention sees the buffer right-aligned beside the full heads' entries,
  the columns in front of it masked, so both storages give the same logits. (``kv_press.prefill_and_answer``'s
  cache save/restore knows only plain layers: use ``masked`` there, ``split`` for generation.)

``source`` says where the gates come from: ``rlkv`` / ``duo`` (``gates``: an L x H_kv list, or the path of a run's
metrics.json holding ``results.gates``), ``random`` (uniform gates drawn from ``seed``), ``all_streaming`` (every
head streams, whatever ``sparsity``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from lightning_modules.common.kv_press import Press, attention_layers

SOURCES = ("rlkv", "duo", "random", "all_streaming")
STORAGES = ("masked", "split")


HEAD_COUNTS = ("quantile", "round")


def compressed_heads(n: int, sparsity: float, rule: str = "quantile") -> int:
    """How many of ``n`` heads stream at sparsity s. ``quantile`` (the release: heads strictly below numpy's linear
    s-quantile of the gates, ``sparsify_attention_heads``) = ceil(s·(n−1)) for distinct gates (s(n−1) itself when it
    is an integer, up to float noise), n at s >= 1, 0 at s <= 0; ``round``: round(s·n) (the spec's CPU test)."""
    if rule not in HEAD_COUNTS:
        raise ValueError(f"model.press.head_count={rule!r}: choose quantile (the release) or round")
    if sparsity >= 1 or sparsity <= 0:
        return n if sparsity >= 1 else 0
    return math.ceil(sparsity * (n - 1) - 1e-9) if rule == "quantile" else round(sparsity * n)


def allocate(gates: torch.Tensor, sparsity: float, rule: str = "quantile") -> torch.Tensor:
    """Bool (L, H): True = streaming head; the :func:`compressed_heads` lowest gates over the whole model. Ties are
    broken by (layer, head) order, the earlier head streaming first (the release breaks them with U(0, 1e-6) noise,
    so its pick among equal gates is random; ours is deterministic)."""
    g = torch.as_tensor(gates, dtype=torch.float64)
    k = compressed_heads(g.numel(), sparsity, rule)
    order = torch.argsort(g.flatten(), stable=True)
    stream = torch.zeros(g.numel(), dtype=torch.bool)
    stream[order[:k]] = True
    return stream.view(g.shape)


def window_keep(visible: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """(B, K) bool: the first ``sink`` and the last ``recent`` of each row's visible entries."""
    count = visible.long().cumsum(-1)
    return visible & ((count <= sink) | (count > count[:, -1:] - recent))


def visible_keys(attention_mask: torch.Tensor | None, batch: int, k_len: int, device) -> torch.Tensor:
    """(B, K) bool: the entries the last query of this forward may see (padding excluded)."""
    if attention_mask is None:
        return torch.ones(batch, k_len, dtype=torch.bool, device=device)
    am = attention_mask[:, 0, -1, :k_len]
    return (am if am.dtype == torch.bool else am == 0).expand(batch, -1)


def load_gates(gates: Any) -> torch.Tensor:
    """Gates (L, H_kv) from a list, a run's metrics.json (``results.gates``) or a released pattern file
    (``adapter_weights.tsv``: L rows of H_kv tab-separated values), clipped to [0, 1] as the release's evaluation
    does: its training clamps before each forward, so saved gates may lie outside."""
    if isinstance(gates, (str, Path)):
        path = Path(gates)
        if not path.is_file():
            raise ValueError(f"model.press.gates={gates}: no such file; give a run's metrics.json (results.gates), a "
                             "released adapter_weights.tsv or an L x H_kv list")
        if path.suffix in (".tsv", ".txt"):
            gates = [[float(x) for x in line.split()] for line in path.read_text().splitlines() if line.strip()]
        else:
            data = json.loads(path.read_text())
            gates = data.get("results", data).get("gates")
    return torch.as_tensor(gates, dtype=torch.float64).clamp(0.0, 1.0)


class HeadSplitLayer(DynamicLayer):
    """One layer's cache with full heads growing and streaming heads in a constant-size buffer (``storage: split``).

    ``update`` appends the new tokens to both, returns every head's entries at the full length (the buffer
    right-aligned, what lies in front of it hidden through ``module.press_evicted``), then trims the buffer back to
    the sink + recent window."""

    def __init__(self, module, keys, values, stream: torch.Tensor, keep: torch.Tensor, sink: int, recent: int):
        super().__init__()
        self.module, self.sink, self.recent = module, sink, recent
        self.full_idx, self.stream_idx = (~stream).nonzero().flatten(), stream.nonzero().flatten()
        self.n_heads, self.length = keys.shape[1], keys.shape[-2]
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys[:, self.full_idx], values[:, self.full_idx]
        self.stream_keys, self.stream_values, self.valid = self._compact(keys[:, self.stream_idx],
                                                                         values[:, self.stream_idx], keep)

    @staticmethod
    def _compact(k, v, keep):
        """The kept entries of each row, right-aligned in a buffer as wide as the fullest row, and their validity."""
        width = int(keep.sum(-1).max())
        order = torch.argsort(keep.int(), dim=-1, stable=True)[:, -width:]  # kept last, in position order
        idx = order[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        return k.gather(2, idx), v.gather(2, idx), keep.gather(1, order)

    def update(self, key_states, value_states, *args, **kwargs):
        q = key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states[:, self.full_idx]], dim=-2)
        self.values = torch.cat([self.values, value_states[:, self.full_idx]], dim=-2)
        sk = torch.cat([self.stream_keys, key_states[:, self.stream_idx]], dim=-2)
        sv = torch.cat([self.stream_values, value_states[:, self.stream_idx]], dim=-2)
        valid = torch.cat([self.valid, self.valid.new_ones(self.valid.shape[0], q)], dim=-1)
        self.length += q
        B, _, K, D = self.keys.shape
        keys = self.keys.new_zeros(B, self.n_heads, K, D)
        values = self.values.new_zeros(B, self.n_heads, K, D)
        keys[:, self.full_idx], values[:, self.full_idx] = self.keys, self.values
        keys[:, self.stream_idx, K - sk.shape[-2]:], values[:, self.stream_idx, K - sk.shape[-2]:] = sk, sv
        evicted = torch.zeros(B, self.n_heads, K, dtype=torch.bool, device=keys.device)
        evicted[:, self.stream_idx, : K - sk.shape[-2]] = True
        evicted[:, self.stream_idx, K - sk.shape[-2]:] = ~valid[:, None]
        self.module.press_evicted = evicted
        self.stream_keys, self.stream_values, self.valid = self._compact(sk, sv, window_keep(valid, self.sink, self.recent))
        return keys, values

    def get_seq_length(self) -> int:
        return self.length

    @property
    def stream_length(self) -> int:
        return self.stream_keys.shape[-2]


@dataclass
class HeadMixedPress(Press):
    """Streaming heads (lowest gates, ``sparsity`` of all KV heads) keep ``sink`` + ``recent`` entries."""

    gates: Any = None
    sparsity: float = 0.5
    sink: int = 16
    recent: int = 64
    storage: str = "masked"
    source: str = "rlkv"
    seed: int = 0
    head_count: str = "quantile"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.sparsity <= 1.0:
            raise ValueError(f"sparsity={self.sparsity}: the fraction of KV heads made streaming lies in [0, 1]")
        if self.sink < 0 or self.recent < 1:
            raise ValueError(f"an empty window (sink={self.sink}, recent={self.recent}): recent >= 1, sink >= 0")
        if self.storage not in STORAGES:
            raise ValueError(f"storage={self.storage!r}: choose masked or split")
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r}: choose one of {', '.join(SOURCES)}")
        if self.head_count not in HEAD_COUNTS:
            raise ValueError(f"head_count={self.head_count!r}: choose quantile (the release) or round")
        if self.source in ("rlkv", "duo") and self.gates is None:
            raise ValueError(f"head_mixed with source={self.source} needs gates: set model.press.gates to a trained "
                             "run's metrics.json (results.gates) or an L x H_kv list")
        self.streaming: torch.Tensor | None = None

    needs_mask = True

    def allocation(self, n_layers: int, n_heads: int) -> torch.Tensor:
        if self.source == "all_streaming":
            return torch.ones(n_layers, n_heads, dtype=torch.bool)
        if self.source == "random":
            g = torch.rand(n_layers, n_heads, dtype=torch.float32, generator=torch.Generator().manual_seed(self.seed))
        else:
            g = load_gates(self.gates)
            if tuple(g.shape) != (n_layers, n_heads):
                raise ValueError(f"gates of shape {tuple(g.shape)} for a model with {n_layers} layers x {n_heads} KV "
                                 "heads: use gates trained on this backbone")
        return allocate(g, self.sparsity, self.head_count)

    def check(self) -> None:
        """Fail on a missing gates file before the model loads (called by the evaluation module's setup)."""
        if self.source in ("rlkv", "duo"):
            load_gates(self.gates)

    def _streaming(self, module, n_heads: int) -> torch.Tensor:
        if self.streaming is None:
            cfg = module.config
            self.streaming = self.allocation(cfg.num_hidden_layers, n_heads)
        return self.streaming[module.layer_idx]

    def compress(self, module, hidden_states, keys, values, kwargs):
        stream = self._streaming(module, keys.shape[1]).to(keys.device)
        keep = window_keep(visible_keys(kwargs.get("attention_mask"), keys.shape[0], keys.shape[-2], keys.device),
                           self.sink, self.recent)
        module.press_evicted = stream[None, :, None] & ~keep[:, None]
        if self.storage == "split" and stream.any():
            module.press_split = HeadSplitLayer(module, keys, values, stream, keep, self.sink, self.recent)
        return keys, values

    def _hook(self, module, args, kwargs, output):
        output = super()._hook(module, args, kwargs, output)
        split = module.__dict__.pop("press_split", None)
        if split is not None:  # after the base hook has recorded the kept counts
            kwargs.get("cache", kwargs.get("past_key_values")).layers[module.layer_idx] = split
        return output

    def on_decode(self, module, layer, kwargs) -> None:
        if isinstance(layer, HeadSplitLayer) or module.press_evicted is None:
            return  # split: the layer trimmed its buffer itself
        stream = self._streaming(module, layer.keys.shape[1]).to(layer.keys.device)
        B, _, K, _ = layer.keys.shape
        keep = window_keep(visible_keys(kwargs.get("attention_mask"), B, K, layer.keys.device), self.sink, self.recent)
        module.press_evicted = stream[None, :, None] & ~keep[:, None]

    def __call__(self, model):
        self.streaming = None
        return super().__call__(model)

    @staticmethod
    def kv_entries(model, cache) -> list[torch.Tensor]:
        """Entries each KV head holds now (batch row 0), per layer: the buffer size of a split streaming head, the
        unmasked count of a masked one, the cache length of a full head."""
        out = []
        for module, layer in zip(attention_layers(model), cache.layers):
            if isinstance(layer, HeadSplitLayer):
                n = torch.empty(layer.n_heads, dtype=torch.long)
                n[layer.full_idx.cpu()] = layer.keys.shape[-2]
                n[layer.stream_idx.cpu()] = int(layer.valid[0].sum())
            else:
                n = torch.full((layer.keys.shape[1],), layer.keys.shape[-2], dtype=torch.long)
                evicted = getattr(module, "press_evicted", None)
                if evicted is not None:
                    n = n - evicted[0, :, : layer.keys.shape[-2]].sum(-1).cpu()
            out.append(n)
        return out
