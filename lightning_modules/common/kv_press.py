"""KV-cache presses: the one place in paperlab that reads and rewrites a transformers cache.

The contract is kvpress's (NVIDIA), re-implemented for transformers 5.x (where the cache argument is ``cache``):

- A press is a small dataclass used as a context manager around a model: ``with press(model): model(...)``.
  ``on_decode`` (no-op by default) runs after every later forward on the cache (RLKV's head-wise window).
  It hooks every decoder layer's ``self_attn``; at **prefill only** (the layer's cache was empty before this
  forward and its first position is 0, so a question appended to a compressed cache never counts) it reads the
  post-RoPE cached keys/values (``cache.layers[i].keys``: batch x kv_heads x L x d), calls ``compress`` and
  writes the shortened tensors back. A sliding-window layer whose window is shorter than the context is left as
  is (as kvpress does for Gemma-3). Prefill attention itself sees the full context;
  only later tokens (question, answer) see the compressed cache.
- ``ScorerPress``: ``compression_ratio`` is the fraction of KV pairs *removed* (0 = identity); a subclass
  implements ``score(module, hidden_states, keys, values, kwargs) -> (batch, kv_heads, L)`` (higher = keep) and
  every head keeps its top ``int(L * (1 - compression_ratio))`` tokens, at least one (a compressed cache is never
  empty). Kept tokens are stored in position order
  (kvpress stores them in top-k order; attention is permutation-invariant over cached keys, so this is equivalent).
- Baseline scorers: ``KeyDiff``, ``KNorm``, ``SnapKV``, ``StreamingLLM``, ``Random``. A paper's own scorer lives in
  its package (ManifoldKV: ``lightning_modules/manifoldkv/press.py``).
- Decoding-time token dropping (``DecodingDropPress``: ``H2O``, ``RKV``, RLKV's baselines): evict while generating,
  after each attention (``module.press_update``, called by the masked attention), down to a budget that grows with
  the tokens seen.
- Wrappers take any scorer: ``AdaKV`` (head-adaptive budget inside a layer, evicted positions *masked* through a
  masked attention function, cache length unchanged) and ``Block`` (KeyDiff's block-wise prefill: keep, append
  the next block, rescore).
- A press is chosen by ``_target_`` in ``conf/model/press/*.yaml`` (``model/press=keydiff``) and a wrapper, as a
  partial taking the inner press, in ``conf/model/press_wrapper/*.yaml`` (``model/press_wrapper=adakv``);
  ``press.spec()`` is the press as plain config data again (for results).
- Every press records per layer the kept count per KV head (``press.kept``) so budgets and the retained fraction
  can be logged (``press.summary()``).

``prefill_and_answer`` is the kvpress pipeline: compress the context once, then for each question append it
after compression (positions continue from the *uncompressed* context length), greedy-decode, and restore the
cache to the compressed context before the next question.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

MASKED_ATTENTION = "paperlab_press_masked"


# --- helpers ------------------------------------------------------------------------------------------
def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def n_kept_of(length: int, compression_ratio: float) -> int:
    """Tokens kept per head: ``int(L (1 - ratio))``, at least one (an empty cache would lose the context)."""
    return max(1, int(length * (1 - compression_ratio)))


def attention_layers(model) -> list[torch.nn.Module]:
    """Every attention module that owns a cache layer (``self_attn`` with a ``layer_idx``)."""
    layers = [m for n, m in model.named_modules() if n.endswith("self_attn") and hasattr(m, "layer_idx")]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no '*.self_attn' modules with a layer_idx: presses need a "
                         "transformers decoder (llama, qwen3, mistral, ...)")
    return layers


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.gather(2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


# --- base classes --------------------------------------------------------------------------------------
@dataclass
class Press:
    """Base press: owns the hooks and the cache read/write; subclasses implement ``compress``."""

    def __post_init__(self):
        self.kept: dict[int, torch.Tensor] = {}     # layer -> kept tokens per KV head (batch 0)
        self.lengths: dict[int, int] = {}           # layer -> context length L at compression

    needs_mask = False

    def compress(self, module, hidden_states, keys, values, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def on_decode(self, module, layer, kwargs) -> None:
        """After every later forward on a cache (decoding steps, an appended question): a press that keeps acting
        while decoding (a head-wise constant window) rewrites ``layer`` or ``module.press_evicted`` here. No-op."""

    # -- mechanics
    def _pre_hook(self, module, args, kwargs):
        # a prefill starts a sequence: the layer's cache is empty *and* the first position is 0. A question appended
        # after compression continues the context's positions, so it never counts, even on a cache of one token.
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        positions = kwargs.get("position_ids")
        module.press_prefill = (cache is not None and cache.get_seq_length(module.layer_idx) == 0
                                and (positions is None or bool((positions[..., 0] == 0).all())))
        if cache is None or module.press_prefill:
            module.press_evicted = None  # a new context: forget the previous one's mask

    def _hook(self, module, args, kwargs, output):
        if not getattr(module, "press_prefill", False):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is not None:
                self.on_decode(module, cache.layers[module.layer_idx], kwargs)
            return output
        module.press_prefill = False
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        layer = kwargs.get("cache", kwargs.get("past_key_values")).layers[module.layer_idx]
        if layer.keys.shape[-2] != hidden.shape[1]:
            return output  # a sliding-window layer shorter than the context: left as is (kvpress, Gemma-3)
        keys, values = self.compress(module, hidden, layer.keys, layer.values, kwargs)
        layer.keys, layer.values = keys.contiguous(), values.contiguous()
        if hasattr(layer, "cumulative_length"):  # a sliding-window layer sizes its mask by this count, not keys
            layer.cumulative_length = keys.shape[-2]
        evicted = getattr(module, "press_evicted", None)
        kept = torch.full(keys.shape[:2], keys.shape[-2], device=keys.device)
        if evicted is not None:
            kept = kept - evicted.sum(-1)
        self.kept[module.layer_idx] = kept[0].cpu()
        self.lengths[module.layer_idx] = hidden.shape[1]
        return output

    @contextlib.contextmanager
    def __call__(self, model):
        self.kept, self.lengths = {}, {}
        handles, config, previous = [], getattr(model, "config", None), None
        try:
            for m in attention_layers(model):
                m.press_evicted, m.press_prefill = None, False
                handles.append(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
                handles.append(m.register_forward_hook(self._hook, with_kwargs=True))
            if self.needs_mask:
                _register_masked_attention()
                previous = config._attn_implementation
                config._attn_implementation = MASKED_ATTENTION
            yield self
        finally:
            for h in handles:
                h.remove()
            if previous is not None:
                config._attn_implementation = previous
            for m in attention_layers(model):
                m.press_evicted, m.press_prefill = None, False

    def spec(self) -> dict[str, Any]:
        """The press as plain config data (``_target_`` and every field, an inner press nested): what ran."""
        out = {"_target_": f"{type(self).__module__}.{type(self).__qualname__}"}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.spec() if isinstance(value, Press) else value
        return out

    def summary(self) -> dict[str, Any]:
        """Retained fraction and per-head budgets of the last compression (plain data, for results)."""
        if not self.kept:
            return {"kv_kept_fraction": 1.0, "kept_per_head": {}}
        total = sum(int(k.sum()) for k in self.kept.values())
        full = sum(self.lengths[i] * self.kept[i].numel() for i in self.kept)
        return {"kv_kept_fraction": total / max(1, full),
                "kept_per_head": {i: self.kept[i].tolist() for i in sorted(self.kept)}}


@dataclass
class ScorerPress(Press):
    """Keep each head's top ``int(L (1 - compression_ratio))`` tokens by ``score`` (higher = keep)."""

    compression_ratio: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.compression_ratio < 1.0:
            raise ValueError(f"compression_ratio={self.compression_ratio}: it is the fraction removed, in [0, 1)")

    def score(self, module, hidden_states, keys, values, kwargs) -> torch.Tensor:
        raise NotImplementedError

    def compress(self, module, hidden_states, keys, values, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        n_kept = n_kept_of(keys.shape[-2], self.compression_ratio)
        scores = self.score(module, hidden_states, keys, values, kwargs)
        idx = scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values
        return _gather(keys, idx), _gather(values, idx)


# --- scorers -------------------------------------------------------------------------------------------
def unrotate(keys: torch.Tensor, kwargs) -> torch.Tensor:
    """Undo rotary embedding on cached keys: k = k_rot cos - rotate_half(k_rot) sin (rotation by -theta).
    Uses ``key_position_embeddings`` (per head, set by Block) or the layer's ``position_embeddings``."""
    pe = kwargs.get("key_position_embeddings") or kwargs.get("position_embeddings")
    if pe is None:
        raise ValueError("unrotating keys (pre_rope=True) needs the layer's position_embeddings: a RoPE model")
    cos, sin = pe
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return keys * cos - _rotate_half(keys) * sin


@dataclass
class KeyDiff(ScorerPress):
    """KeyDiff (arXiv 2504.15364): s_i = -cos(k_i, mean_j k_j/||k_j||); evicts keys most similar to the anchor."""

    def score(self, module, hidden_states, keys, values, kwargs):
        k = F.normalize(keys.float(), dim=-1)
        anchor = F.normalize(k.mean(dim=-2, keepdim=True), dim=-1)
        return -(k * anchor).sum(-1)


@dataclass
class KNorm(ScorerPress):
    """Knorm (Devoto et al., 2024): s_i = -||k_i|| (keeps low-norm keys)."""

    def score(self, module, hidden_states, keys, values, kwargs):
        return -keys.float().norm(dim=-1)


@dataclass
class Random(ScorerPress):
    """Uniform random scores (seeded): the floor every method must beat."""

    seed: int = 0

    def score(self, module, hidden_states, keys, values, kwargs):
        g = torch.Generator(device="cpu").manual_seed(self.seed + int(getattr(module, "layer_idx", 0)))
        return torch.rand(keys.shape[:-1], dtype=torch.float32, generator=g).to(keys.device)


@dataclass
class StreamingLLM(ScorerPress):
    """StreamingLLM (Xiao et al., 2024): keep the first ``n_sink`` tokens and the most recent rest of the budget."""

    n_sink: int = 4

    def score(self, module, hidden_states, keys, values, kwargs):
        L = keys.shape[-2]
        n_kept = n_kept_of(L, self.compression_ratio)
        if n_kept < self.n_sink:
            raise ValueError(f"StreamingLLM keeps {n_kept} tokens < n_sink={self.n_sink}: lower compression_ratio or n_sink")
        scores = torch.ones(keys.shape[:-1], dtype=torch.float32, device=keys.device)
        scores[..., self.n_sink: L - (n_kept - self.n_sink)] = 0.0
        return scores


@dataclass
class SnapKV(ScorerPress):
    """SnapKV (Li et al., 2024): attention of the last ``window_size`` queries to each key, averaged over the window,
    avg-pooled over ``kernel_size`` positions and over the query heads of each KV group; the window itself is kept."""

    window_size: int = 64
    kernel_size: int = 5

    def window_queries(self, module, hidden_states, w: int, kwargs) -> torch.Tensor:
        B, head_dim = hidden_states.shape[0], module.head_dim
        q = module.q_proj(hidden_states[:, -w:]).view(B, w, -1, head_dim)
        if hasattr(module, "q_norm"):  # Qwen3
            q = module.q_norm(q)
        q = q.transpose(1, 2)
        cos, sin = kwargs["position_embeddings"]
        cos, sin = cos[:, -w:].unsqueeze(1), sin[:, -w:].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin

    def score(self, module, hidden_states, keys, values, kwargs):
        B, H, L, d = keys.shape
        w = min(self.window_size, L - 1, hidden_states.shape[1])
        if w <= 0:
            return torch.ones(B, H, L, dtype=torch.float32, device=keys.device)
        q = self.window_queries(module, hidden_states, w, kwargs).float()
        n_rep = q.shape[1] // H
        k = repeat_kv(keys.float(), n_rep)
        logits = q @ k.transpose(-1, -2) * getattr(module, "scaling", d ** -0.5)  # B, Hq, w, L
        future = torch.arange(L, device=keys.device)[None, :] > torch.arange(L - w, L, device=keys.device)[:, None]
        attn = logits.masked_fill(future, float("-inf")).softmax(-1)[..., : L - w].mean(dim=-2)
        attn = F.avg_pool1d(attn.flatten(0, 1), self.kernel_size, padding=self.kernel_size // 2, stride=1).view(B, -1, L - w)
        scores = attn.view(B, H, n_rep, L - w).mean(2)
        # the window scores strictly above every prefix score, so no prefix token can tie with it and displace it;
        # rising with position, so a budget below the window keeps its most recent tokens
        window = scores.amax() + 1 + torch.arange(w, device=keys.device, dtype=scores.dtype)
        return torch.cat([scores, window.expand(B, H, w)], dim=-1)


# --- wrappers ------------------------------------------------------------------------------------------
@dataclass
class Wrapper(Press):
    """A press that wraps a scorer press and changes how its scores become evictions."""

    press: ScorerPress = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.press, ScorerPress):
            raise ValueError(f"{type(self).__name__} wraps a scorer press (a ScorerPress such as KeyDiff or ManifoldKV), "
                             f"got {type(self.press).__name__}: set model/press=<scorer>")

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio


@dataclass
class AdaKV(Wrapper):
    """Ada-KV (Feng et al., 2024) head-adaptive budget: each head first keeps its top ``int(n_kept * alpha_safeguard)``
    (at least 1), then the layer's remaining budget goes to the highest scores over all heads. Total kept per layer =
    kv_heads * n_kept; evicted positions are masked in attention (cache length unchanged), as in kvpress."""

    alpha_safeguard: float = 0.20
    needs_mask = True

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.alpha_safeguard <= 1.0:
            raise ValueError(f"alpha_safeguard={self.alpha_safeguard}: it is the fraction of n_kept each head keeps "
                             "for sure, in [0, 1]")

    def compress(self, module, hidden_states, keys, values, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        B, H, L, _ = keys.shape
        n_kept = n_kept_of(L, self.compression_ratio)
        scores = self.press.score(module, hidden_states, keys, values, kwargs).float()
        n_safe = max(1, int(n_kept * self.alpha_safeguard))  # no head loses every token
        safe = scores.topk(n_safe, dim=-1).indices
        scores = scores.scatter(-1, safe, torch.finfo(scores.dtype).max)
        pruned = scores.reshape(B, H * L).topk(H * (L - n_kept), dim=-1, largest=False).indices
        evicted = torch.zeros(B, H * L, dtype=torch.bool, device=keys.device).scatter_(1, pruned, True)
        module.press_evicted = evicted.view(B, H, L)
        return keys, values


@dataclass
class Block(Wrapper):
    """Block-wise prefill (the KeyDiff paper's setting; kvpress ``BlockPress``): walk the context in blocks of
    ``block_size``; score [kept tokens + next block] with the inner scorer and keep the top ``n_kept`` each time."""

    block_size: int = 128

    def compress(self, module, hidden_states, keys, values, kwargs):
        if self.compression_ratio == 0:
            return keys, values
        B, H, L, _ = keys.shape
        n_kept = n_kept_of(L, self.compression_ratio)
        kept = torch.empty(B, H, 0, dtype=torch.long, device=keys.device)
        cos, sin = kwargs.get("position_embeddings", (None, None))
        for start in range(0, L, self.block_size):
            end = min(start + self.block_size, L)
            block = torch.arange(start, end, device=keys.device).expand(B, H, -1)
            idx = torch.cat([kept, block], dim=-1)
            sub_kwargs = dict(kwargs)
            if cos is not None:  # the block's own (queries, SnapKV) and every scored key's (pre-RoPE ManifoldKV)
                sub_kwargs["position_embeddings"] = (cos[:, start:end], sin[:, start:end])
                sub_kwargs["key_position_embeddings"] = tuple(
                    _gather(t.unsqueeze(1).expand(B, H, -1, -1), idx) for t in (cos, sin))
            scores = self.press.score(module, hidden_states[:, start:end], _gather(keys, idx), _gather(values, idx), sub_kwargs)
            top = scores.topk(min(n_kept, idx.shape[-1]), dim=-1).indices
            kept = idx.gather(-1, top).sort(dim=-1).values
        return _gather(keys, kept), _gather(values, kept)


# --- decoding-time token dropping (RLKV's baselines) ----------------------------------------------------------------
QUERY_CHUNK = 256  # H2O scores a prefill's queries this many at a time: (chunk x K) logits, never (n x K)


def _as_allowed(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask == 0  # additive masks: 0 where allowed


def _visibility(attention_mask, n: int, K: int, B: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, n) which of this forward's queries are real (they see themselves: not padding) and (B, K) which cached
    entries its last query sees, read from the padding mask's diagonal and last row: the causal (n x K) mask is never
    built (its last row is all ones and its diagonal allowed)."""
    if attention_mask is None:
        return (torch.ones(B, n, dtype=torch.bool, device=device), torch.ones(B, K, dtype=torch.bool, device=device))
    rows = attention_mask[:, 0, -n:, -K:]
    return _as_allowed(rows.diagonal(K - n, dim1=-2, dim2=-1)), _as_allowed(rows[:, -1])


def attention_received(module, query, key, attention_mask, evicted, real_q) -> torch.Tensor:
    """(B, kv_heads, K): the softmax attention each cached entry receives from this forward's real queries, summed
    over them and over the query heads of its KV group (causal, padding and evicted entries hidden). Queries go
    ``QUERY_CHUNK`` at a time, so a prefill of n tokens holds (chunk x K) scores, not (n x K)."""
    B, Hq, n, _ = query.shape
    H, K = key.shape[1], key.shape[-2]
    keys_t = repeat_kv(key.float(), Hq // H).transpose(-1, -2)
    hidden = repeat_kv(evicted, Hq // H)[:, :, None]
    columns = torch.arange(K, device=key.device)
    total = key.new_zeros(B, Hq, K, dtype=torch.float32)
    for start in range(0, n, QUERY_CHUNK):
        end = min(n, start + QUERY_CHUNK)
        rows = torch.arange(K - n + start, K - n + end, device=key.device)
        see = (columns[None, :] <= rows[:, None])[None, None] & ~hidden  # causal, not evicted
        if attention_mask is not None:
            see = see & _as_allowed(attention_mask[:, :, -n:, -K:][:, :, start:end])
        logits = (query[:, :, start:end].float() @ keys_t) * getattr(module, "scaling", 1.0)
        probs = logits.masked_fill(~see, float("-inf")).softmax(-1).nan_to_num(0.0)
        total += (probs * real_q[:, None, start:end, None]).sum(2)
    return total.view(B, H, Hq // H, K).sum(2)


@dataclass
class DecodingDropPress(Press):
    """A press that drops tokens while decoding, through the masked attention: before every attention it scores the
    cache and evicts (for the next forward) down to a budget that grows with the tokens seen,
    ``int(seen · (1 − sparsity)) + window`` per
    row (the RLKV release's ``BaseSampler``; ``window`` = the head-wise press's sink + recent, so the baselines keep
    as many entries as RLKV at the same s). Evicted entries stay in the cache but are masked (same logits as a cropped
    cache)."""

    sparsity: float = 0.5
    window: int = 80
    needs_mask = True

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.sparsity < 1.0 or self.window < 1:
            raise ValueError(f"sparsity={self.sparsity}, window={self.window}: sparsity in [0, 1) (budget ratio "
                             "1 - sparsity), window >= 1")

    @property
    def budget_ratio(self) -> float:
        return round(1.0 - self.sparsity, 5)

    def budget(self, seen: torch.Tensor) -> torch.Tensor:
        return (seen.double() * self.budget_ratio).long() + self.window

    def compress(self, module, hidden_states, keys, values, kwargs):
        return keys, values  # evicted in the attention itself

    def _pre_hook(self, module, args, kwargs):
        super()._pre_hook(module, args, kwargs)
        if getattr(module, "press_prefill", False) or kwargs.get("cache", kwargs.get("past_key_values")) is None:
            module.press_state = None  # a new sequence

    def update(self, module, query, key, attention_mask) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def __call__(self, model):
        layers = attention_layers(model)
        for m in layers:
            m.press_update, m.press_state = self.update, None
        try:
            with super().__call__(model) as press:
                yield press
        finally:
            for m in layers:
                m.press_update, m.press_state = None, None


@dataclass
class H2O(DecodingDropPress):
    """H2O (Zhang et al., 2023) as RLKV's release runs it (``base/h2o_kv_cache.py``): every forward adds the attention
    each cached entry receives (summed over the new queries and the query heads of its KV group) to its score; once a
    row holds more than the budget, each head keeps its int(budget/2) most recent entries and the int(budget/2)
    highest-scored others (ties: the earlier entry)."""

    def update(self, module, query, key, attention_mask) -> None:
        B, Hq, n, _ = query.shape
        H, K = key.shape[1], key.shape[-2]
        state = module.press_state or {"score": key.new_zeros(B, H, 0, dtype=torch.float32),
                                       "seen": torch.zeros(B, dtype=torch.long, device=key.device)}
        evicted = F.pad(module.press_evicted, (0, K - module.press_evicted.shape[-1])) \
            if module.press_evicted is not None else torch.zeros(B, H, K, dtype=torch.bool, device=key.device)
        real_q, last_row = _visibility(attention_mask, n, K, B, key.device)
        score = (F.pad(state["score"], (0, K - state["score"].shape[-1]))
                 + attention_received(module, query, key, attention_mask, evicted, real_q))
        seen = state["seen"] + real_q.sum(-1)
        budget = self.budget(seen)
        half = budget // 2
        visible = last_row[:, None].expand(-1, H, -1) & ~evicted
        from_end = visible.flip(-1).long().cumsum(-1).flip(-1)  # 1 = the latest visible entry
        recent = visible & (from_end <= half[:, None, None])
        candidates = visible & ~recent
        ranked = score.masked_fill(~candidates, float("-inf"))
        order = torch.argsort(-ranked, dim=-1, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(K, device=key.device).expand_as(order))
        keep = recent | (candidates & (rank < half[:, None, None]))
        over = visible.sum(-1) > budget[:, None]
        module.press_evicted = evicted | (over[..., None] & visible & ~keep)
        module.press_state = {"score": score, "seen": seen}


@dataclass
class RKV(DecodingDropPress):
    """R-KV (Cai et al., 2025) as RLKV's release runs it (``base/h2o_kv_cache.py`` ``RKV``): the last ``obs_window``
    (8) queries are cached; once a row holds more than its budget (window shrunk to ``window`` −
    G·``obs_window``/2 for that query cache, G the query heads per KV head), the latest ``fixed_size`` (512) entries
    but the last ``obs_window`` are scored by ``mix_lambda`` (0.1) · importance − (1 − ``mix_lambda``) · redundancy
    and ``buffer`` (128) of them are evicted; entries older than the window stay. Importance: the cached queries'
    softmax attention over those entries, mean over queries, max over the group's heads, max-pooled over ``kernel``
    (7) neighbours. Redundancy: each entry's mean cosine similarity to the window's keys (self excluded, and each
    key's last > 0.5-similar partner ignored), softmax over the window. While a row holds <= ``fixed_size`` entries
    nothing is evicted (as released)."""

    obs_window: int = 8
    fixed_size: int = 512
    buffer: int = 128
    kernel: int = 7
    mix_lambda: float = 0.1

    def update(self, module, query, key, attention_mask) -> None:
        B, Hq, n, d = query.shape
        H, K = key.shape[1], key.shape[-2]
        G = Hq // H
        window = int(self.window - G * self.obs_window / 2)
        if window <= 0:
            raise ValueError(f"R-KV: window {self.window} - {G} query heads per KV head x obs_window {self.obs_window}"
                             " / 2 <= 0: raise model.press.window")
        state = module.press_state or {"queries": query.new_zeros(B, Hq, 0, d),
                                       "seen": torch.zeros(B, dtype=torch.long, device=key.device)}
        evicted = F.pad(module.press_evicted, (0, K - module.press_evicted.shape[-1])) \
            if module.press_evicted is not None else torch.zeros(B, H, K, dtype=torch.bool, device=key.device)
        real_q, last_row = _visibility(attention_mask, n, K, B, key.device)
        queries = torch.cat([state["queries"], query], 2)[:, :, -self.obs_window:]
        seen = state["seen"] + real_q.sum(-1)
        budget = (seen.double() * self.budget_ratio).long() + window  # the query cache's share taken off the window
        visible = last_row[:, None].expand(-1, H, -1) & ~evicted
        for b in range(B):
            count = int(visible[b, 0].sum())
            if count <= int(budget[b]) or count <= self.fixed_size:
                continue
            idx = torch.stack([visible[b, h].nonzero().flatten()[-self.fixed_size:] for h in range(H)])  # (H, W)
            k = key[b].float().gather(1, idx[..., None].expand(-1, -1, d))
            past = self.fixed_size - self.obs_window
            logits = queries[b].float() @ repeat_kv(k[None], G)[0].transpose(-1, -2) * getattr(module, "scaling", 1.0)
            attn = logits[..., :past].softmax(-1).mean(1).view(H, G, past).amax(1)
            attn = F.max_pool1d(attn[None], self.kernel, padding=self.kernel // 2, stride=1)[0]
            score = self.mix_lambda * attn - (1 - self.mix_lambda) * self.redundancy(k)[:, :past]
            drop = score.topk(past - (self.fixed_size - self.buffer - self.obs_window), -1, largest=False).indices
            evicted[b].scatter_(1, idx.gather(1, drop), True)
        module.press_evicted = evicted
        module.press_state = {"queries": queries, "seen": seen}

    @staticmethod
    def redundancy(keys: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
        """(H, W) keys -> (H, W): softmax over the window of each key's mean cosine similarity to the others, with
        each key's last partner above ``threshold`` (index 0 if none, as released) zeroed first."""
        kn = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
        sim = kn @ kn.transpose(-1, -2)
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        W = sim.shape[-1]
        last = torch.where(sim > threshold, torch.arange(W, device=sim.device), 0).amax(-1)
        sim.scatter_(-1, last[..., None], 0.0)
        return sim.mean(1).softmax(-1)


# --- masked attention (AdaKV) --------------------------------------------------------------------------
def masked_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention that also hides the positions a press evicted (``module.press_evicted``: batch x kv_heads x L_ctx).
    A press that evicts while decoding (H2O, R-KV) sets ``module.press_update``: it runs after the attention, on this
    forward's post-RoPE queries and the whole cache, and evicts for the next forward (the released samplers attend
    over the previous step's cropped cache plus the new token, then crop). No (n x n) mask is built: a prefill evicts
    nothing yet and runs plain SDPA (its H2O scores go ``QUERY_CHUNK`` queries at a time); with evictions the mask is
    (q x K) for the q new tokens of this forward (one while decoding, a question's length after compression)."""
    out = _masked_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    update = getattr(module, "press_update", None)
    if update is not None:
        update(module, query, key, attention_mask)
    return out


def _masked_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    evicted = getattr(module, "press_evicted", None)
    if evicted is None:  # nothing evicted in this layer yet (e.g. during prefill): plain sdpa
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    B, Hq, q_len, _ = query.shape
    K = key.shape[-2]
    n_rep = Hq // key.shape[1]
    allowed = torch.ones(q_len, K, dtype=torch.bool, device=query.device).tril(K - q_len)[None, None]
    if attention_mask is not None:
        am = attention_mask[..., -K:]
        allowed = allowed & _as_allowed(am)
    ev = F.pad(evicted, (0, K - evicted.shape[-1]))
    allowed = allowed & ~repeat_kv(ev, n_rep)[:, :, None, :]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scaling,
                                         enable_gqa=n_rep > 1)
    return out.transpose(1, 2).contiguous(), None


def _register_masked_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(MASKED_ATTENTION, masked_attention)
    AttentionMaskInterface.register(MASKED_ATTENTION, sdpa_mask)


# --- the pipeline: compress the context once, answer several questions -----------------------------------
def cache_state(cache) -> list[tuple]:
    """Each layer's (keys, values, seen-token count): enough to put the compressed context back after a question.
    Restoring a saved state (not cropping to a length) also serves sliding-window layers, which drop old tokens."""
    return [(layer.keys, layer.values, getattr(layer, "cumulative_length", None)) for layer in cache.layers]


def restore_cache(cache, state: list[tuple]) -> None:
    for layer, (keys, values, seen) in zip(cache.layers, state):
        layer.keys, layer.values = keys, values
        if seen is not None:
            layer.cumulative_length = seen


@dataclass
class PressOutput:
    answers: list[list[int]]
    answer_nll: list[float | None]
    prefill_s: float
    decode_s: float
    summary: dict = field(default_factory=dict)


@torch.no_grad()
def prefill_and_answer(model, press: Press | None, context_ids: torch.Tensor, questions: list[torch.Tensor],
                       max_new_tokens: int = 16, eos_token_id: int | None = None,
                       gold: list[torch.Tensor | None] | None = None) -> PressOutput:
    """Prefill ``context_ids`` (1 x L) under ``press``; for each question (1-D ids) append it after compression with
    positions L, L+1, ... and greedy-decode; ``gold`` answers (1-D ids) also get a teacher-forced NLL per token."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    context_ids = context_ids.to(device).view(1, -1)
    L = context_ids.shape[1]
    cache = DynamicCache(config=model.config)
    ctx = press(model) if press is not None else contextlib.nullcontext()
    with ctx:
        t0 = time.perf_counter()
        model(input_ids=context_ids, cache=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        summary = press.summary() if press is not None else {"kv_kept_fraction": 1.0, "kept_per_head": {}}
        context_state = cache_state(cache)
        answers, nlls, decode_s = [], [], 0.0
        for qi, question in enumerate(questions):
            t0 = time.perf_counter()
            ids = question.to(device).view(1, -1)
            pos = L
            out_tokens = []
            for _ in range(max_new_tokens):
                positions = torch.arange(pos, pos + ids.shape[1], device=device)[None]
                logits = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                               logits_to_keep=1).logits[:, -1]
                pos += ids.shape[1]
                tok = int(logits.argmax(-1))
                if eos_token_id is not None and tok == eos_token_id:
                    break
                out_tokens.append(tok)
                ids = torch.tensor([[tok]], device=device)
            restore_cache(cache, context_state)
            decode_s += time.perf_counter() - t0
            answers.append(out_tokens)
            g = gold[qi] if gold is not None else None
            if g is None or g.numel() == 0:
                nlls.append(None)
                continue
            full = torch.cat([question.to(device).view(-1), g.to(device).view(-1)])[None]
            positions = torch.arange(L, L + full.shape[1], device=device)[None]
            logits = model(input_ids=full, position_ids=positions, cache=cache, use_cache=True).logits[0].float()
            restore_cache(cache, context_state)
            n_q = question.numel()
            logp = logits[n_q - 1: -1].log_softmax(-1)
            nlls.append(float(-logp.gather(-1, g.to(device).view(-1, 1)).mean()))
    return PressOutput(answers, nlls, prefill_s, decode_s, summary)
