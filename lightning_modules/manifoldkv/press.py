"""ManifoldKV (Datta et al., ICML 2026, arXiv 2602.08343): KV eviction by Euclidean distance to the key centroid,
and WindowedManifoldKV. Scorers on the shared press interface (``lightning_modules/common/kv_press.py``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightning_modules.common.kv_press import ScorerPress, unrotate


@dataclass
class ManifoldKV(ScorerPress):
    """s_i = ||k_i - mu||_2, mu the mean of the raw keys per (batch, KV head). ``window_size=None``: one global
    centroid; an int: WindowedManifoldKV, mu per consecutive non-overlapping window of that many tokens (the last
    window may be shorter); the paper uses 4096.
    ``pre_rope``: score the keys before rotary embedding (a variant a reproduction tried); default False = the
    post-RoPE cache keys kvpress hands to every press (the spec's [INF], sources silent).
    ``distance``: l2 (the method) or the paper's ablation distances to the same centroid: l1, linf, cosine
    (-cos(k, mu), i.e. keep the keys least aligned with the raw-key centroid)."""

    window_size: int | None = None
    pre_rope: bool = False
    distance: str = "l2"

    def __post_init__(self):
        super().__post_init__()
        if self.distance not in ("l2", "l1", "linf", "cosine"):
            raise ValueError(f"distance={self.distance!r}: choose l2, l1, linf or cosine")
        if self.window_size is not None and self.window_size <= 0:
            raise ValueError(f"window_size={self.window_size}: use a positive int, or null for the global centroid")

    def _distance(self, k: torch.Tensor) -> torch.Tensor:
        mu = k.mean(dim=-2, keepdim=True)
        if self.distance == "l2":
            return (k - mu).norm(dim=-1)
        if self.distance == "l1":
            return (k - mu).abs().sum(-1)
        if self.distance == "linf":
            return (k - mu).abs().amax(-1)
        return -F.cosine_similarity(k, mu, dim=-1)

    def score(self, module, hidden_states, keys, values, kwargs):
        k = (unrotate(keys, kwargs) if self.pre_rope else keys).float()
        if self.window_size is None or self.window_size >= k.shape[-2]:
            return self._distance(k)
        return torch.cat([self._distance(w) for w in k.split(self.window_size, dim=-2)], dim=-1)


@dataclass
class WindowedManifoldKV(ManifoldKV):
    """WindowedManifoldKV: ManifoldKV with per-window centroids, 4096-token windows by default (the paper's 64K fix)."""

    window_size: int | None = 4096
