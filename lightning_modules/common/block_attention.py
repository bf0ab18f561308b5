"""Attention patterns without N × N masks: one switch, a block-wise engine, FlexAttention, and the generic patterns.

A pattern (which keys each query may see) is a ``Layout``: a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's
signature; it must not depend on ``h``) and ``tiles``, rectangles of (query rows, key columns) that together cover
every allowed pair exactly once, each ``full``, ``causal`` (square; key k0 + j is seen by query q0 + i iff j <= i),
``masked`` (the mask_mod decides) or ``causal_masked`` (the mask_mod decides, and nothing above the diagonal is
allowed). ``attend(q, k, v, layout, impl)`` computes softmax(q kᵀ · scale + mask) v with

- ``blockwise``: one fused attention call per tile (CPU: ``aten._scaled_dot_product_flash_attention_for_cpu``,
  ``is_causal`` for causal tiles; it returns the log-sum-exp), masked tiles cut into chunks of at most ``chunk`` ×
  ``chunk`` (a chunk the mask fills passes unmasked, an empty one is skipped); elsewhere a plain PyTorch softmax per
  chunk, every tile cut. The pieces merge exactly by log-sum-exp. A custom autograd function keeps only q, k, v, the
  output and the log-sum-exp (O(N)); its backward recomputes each chunk (the fused backward given the *merged*
  output and log-sum-exp is exactly that chunk's share of the gradient). The mask_mod is evaluated one chunk at a
  time, so no tensor larger than chunk × chunk (or, for fewer than ``chunk`` queries, queries × keys) is built.
  Runs forward and backward on any device; CPU's default.
- ``flex``: ``torch.nn.attention.flex_attention`` (compiled) with a ``BlockMask`` built once per layout from the same
  mask_mod and cached (every layer of a forward shares it). CUDA's default; its forward runs on CPU (compiled, ~20 s
  to compile), its backward does not (torch refuses it on CPU).
- ``sdpa_dense``: each caller's own dense-mask SDPA code, kept as the reference (patterns here: ``Layout.dense``).
- ``auto``: ``flex`` on CUDA, ``blockwise`` elsewhere.

Patterns here (shared by two or more users): ``causal_layout`` (causal, bottom-right aligned when there are fewer
queries than keys, with key padding and packed documents: the RL core, packed PS-PPO, RLKV's full branch),
``groups_layout`` (causal inside consecutive groups: segment-local attention, S²-Attn's groups),
``rolled_groups_layout`` (LongLoRA's rolled groups) and ``sink_recent_layout`` (StreamingLLM / DuoAttention / RLKV streaming heads, token
or block windows). A paper's own pattern (HiCI's segment + slot prefix) lives in its package on the same ``Layout``.

``use_block_attention(model, impl)`` registers the ``paperlab_block`` transformers attention implementation on a
model: its mask function hands layers the 2-D padding mask (or None, as flash attention's does; ``PACKED`` for packed
rows, whose documents the layer reads from its position ids) instead of a 4-D N × N mask, and its attention function
runs ``causal_layout`` (padding, packed documents) through ``attend``. ``unuse_block_attention(model)`` restores
the model's own implementation.
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

ATTENTION_IMPLS = ("auto", "flex", "blockwise", "sdpa_dense")
KINDS = ("full", "causal", "masked", "causal_masked")
CHUNK = 512                # blockwise: queries and keys per chunk (the fused CPU kernel blocks further inside)
FLEX_BLOCK = 128           # FlexAttention's block size
BLOCK_IMPL = "paperlab_block"
_IMPL_ATTR = "_paperlab_attention_impl"
_PREVIOUS_ATTR = "_paperlab_previous_attn_implementation"


def check_impl(impl: str) -> str:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r}: choose one of {', '.join(ATTENTION_IMPLS)}")
    return impl


def resolve_impl(impl: str, device) -> str:
    """``auto`` → ``flex`` on CUDA, ``blockwise`` elsewhere; any other value as it is (checked)."""
    check_impl(impl)
    if impl == "auto":
        return "flex" if torch.device(device).type == "cuda" else "blockwise"
    return impl


# --- layouts -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tile:
    q0: int
    q1: int
    k0: int
    k1: int
    kind: str = "full"
    b: int | None = None   # one batch row, or every row

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"tile kind {self.kind!r}: one of {KINDS}")
        if self.kind == "causal" and self.q1 - self.q0 != self.k1 - self.k0:
            raise ValueError(f"a causal tile must be square, got {self.q1 - self.q0} x {self.k1 - self.k0}")


@dataclass
class Layout:
    """Which keys each query sees: ``mask_mod`` and the ``tiles`` that cover its allowed pairs once (a list, or a
    function making it: per-row tiles read the mask on the host, so they are made only when the tiled path runs).
    ``params`` and ``tensors`` identify it (the FlexAttention BlockMask cache key)."""
    mask_mod: Callable
    make_tiles: list[Tile] | Callable[[], list[Tile]]
    batch: int
    q_len: int
    kv_len: int
    params: tuple = ()
    tensors: tuple = field(default=(), repr=False)

    @property
    def tiles(self) -> list[Tile]:
        if callable(self.make_tiles):
            self.make_tiles = self.make_tiles()
        return self.make_tiles

    def mask(self, b: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        """The mask_mod on broadcastable index tensors → bool (len(b), 1, len(q), len(kv))."""
        b, q_idx, kv_idx = b.view(-1, 1, 1, 1), q_idx.view(1, 1, -1, 1), kv_idx.view(1, 1, 1, -1)
        zero = torch.zeros((), dtype=torch.long, device=b.device)
        return self.mask_mod(b, zero, q_idx, kv_idx).expand(len(b), 1, q_idx.numel(), kv_idx.numel())

    def dense(self, device=None) -> torch.Tensor:
        """The whole (B, 1, Q, K) bool mask: a reference for tests and for the ``sdpa_dense`` side of benchmarks."""
        ar = lambda n: torch.arange(n, device=device)  # noqa: E731
        return self.mask(ar(self.batch), ar(self.q_len), ar(self.kv_len))

    def key(self) -> tuple:
        def digest(t):
            return hashlib.blake2b(t.detach().cpu().contiguous().numpy().tobytes(), digest_size=16).hexdigest()
        return (self.params, self.batch, self.q_len, self.kv_len) + tuple(
            None if t is None else (tuple(t.shape), str(t.dtype), digest(t)) for t in self.tensors)


def at(t: torch.Tensor, b, i) -> torch.Tensor:
    """``t[b, i]`` with ``i`` clamped into range (mask_mods may be evaluated on padded positions)."""
    return t[b, i.clamp(0, t.shape[-1] - 1)]


def _row_tiles(tiles_for_row: Callable[[int | None], list[Tile]], rows: list[int] | None):
    """A function making every row's tiles (one set for all rows when ``rows`` is None)."""
    return lambda: tiles_for_row(None) if rows is None else [t for b in rows for t in tiles_for_row(b)]


def _ranks(batch: int, kv_len: int, key_valid, documents):
    """(valid, document ids, rank, sees_nothing), each (B, K): a position's rank counts the valid keys of its document
    up to it, minus one (a query's r_q; a valid key's r_k); ``sees_nothing``: no valid key of its document up to it."""
    dev = key_valid.device if key_valid is not None else documents.device if documents is not None else None
    valid = torch.ones(batch, kv_len, dtype=torch.bool, device=dev) if key_valid is None else key_valid.bool()
    docs = torch.zeros(batch, kv_len, dtype=torch.long, device=dev) if documents is None else documents.long()
    counts = valid.long().cumsum(-1)
    start = torch.cat([torch.ones_like(docs[:, :1], dtype=torch.bool), docs[:, 1:] != docs[:, :-1]], -1)
    before = torch.where(start, counts - valid.long(), torch.zeros_like(counts)).cummax(-1).values
    seen = counts - before
    return valid, docs, seen - 1, seen == 0


def causal_layout(batch: int, q_len: int, kv_len: int, key_valid: torch.Tensor | None = None,
                  documents: torch.Tensor | None = None) -> Layout:
    """Causal attention, the queries being the last ``q_len`` keys (decoding: bottom-right aligned), optionally over
    the valid keys only (``key_valid`` (B, K) bool, False = padding) and inside packed documents (``documents``
    (B, K) ids, equal within a document). A query that would see no key (a padding row) sees itself, so no row is
    empty (RLKV's ``allowed_keys`` rule)."""
    off = kv_len - q_len
    if off < 0:
        raise ValueError(f"causal_layout: {q_len} queries but only {kv_len} keys")
    if key_valid is not None and bool(key_valid.all()):
        key_valid = None
    if documents is not None and bool((documents == documents[:, :1]).all()):
        documents = None
    if key_valid is None and documents is None:
        def plain(b, h, q, kv):
            return kv <= q + off
        tiles = [Tile(0, q_len, 0, off, "full")] if off else []
        return Layout(plain, tiles + [Tile(0, q_len, off, kv_len, "causal")], batch, q_len, kv_len, ("causal", off))
    valid, docs, _, sees_nothing = _ranks(batch, kv_len, key_valid, documents)

    def mask_mod(b, h, q, kv):
        p = q + off
        same = at(docs, b, p) == at(docs, b, kv)
        return ((kv <= p) & same & at(valid, b, kv)) | ((kv == p) & at(sees_nothing, b, p))

    def causal_tiles(a, s, e, b):
        """Queries at positions [a, e) seeing every key of [s, their position]."""
        full = [Tile(a - off, e - off, s, a, "full", b)] if a > s else []
        return full + [Tile(a - off, e - off, a, e, "causal", b)]

    def tiles_for_row(b):
        row_docs = docs[0 if b is None else b]
        cuts = [0] + (torch.nonzero(row_docs[1:] != row_docs[:-1]).flatten() + 1).tolist() + [kv_len]
        out = []
        for s, e in zip(cuts[:-1], cuts[1:]):
            a = max(s, off)                    # the first query position in [s, e)
            if a >= e:
                continue
            at_ = torch.nonzero(valid[b, s:e]).flatten() if key_valid is not None else None
            if at_ is None or len(at_) == e - s:
                out += causal_tiles(a, s, e, b)
                continue
            vs, ve = (s + int(at_[0]), s + int(at_[-1]) + 1) if len(at_) else (e, e)
            if len(at_) != ve - vs:            # holes: the mask decides, chunk by chunk
                out.append(Tile(a - off, e - off, s, e, "masked" if a > s else "causal_masked", b))
                continue
            if a < vs:                         # left padding: each sees only itself
                out.append(Tile(a - off, vs - off, a, vs, "causal_masked", b))
            if max(a, vs) < ve:                # the valid run: causal over it
                out += causal_tiles(max(a, vs), vs, ve, b)
            if max(a, ve) < e:                 # right padding: the whole valid run (or itself, if it is empty)
                q0 = max(a, ve)
                out.append(Tile(q0 - off, e - off, vs, ve, "full", b) if ve > vs else
                           Tile(q0 - off, e - off, q0, e, "causal_masked", b))
        return out

    rows = None if documents is None and key_valid is None else list(range(batch))
    return Layout(mask_mod, _row_tiles(tiles_for_row, rows), batch, q_len, kv_len, ("causal", off),
                  (key_valid, documents))


def groups_layout(batch: int, n: int, size: int, shift: int = 0) -> Layout:
    """Causal attention inside groups of ``size`` positions, the group of position i being (i + shift) // size:
    segment-local attention (S groups of N/S) and S²-Attn's groups (shift G/2: [0, G/2), [G/2, 3G/2), ...,
    [N - G/2, N)). Arithmetic only, so FlexAttention compiles it without captured tensors."""
    if size < 1 or not 0 <= shift < size:
        raise ValueError(f"groups_layout: size {size} >= 1 and shift {shift} in [0, size) needed")

    def mask_mod(b, h, q, kv):
        return (kv <= q) & ((q + shift) // size == (kv + shift) // size)

    bounds = [0] + list(range(size - shift, n, size)) + [n]
    tiles = [Tile(b0, b1, b0, b1, "causal") for b0, b1 in zip(bounds[:-1], bounds[1:]) if b1 > b0]
    return Layout(mask_mod, tiles, batch, n, n, ("groups", size, shift))


def rolled_groups_layout(batch: int, n: int, g: int) -> Layout:
    """LongLoRA's released shift: the sequence rolled by -G/2, causal groups of G in rolled order, rolled back.
    Position p has rolled rank r(p) = (p - G/2) mod N; p sees kv iff r(kv) // G == r(p) // G and r(kv) <= r(p). The
    last rolled group wraps: the first G/2 tokens see the last G/2 (the future: LongLoRA's known leak)."""
    h2 = g // 2
    if g < 2 or n % g or g % 2:
        raise ValueError(f"rolled_groups_layout: N={n} must be a multiple of an even group size G={g}")

    def mask_mod(b, h, q, kv):
        rq, rk = (q - h2) % n, (kv - h2) % n
        return (rq // g == rk // g) & (rk <= rq)

    tiles = [Tile(s, s + g, s, s + g, "causal") for s in range(h2, n - h2, g)]
    tiles += [Tile(n - h2, n, n - h2, n, "causal"), Tile(0, h2, n - h2, n, "full"), Tile(0, h2, 0, h2, "causal")]
    return Layout(mask_mod, tiles, batch, n, n, ("rolled", g))


def sink_recent_layout(batch: int, q_len: int, kv_len: int, sink: int, recent: int, window: str = "token",
                       block: int = 128, key_valid: torch.Tensor | None = None,
                       documents: torch.Tensor | None = None, chunk: int = 128) -> Layout:
    """The sink + recent subset of ``causal_layout``'s keys (StreamingLLM; DuoAttention's / RLKV's streaming heads):
    ranks count the keys a query may see (its document's valid keys), so key rank r_k and query rank r_q (its count
    - 1); a key is kept when r_k < sink or r_q - r_k < recent, with ``window='block'`` both ranks in blocks of
    ``block`` and sink, recent in whole blocks (ceil). Tiles: per ``chunk`` queries, the sink keys and the recent band
    (chunk + recent keys wide: 128 measured fastest on CPU at N = 4K against 64, 256, 512)."""
    base = causal_layout(batch, q_len, kv_len, key_valid, documents)
    key_valid, documents = base.tensors or (None, None)
    off = kv_len - q_len
    valid, docs, rank, sees_nothing = _ranks(batch, kv_len, key_valid, documents)
    unit = block if window == "block" else 1
    n_sink, n_recent = math.ceil(sink / unit), math.ceil(recent / unit)

    def mask_mod(b, h, q, kv):
        p = q + off
        r_q, r_k = at(rank, b, p).clamp_min(0) // unit, at(rank, b, kv) // unit
        alone = at(sees_nothing, b, p)  # a row that sees only itself keeps it (ranks 0, 0 in the dense count)
        return base.mask_mod(b, h, q, kv) & ((r_k < n_sink) | (r_q - r_k < n_recent) | alone)

    # key positions by rank: the first key position of rank >= t in each document, found by searchsorted per row
    def tiles_for_row(b):
        r = 0 if b is None else b
        cuts = [0] + (torch.nonzero(docs[r, 1:] != docs[r, :-1]).flatten() + 1).tolist() + [kv_len]
        out = []
        for s, e in zip(cuts[:-1], cuts[1:]):
            a = max(s, off)
            if a >= e:
                continue
            rr = rank[r, s:e].clamp_min(-1)                       # non-decreasing over the document's positions
            first_at = lambda t: s + int(torch.searchsorted(rr, torch.tensor(t, device=rr.device)))  # noqa: E731
            sink_end = min(first_at(n_sink * unit), e)            # keys [s, sink_end) hold every rank < sink
            for q0 in range(a, e, chunk):
                q1 = min(q0 + chunk, e)
                lo_rank = (max(int(rank[r, q0]), 0) // unit - n_recent + 1) * unit
                k0 = max(sink_end, first_at(max(lo_rank, 0)), s)
                if sink_end > s:
                    out.append(Tile(q0 - off, q1 - off, s, min(sink_end, q1), "masked", b))
                if k0 < q1:
                    out.append(Tile(q0 - off, q1 - off, k0, q1, "masked", b))
        return out

    rows = None if documents is None and key_valid is None else list(range(batch))
    return Layout(mask_mod, _row_tiles(tiles_for_row, rows), batch, q_len, kv_len,
                  ("sink_recent", off, sink, recent, window, block), base.tensors)


# --- the block-wise engine -----------------------------------------------------------------------------------------
def _chunks(layout: Layout, chunk: int, split_dense: bool, device):
    """Yield (batch slice, query slice, key slice, causal, bool mask or None) per chunk; ``split_dense``: cut
    full and causal tiles too (the math kernel builds each chunk's scores)."""
    ar = lambda a, b: torch.arange(a, b, device=device)  # noqa: E731
    for t in layout.tiles:
        bs = slice(None) if t.b is None else slice(t.b, t.b + 1)
        rows = ar(0, layout.batch)[bs]
        if t.kind in ("full", "causal") and not split_dense:
            yield bs, slice(t.q0, t.q1), slice(t.k0, t.k1), t.kind == "causal", None
            continue
        for a in range(t.q0, t.q1, chunk):
            qa = min(a + chunk, t.q1)
            for c in range(t.k0, t.k1, chunk):
                kc = min(c + chunk, t.k1)
                qs, ks = slice(a, qa), slice(c, kc)
                if t.kind in ("causal", "causal_masked"):
                    i, j = (a - t.q0) // chunk, (c - t.k0) // chunk
                    if j > i:
                        break
                    if t.kind == "causal":
                        yield bs, qs, ks, j == i, None
                        continue
                if t.kind == "full":
                    yield bs, qs, ks, False, None
                    continue
                m = layout.mask(rows, ar(a, qa), ar(c, kc))
                if not bool(m.any()):
                    continue
                yield bs, qs, ks, False, (None if bool(m.all()) else m)


def _additive(m: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))


def _fused_forward(q, k, v, causal, mask, scale):
    attn_mask = None if mask is None else _additive(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=attn_mask,
                                                                          scale=scale)
    if mask is not None:  # a row that sees nothing here: the kernel returns out 0, lse 0; the merge needs -inf
        lse = lse.masked_fill(~mask.any(-1), float("-inf"))
    return out, lse


def _fused_backward(do, q, k, v, out, lse, causal, mask, scale):
    attn_mask = None if mask is None else _additive(mask, q.dtype)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, out, lse, 0.0, causal, attn_mask=attn_mask, scale=scale)


def _scores(q, k, causal, mask, scale, dtype):
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _math_forward(q, k, v, causal, mask, scale):
    acc = torch.promote_types(q.dtype, torch.float32)
    s = _scores(q, k, causal, mask, scale, acc)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    return torch.matmul(p, v.to(acc)).to(q.dtype), lse


def _math_backward(do, q, k, v, out, lse, causal, mask, scale):
    acc = lse.dtype
    p = torch.exp(_scores(q, k, causal, mask, scale, acc) - lse.unsqueeze(-1))
    do_, v_ = do.to(acc), v.to(acc)
    dv = torch.matmul(p.transpose(-1, -2), do_)
    ds = p * (torch.matmul(do_, v_.transpose(-1, -2)) - (do_ * out.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.to(acc)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    return dq, dk, dv


KERNELS = {"fused": (_fused_forward, _fused_backward), "math": (_math_forward, _math_backward)}


def _kernel_for(device, kernel: str | None) -> str:
    if kernel is None:
        return "fused" if torch.device(device).type == "cpu" else "math"
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: fused (CPU) or math")
    return kernel


class _BlockAttention(torch.autograd.Function):
    """softmax(q kᵀ · scale + layout) v chunk by chunk; saves q, k, v, out, lse; backward recomputes the chunks."""

    @staticmethod
    def forward(ctx, q, k, v, layout, scale, chunk, kernel):
        fwd, _ = KERNELS[kernel]
        acc = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for bs, qs, ks, causal, mask in _chunks(layout, chunk, kernel == "math", q.device):
            o, l_ = fwd(q[bs, :, qs], k[bs, :, ks], v[bs, :, ks], causal, mask, scale)
            l_old = lse[bs, :, qs]
            l_new = torch.logaddexp(l_old, l_)
            safe = torch.where(torch.isinf(l_new), 0.0, l_new)
            out[bs, :, qs] = (out[bs, :, qs] * torch.exp(l_old - safe).unsqueeze(-1)
                              + o.to(acc) * torch.exp(l_ - safe).unsqueeze(-1))
            lse[bs, :, qs] = l_new
        if bool(torch.isinf(lse).any()):
            raise RuntimeError("block attention: a query sees no key (the layout's tiles miss its row)")
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale, ctx.chunk, ctx.kernel = layout, scale, chunk, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        _, bwd = KERNELS[ctx.kernel]
        dout = dout.contiguous()
        acc = lse.dtype
        dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
        for bs, qs, ks, causal, mask in _chunks(ctx.layout, ctx.chunk, ctx.kernel == "math", q.device):
            gq, gk, gv = bwd(dout[bs, :, qs], q[bs, :, qs], k[bs, :, ks], v[bs, :, ks], out[bs, :, qs],
                             lse[bs, :, qs], causal, mask, ctx.scale)
            dq[bs, :, qs] += gq
            dk[bs, :, ks] += gk
            dv[bs, :, ks] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def blockwise_attend(q, k, v, layout: Layout, scale: float | None = None, chunk: int | None = None,
                     kernel: str | None = None) -> torch.Tensor:
    """The block-wise path: q (B, H, Q, D), k/v (B, H_kv, K, D) → (B, H, Q, D). With at most ``chunk`` (default
    ``CHUNK``) queries it is one SDPA call on the (B, 1, Q, K) mask (linear in K: decoding steps, short sequences)."""
    chunk = CHUNK if chunk is None else chunk
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    h, h_kv = q.shape[1], k.shape[1]
    if layout.q_len == layout.kv_len and layout.tiles == [Tile(0, layout.q_len, 0, layout.kv_len, "causal")]:
        # plain causal: SDPA's own kernel
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=h != h_kv)
    if q.shape[2] <= chunk:
        ar = lambda n: torch.arange(n, device=q.device)  # noqa: E731
        mask = layout.mask(ar(layout.batch), ar(layout.q_len), ar(layout.kv_len))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != h_kv)
    if h != h_kv:  # GQA: expand (O(N)); autograd sums the expanded heads' gradients back
        k, v = (t[:, :, None].expand(t.shape[0], h_kv, h // h_kv, *t.shape[2:]).reshape(t.shape[0], h, *t.shape[2:])
                for t in (k, v))
    return _BlockAttention.apply(q, k, v, layout, scale, chunk, _kernel_for(q.device, kernel))


# --- FlexAttention ---------------------------------------------------------------------------------------------------
_BLOCK_MASKS: OrderedDict = OrderedDict()
_COMPILED = {}


def block_mask(layout: Layout, device, compiled: bool = True):
    """The layout's FlexAttention ``BlockMask``, cached by content (every layer of a forward reuses it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (layout.key(), str(device), compiled)
    if key not in _BLOCK_MASKS:
        per_row = any(t is not None for t in layout.tensors)  # else one mask broadcast over the batch
        _BLOCK_MASKS[key] = create_block_mask(layout.mask_mod, layout.batch if per_row else None, None, layout.q_len,
                                              layout.kv_len, device=device, BLOCK_SIZE=FLEX_BLOCK, _compile=compiled)
        while len(_BLOCK_MASKS) > 16:
            _BLOCK_MASKS.popitem(last=False)
    _BLOCK_MASKS.move_to_end(key)
    return _BLOCK_MASKS[key]


def flex_attend(q, k, v, layout: Layout, scale: float | None = None, compiled: bool = True) -> torch.Tensor:
    """FlexAttention with the layout's cached BlockMask; ``compiled=False`` is torch's unfused reference (tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = flex_attention
    if compiled:
        # CUDA: torch.compile's default dynamic=None, so a second length recompiles once with symbolic shapes instead
        # of once per length (RL rollouts vary; past the recompile limit torch would run unfused, N x N scores).
        # CPU: static shapes (torch 2.13's C++ flex template fails to compile with symbolic ones; forward only anyway)
        cpu = q.device.type == "cpu"
        fn = _COMPILED.get(cpu) or _COMPILED.setdefault(cpu, torch.compile(flex_attention,
                                                                          dynamic=False if cpu else None))
    bm = block_mask(layout, q.device, compiled)
    return fn(q, k, v, block_mask=bm, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def attend(q, k, v, layout: Layout, impl: str = "auto", scale: float | None = None, chunk: int | None = None):
    """q (B, H, Q, D), k/v (B, H_kv, K, D) under ``layout`` → (B, H, Q, D), by ``impl`` (``sdpa_dense``: one SDPA
    call on ``layout.dense()``). At most ``chunk`` queries (decoding steps, short rows) take the block-wise path's
    one SDPA call on the (B, 1, Q, K) mask under any impl: linear in K, no compilation, no BlockMask."""
    impl = resolve_impl(impl, q.device)
    if impl == "flex" and q.shape[2] > (CHUNK if chunk is None else chunk):
        return flex_attend(q, k, v, layout, scale)
    if impl == "sdpa_dense":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense(q.device), scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    return blockwise_attend(q, k, v, layout, scale, chunk)


# --- a transformers attention implementation without N × N masks -------------------------------------------------
def packed_documents(position_ids: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor | None:
    """Document ids (B, N) of a packed batch (position ids restarting at 0 inside a row), as transformers finds them
    (``masking_utils.find_packed_sequence_indices``), or None: not packed, or a decoding step."""
    if position_ids is None or q_len != kv_len:
        return None
    from transformers.masking_utils import find_packed_sequence_indices

    return find_packed_sequence_indices(position_ids)


class PackedRows:
    """The mask ``paperlab_block`` hands layers for packed rows (transformers found position ids restarting, with no
    padding mask and no cache, and composed its document mask): the layer reads the documents from its position ids."""

    def __repr__(self):
        return "PACKED"


PACKED = PackedRows()


def block_mask_interface(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                         attention_mask=None, **kwargs):
    """transformers' mask-function contract (``AttentionMaskInterface``) for ``paperlab_block``: the 2-D padding mask
    or None (as flash attention's), ``PACKED`` for packed rows; never a 4-D mask."""
    from transformers.masking_utils import causal_mask_function, flash_attention_mask

    padding = flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask)
    if mask_function is None or mask_function is causal_mask_function:
        return padding
    if padding is None:  # transformers composes the causal mask with a document mask only for packed rows
        return PACKED
    raise ValueError("paperlab_block attention: this model composes a mask beyond causal + padding + packed rows; "
                     "use attention_impl=sdpa_dense")


def layer_documents(attention_mask, position_ids, batch: int):
    """(attention mask, document ids) as a layer under ``paperlab_block`` should use them: ``PACKED`` becomes no mask
    and the documents of its position ids; anything else passes through with no documents."""
    if attention_mask is not PACKED:
        return attention_mask, None
    if position_ids is None:
        raise ValueError("packed rows without position ids: pass position_ids restarting at 0 at each document")
    docs = packed_documents(position_ids, position_ids.shape[-1], position_ids.shape[-1])
    return None, None if docs is None else docs.expand(batch, -1)


def block_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            sliding_window=None, position_ids=None, **kwargs):
    """transformers' attention-function contract (``AttentionInterface``) for ``paperlab_block``: causal attention
    with the 2-D padding mask and packed documents (``PACKED``: from ``position_ids``) through ``attend``."""
    if sliding_window is not None:
        raise ValueError("attention_impl: the block-wise / flex paths have no sliding window; use attention_impl="
                         "sdpa_dense for this backbone")
    if dropout:
        raise ValueError(f"attention dropout {dropout}: the block-wise / flex paths run without dropout")
    b, _, q_len, _ = query.shape
    kv_len = key.shape[-2]
    attention_mask, docs = layer_documents(attention_mask, position_ids, b)
    valid = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError("paperlab_block attention got a 4-D mask: set the model up with use_block_attention")
        valid = attention_mask[:, -kv_len:].bool()
    layout = causal_layout(b, q_len, kv_len, valid, docs)
    out = attend(query, key, value, layout, getattr(module, _IMPL_ATTR, "auto"), scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(BLOCK_IMPL, block_attention_forward)
    AttentionMaskInterface.register(BLOCK_IMPL, block_mask_interface)


def use_block_attention(model, impl: str = "auto"):
    """Run ``model``'s attention through ``paperlab_block`` under ``impl`` (``sdpa_dense``: leave the model as it is).
    Every attention layer gets ``impl`` (patched cores read their own); returns the model."""
    from lightning_modules.common.attention import attention_modules

    if check_impl(impl) == "sdpa_dense":
        return model
    config = model.config
    if not getattr(config, "is_causal", True):
        raise ValueError("use_block_attention: the paperlab_block implementation is causal; this model is not")
    _register()
    if config._attn_implementation != BLOCK_IMPL:
        setattr(config, _PREVIOUS_ATTR, config._attn_implementation)
        config._attn_implementation = BLOCK_IMPL
    for attn in attention_modules(model):
        object.__setattr__(attn, _IMPL_ATTR, impl)
    return model


def unuse_block_attention(model):
    """Back to the implementation ``use_block_attention`` replaced (for export: the config saves no custom name)."""
    config = model.config
    if config._attn_implementation == BLOCK_IMPL:
        config._attn_implementation = getattr(config, _PREVIOUS_ATTR, "sdpa")
    return model
