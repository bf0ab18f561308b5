"""HiCI attention (Hierarchical Construction–Integration, arXiv 2603.20843), one layer's worth.

Per layer, on the attention input X (B, N, H) cut into S segments of n = N/S tokens:

1. Local construction (``LocalConstructor``): M learned slots (init N(0, 1/H)) cross-attend each segment's
   non-padded tokens through a ``bottleneck_dim``-wide, ``heads``-head attention without positions → L_i ∈ R^{M×H}.
2. Global integration (``GlobalIntegrator``): mean / max / min / std / L2-normalised mean of the slots of the
   non-padded segments → a shared compressor (Linear H→c + LayerNorm) and expander (Linear c→d + LayerNorm) → K
   learned queries attend over the 5 statistics (``integrator_heads``-head MHA in d-space, each of its q/k/v/o
   matrices xavier-initialised on its own) → Linear d→H (init N(0, (0.02/√d)²)) × softplus(θ),
   softplus(θ₀) = ``gate_init`` = 0.1 → G ∈ R^{K×H}.
3. Top-down broadcast (``segment_attention``): each segment's tokens (RoPE'd queries) attend to
   [prefix slots, own non-padded tokens causally]; the prefix goes through the layer's own k_proj/v_proj (+ k_norm)
   without RoPE.

``causal_mode`` (which slots segment i's prefix holds):

- ``none``            [G, L_i], G over all segments — the released code's default. Leaks the future (G sees later
                      segments, L_i sees the whole of segment i).
- ``causal_gi``       [G_i, L_i], G_i from the statistics of L_1..L_i — still leaks inside segment i (G_i, L_i).
- ``causal_gi_gonly`` [G_i] only — leaks inside segment i through G_i, as the release's mode of that name.
- ``causal_shift``    [G_{i-1}, L_{i-1}], G_{i-1} from L_1..L_{i-1}; segment 0 has no prefix. Leak-free.
- ``causal_shift_g``  [G_{i-1}] only; segment 0 has no prefix. Leak-free; the default here (spec's recommendation).

As released: the linear maps of both modules have no bias (``bias``, a switch; LayerNorms keep theirs), and the K
global queries start as the K highest-norm token embeddings passed through the compressor and expander
(``global_query_init: top_norm_tokens``, set by ``GlobalIntegrator.init_queries``; ``xavier`` is the fallback the
release uses without embeddings). Padding: a token mask (from the layer's attention mask) keeps padded tokens out of
the slots and a wholly padded segment out of the statistics; a segment with no valid slot before it sees no G.
Not fixed by the sources [INF]: how G of a causal mode pools (cumulative over the slots of segments 0..i).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_modules.common.block_attention import Layout, Tile, at, attend, check_impl, resolve_impl

CAUSAL_MODES = ("none", "causal_gi", "causal_gi_gonly", "causal_shift", "causal_shift_g")
QUERY_INITS = ("top_norm_tokens", "xavier")
STD_FLOOR = 1e-6  # the release's clamp on the standard deviation


def inverse_softplus(y: float) -> float:
    return math.log(math.expm1(y))


class LocalConstructor(nn.Module):
    """M learned slots cross-attending each segment through a bottleneck: (B, S, n, H) → (B, S, M, H)."""

    def __init__(self, hidden: int, slots: int = 8, bottleneck_dim: int = 512, heads: int = 8, bias: bool = False):
        super().__init__()
        if bottleneck_dim % heads:
            raise ValueError(f"hici.bottleneck_dim={bottleneck_dim} must be divisible by hici.heads={heads}")
        self.heads, self.dh = heads, bottleneck_dim // heads
        self.slots = nn.Parameter(torch.randn(slots, hidden) / math.sqrt(hidden))
        self.wq = nn.Linear(hidden, bottleneck_dim, bias=bias)
        self.wk = nn.Linear(hidden, bottleneck_dim, bias=bias)
        self.wv = nn.Linear(hidden, bottleneck_dim, bias=bias)
        self.wo = nn.Linear(bottleneck_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """``valid`` (B, S, n) bool marks non-padded tokens; a wholly padded segment attends to all its tokens (its
        slots stay finite and are left out downstream)."""
        b, s, n, _ = x.shape
        m = self.slots.shape[0]
        q = self.wq(self.slots.to(x.dtype)).view(m, self.heads, self.dh).transpose(0, 1)  # (h, M, dh)
        k = self.wk(x).view(b, s, n, self.heads, self.dh).transpose(2, 3)  # (B, S, h, n, dh)
        v = self.wv(x).view(b, s, n, self.heads, self.dh).transpose(2, 3)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dh)  # (B, S, h, M, n)
        if valid is not None:
            keep = valid | ~valid.any(-1, keepdim=True)
            scores = scores.masked_fill(~keep[:, :, None, None, :], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(2, 3).reshape(b, s, m, self.heads * self.dh)
        return self.wo(out)


def slot_statistics(slots: torch.Tensor, cumulative: bool, segment_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The 5 statistics over the slot axis, in fp32: mean, max, min, population std (floored at 1e-6) and the
    L2-normalised mean. slots (B, S, M, H) → (B, 5, H) over all S·M slots, or with ``cumulative`` (B, S, 5, H)
    where entry i pools segments 0..i. ``segment_valid`` (B, S) leaves wholly padded segments out (an entry with
    no valid segment is all zeros).

    The variance is two-pass, not E[x²] − E[x]²: each segment's sum of squared deviations from its own mean, plus
    M·(segment mean − pooled mean)² per segment (Chan et al.'s pairwise combination), so an offset far larger than
    the spread does not cancel. The floor is applied to the variance before the square root: sqrt's backward at an
    exact 0 is 0·∞ = NaN, which is what a (near-)constant slot set produced in training.
    """
    x = slots.float()
    b, s, m, h = x.shape
    w = torch.ones(b, s, device=x.device) if segment_valid is None else segment_valid.float()
    count = (w.cumsum(1) * m).unsqueeze(-1)  # (B, S, 1): slots pooled by entry i
    seg_mean = x.mean(2)  # (B, S, H)
    seg_m2 = (x - seg_mean.unsqueeze(2)).pow(2).sum(2)  # (B, S, H)
    mean = (w.unsqueeze(-1) * seg_mean * m).cumsum(1) / count.clamp_min(1)
    upto = torch.ones(s, s, device=x.device).tril()  # upto[i, j] = j <= i
    between = (seg_mean.unsqueeze(1) - mean.unsqueeze(2)).pow(2) * m + seg_m2.unsqueeze(1)  # (B, S_i, S_j, H)
    var = torch.einsum("ij,bj,bijh->bih", upto, w, between) / count.clamp_min(1)
    std = var.clamp_min(STD_FLOOR ** 2).sqrt()
    neg = torch.finfo(x.dtype).min
    mx = torch.where(w.bool().unsqueeze(-1), x.amax(2), neg).cummax(1).values
    mn = torch.where(w.bool().unsqueeze(-1), -x.amin(2), neg).cummax(1).values.neg()
    stats = torch.stack([mean, mx, mn, std, F.normalize(mean, dim=-1)], dim=-2)  # (B, S, 5, H)
    stats = stats * (count > 0).unsqueeze(-1)  # entries with nothing pooled yet: zeros, not ±max
    return stats if cumulative else stats[:, -1]


def is_partitioned(module: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 has partitioned the module's parameters (each rank then holds an empty stand-in)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


class GlobalIntegrator(nn.Module):
    """Multi-view statistics → shared compression → attention-based selection → gated expansion: (B, 5, H) → (B, K, H)."""

    def __init__(self, hidden: int, global_slots: int = 4, compress_dim: int = 128, expand_dim: int = 512,
                 heads: int = 8, gate_init: float = 0.1, bias: bool = False):
        super().__init__()
        self.compress = nn.Sequential(nn.Linear(hidden, compress_dim, bias=bias), nn.LayerNorm(compress_dim))
        self.expand = nn.Sequential(nn.Linear(compress_dim, expand_dim, bias=bias), nn.LayerNorm(expand_dim))
        self.queries = nn.Parameter(torch.empty(global_slots, expand_dim))
        self.select = nn.MultiheadAttention(expand_dim, heads, bias=bias, batch_first=True)
        self.out = nn.Linear(expand_dim, hidden, bias=bias)
        # shape (1,), not a 0-dim scalar: DeepSpeed cannot broadcast 0-dim parameters
        self.gate = nn.Parameter(torch.full((1,), inverse_softplus(gate_init)))
        if not is_partitioned(self):  # built under DeepSpeed ZeRO-3: attach_hici initialises the gathered weights
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.queries)  # until init_queries sees the token embeddings
        for block in self.select.in_proj_weight.chunk(3):  # q, k, v each as its own (d, d) matrix
            nn.init.xavier_uniform_(block)
        nn.init.xavier_uniform_(self.select.out_proj.weight)
        nn.init.normal_(self.out.weight, std=0.02 / math.sqrt(self.out.in_features))
        if self.out.bias is not None:
            nn.init.zeros_(self.out.bias)

    @torch.no_grad()
    def init_queries(self, embeddings: torch.Tensor) -> None:
        """The spec's initialisation: the K highest-norm rows of ``embeddings`` (V, H) through compressor+expander."""
        top = embeddings.float().norm(dim=-1).topk(self.queries.shape[0]).indices
        z = self.expand(self.compress(embeddings[top].to(self.queries.dtype)))
        self.queries.copy_(z)

    def forward(self, stats: torch.Tensor) -> torch.Tensor:
        dtype = self.out.weight.dtype
        z = self.expand(self.compress(stats.to(dtype)))  # (B', 5, d)
        q = self.queries.to(dtype).unsqueeze(0).expand(z.shape[0], -1, -1)
        sel, _ = self.select(q, z, z, need_weights=False)
        return self.out(sel) * F.softplus(self.gate)


def segment_layout(batch: int, n_tok: int, num_segments: int, prefix_len: int = 0, prefix_valid=None,
                   token_valid=None) -> Layout:
    """The top-down broadcast as a ``common.block_attention.Layout`` over the keys [N tokens; S·P prefix slots]
    (segment i's P slots at N + i·P): a query of segment i sees its segment's prefix (if ``prefix_valid``) and,
    causally, its segment's valid tokens and itself. Tiles per segment: the prefix (n × P) and the causal square."""
    s, n, p = num_segments, n_tok // num_segments, prefix_len
    pv = None if prefix_valid is None else prefix_valid.bool().expand(batch, s)
    pv = None if pv is None or bool(pv.all()) else pv
    tv = None if token_valid is None or bool(token_valid.all()) else token_valid.bool()

    def mask_mod(b, h, q, kv):
        seg = q // n
        own = (kv < n_tok) & (kv // n == seg) & (kv <= q)
        if tv is not None:
            own = own & (at(tv, b, kv) | (kv == q))
        if p == 0:
            return own
        pre = (kv >= n_tok) & ((kv - n_tok) // p == seg)
        if pv is not None:
            pre = pre & at(pv, b, seg)
        return own | pre

    tiles = []
    for i in range(s):
        if p:
            tiles.append(Tile(i * n, (i + 1) * n, n_tok + i * p, n_tok + (i + 1) * p, "full" if pv is None else "masked"))
        padded = tv is not None and not bool(tv[:, i * n:(i + 1) * n].all())
        tiles.append(Tile(i * n, (i + 1) * n, i * n, (i + 1) * n, "causal_masked" if padded else "causal"))
    return Layout(mask_mod, tiles, batch, n_tok, n_tok + s * p, ("hici_segments", s, p), (pv, tv))


def segment_attention(q, k, v, prefix_k=None, prefix_v=None, prefix_valid=None, num_segments: int = 1,
                      token_valid=None, attention_impl: str = "auto"):
    """Vectorised top-down broadcast.

    q (B, h, N, D) and k, v (B, kv, N, D) of the tokens; prefix_k/v (B, S, kv, P, D) per segment (or None);
    prefix_valid (S,) or (B, S) bool, whether segment i may see its prefix; token_valid (B, N) bool, the non-padded
    tokens (a padded token still sees itself, so its row stays finite). Each query of segment i attends to segment
    i's prefix and causally to segment i's own valid tokens; nothing else. Returns (B, N, h, D).
    ``attention_impl`` (``common.block_attention``): ``blockwise`` / ``flex`` run ``segment_layout`` without an
    n × (P + n) mask; ``sdpa_dense`` is the dense-mask reference below; ``auto`` = flex on CUDA, else blockwise.
    """
    b, h, n_tok, d = q.shape
    s = num_segments
    if n_tok % s:
        raise ValueError(f"sequence length {n_tok} is not divisible by hici.num_segments={s}: pad or pick data.seq_len "
                         "as a multiple of it")
    n = n_tok // s
    if resolve_impl(attention_impl, q.device) != "sdpa_dense":
        p = 0 if prefix_k is None else prefix_k.shape[-2]
        if p:  # the prefix slots after the tokens: (B, S, kv, P, D) -> (B, kv, S*P, D)
            flat = lambda t: t.permute(0, 2, 1, 3, 4).reshape(b, t.shape[2], s * p, d)  # noqa: E731
            k, v = torch.cat([k, flat(prefix_k)], dim=2), torch.cat([v, flat(prefix_v)], dim=2)
        layout = segment_layout(b, n_tok, s, p, prefix_valid, token_valid)
        return attend(q, k, v, layout, attention_impl).transpose(1, 2)
    rep = h // k.shape[1]
    seg = lambda t: t.view(t.shape[0], t.shape[1], s, n, d).transpose(1, 2)  # (B, S, heads, n, D)
    qs, ks, vs = seg(q), seg(k), seg(v)
    own = torch.ones(n, n, dtype=torch.bool, device=q.device).tril().expand(b, s, n, n)
    if token_valid is not None:
        eye = torch.eye(n, dtype=torch.bool, device=q.device)
        own = own & (token_valid.view(b, s, 1, n) | eye)
    if prefix_k is not None and prefix_k.shape[-2] > 0:
        p = prefix_k.shape[-2]
        ks, vs = torch.cat([prefix_k, ks], dim=-2), torch.cat([prefix_v, vs], dim=-2)
        valid = torch.ones(s, dtype=torch.bool, device=q.device) if prefix_valid is None else prefix_valid
        valid = valid.expand(b, s)
        mask = torch.cat([valid.view(b, s, 1, 1).expand(b, s, n, p), own], dim=-1)  # (B, S, n, P+n)
    else:
        mask = own
    qs = qs.reshape(b * s, h, n, d)
    ks = ks.reshape(b * s, -1, ks.shape[-2], d)
    vs = vs.reshape(b * s, -1, vs.shape[-2], d)
    ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
    mask = mask.reshape(b * s, 1, n, -1)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)  # (B*S, h, n, D)
    return out.view(b, s, h, n, d).permute(0, 2, 1, 3, 4).reshape(b, h, n_tok, d).transpose(1, 2)


def token_validity(attention_mask, n_tok: int):
    """(B, N) bool of the non-padded tokens from the mask transformers hands an attention layer, or None without
    padding: flash attention's 2D padding mask as it is; sdpa's / eager's 4D mask (bool, or additive float with
    0 = attend) by its diagonal — a token always sees itself unless it is padding."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        valid = attention_mask[:, -n_tok:].bool()
    else:
        diag = attention_mask[:, 0, -n_tok:, -n_tok:].diagonal(dim1=-2, dim2=-1)
        valid = diag if diag.dtype == torch.bool else diag == 0
    return None if bool(valid.all()) else valid


class HiCICore:
    """The attention core installed by ``common.attention.patch_attention``: reads ``attn.local_constructor`` and
    ``attn.global_integrator`` (attached to each layer) and runs construction → integration → broadcast."""

    def __init__(self, num_segments: int = 4, causal_mode: str = "causal_shift_g", eval_segments: int | None = None,
                 attention_impl: str = "auto"):
        if causal_mode not in CAUSAL_MODES:
            raise ValueError(f"hici.causal_mode={causal_mode!r}: choose one of {', '.join(CAUSAL_MODES)}")
        self.num_segments, self.causal_mode = num_segments, causal_mode
        self.attention_impl = check_impl(attention_impl)
        self.eval_segments = eval_segments or num_segments  # in eval mode (Option B prefill: 1 = whole sequence)

    def __call__(self, attn, hidden_states, q, k, v, attention_mask=None):
        from lightning_modules.common.attention import project_kv_no_rope

        b, n_tok, hdim = hidden_states.shape
        s = self.num_segments if attn.training else self.eval_segments
        s = s if n_tok >= s else 1
        if n_tok % s:
            raise ValueError(f"sequence length {n_tok} is not divisible by hici.num_segments={s}")
        tok = token_validity(attention_mask, n_tok)
        seg_valid = None if tok is None else tok.view(b, s, -1).any(-1)  # (B, S)
        local, glob = getattr(attn, "local_constructor", None), getattr(attn, "global_integrator", None)
        mode = self.causal_mode
        shift = mode in ("causal_shift", "causal_shift_g")
        parts, valid = [], None
        if local is not None:
            slots = local(hidden_states.view(b, s, n_tok // s, hdim), None if tok is None else tok.view(b, s, -1))
            seen = torch.ones(b, s, dtype=torch.bool, device=q.device) if seg_valid is None else seg_valid.cummax(1).values
            if glob is not None:
                if mode == "none":
                    g = glob(slot_statistics(slots, False, seg_valid)).unsqueeze(1).expand(b, s, -1, -1)
                else:
                    st = slot_statistics(slots, True, seg_valid)  # (B, S, 5, H): entry i pools 0..i
                    g = glob(st.reshape(b * s, 5, hdim)).view(b, s, -1, hdim)
                    if shift:
                        g = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # G_{i-1}
                parts.append(g)
            if mode in ("none", "causal_gi"):
                parts.append(slots)
            elif mode == "causal_shift":
                parts.append(torch.cat([torch.zeros_like(slots[:, :1]), slots[:, :-1]], dim=1))  # L_{i-1}
            # the prefix exists once a valid segment has been pooled: from segment 0 (or 1 when shifted) on
            valid = torch.cat([torch.zeros_like(seen[:, :1]), seen[:, :-1]], dim=1) if shift else seen
        if not parts:
            return segment_attention(q, k, v, num_segments=s, token_valid=tok, attention_impl=self.attention_impl)
        prefix = torch.cat(parts, dim=2).to(hidden_states.dtype)  # (B, S, P, H)
        p = prefix.shape[2]
        pk, pv = project_kv_no_rope(attn, prefix.reshape(b, s * p, hdim))  # (B, kv, S*P, D)
        kv, d = pk.shape[1], pk.shape[-1]
        pk = pk.view(b, kv, s, p, d).transpose(1, 2)
        pv = pv.view(b, kv, s, p, d).transpose(1, 2)
        return segment_attention(q, k, v, pk, pv, valid, num_segments=s, token_valid=tok,
                                 attention_impl=self.attention_impl)


def local_constructor_params(hidden: int, slots: int, bottleneck: int, bias: bool = False) -> int:
    """Analytic parameter count of one LocalConstructor."""
    return slots * hidden + 4 * hidden * bottleneck + bias * (3 * bottleneck + hidden)


def global_integrator_params(hidden: int, global_slots: int, compress: int, expand: int, bias: bool = False) -> int:
    """Analytic parameter count of one GlobalIntegrator (LayerNorms affine, gate one scalar)."""
    weights = hidden * compress + compress * expand + 4 * expand * expand + expand * hidden
    return weights + 2 * compress + 2 * expand + global_slots * expand + 1 + bias * (compress + 5 * expand + hidden)
