"""HiCI attention (Hierarchical Construction–Integration, arXiv 2603.20843), one layer's worth.

Per layer, on the attention input X (B, N, H) cut into S segments of n = N/S tokens:

1. Local construction (``LocalConstructor``): M learned slots (init N(0, 1/H)) cross-attend each segment through a
   ``bottleneck_dim``-wide, ``heads``-head attention without positions → L_i ∈ R^{M×H}.
2. Global integration (``GlobalIntegrator``): mean / max / min / std / L2-normalised mean of the slots → a shared
   compressor (Linear H→c + LayerNorm) and expander (Linear c→d + LayerNorm) → K learned queries (xavier) attend over
   the 5 statistics (``integrator_heads``-head MHA in d-space) → Linear d→H (init N(0, (0.02/√d)²)) × softplus(θ),
   softplus(θ₀) = ``gate_init`` = 0.1 → G ∈ R^{K×H}.
3. Top-down broadcast (``segment_attention``): each segment's tokens (RoPE'd queries) attend to
   [prefix slots, own tokens causally]; the prefix goes through the layer's own k_proj/v_proj (+ k_norm) without RoPE.

``causal_mode`` (which slots segment i's prefix holds):

- ``none``          [G, L_i], G over all segments — the released code's default. Leaks the future (G sees later
                    segments, L_i sees the whole of segment i).
- ``causal_gi``     [G_i, L_i], G_i from the statistics of L_1..L_i — still leaks inside segment i through L_i.
- ``causal_shift``  [G_{i-1}, L_{i-1}], G_{i-1} from L_1..L_{i-1}; segment 0 has no prefix. Leak-free.
- ``causal_shift_g`` [G_{i-1}] only; segment 0 has no prefix. Leak-free; the default here (spec's recommendation).

Not fixed by the sources [INF]: biases of the bottleneck projections (nn.Linear defaults, bias on), the global
queries' init (xavier; the recipe's ``use_llama_init False``), how G of a causal mode pools (cumulative over slots).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CAUSAL_MODES = ("none", "causal_gi", "causal_shift", "causal_shift_g")


def inverse_softplus(y: float) -> float:
    return math.log(math.expm1(y))


class LocalConstructor(nn.Module):
    """M learned slots cross-attending each segment through a bottleneck: (B, S, n, H) → (B, S, M, H)."""

    def __init__(self, hidden: int, slots: int = 8, bottleneck_dim: int = 512, heads: int = 8):
        super().__init__()
        if bottleneck_dim % heads:
            raise ValueError(f"hici.bottleneck_dim={bottleneck_dim} must be divisible by hici.heads={heads}")
        self.heads, self.dh = heads, bottleneck_dim // heads
        self.slots = nn.Parameter(torch.randn(slots, hidden) / math.sqrt(hidden))
        self.wq = nn.Linear(hidden, bottleneck_dim)
        self.wk = nn.Linear(hidden, bottleneck_dim)
        self.wv = nn.Linear(hidden, bottleneck_dim)
        self.wo = nn.Linear(bottleneck_dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, n, _ = x.shape
        m = self.slots.shape[0]
        q = self.wq(self.slots.to(x.dtype)).view(m, self.heads, self.dh).transpose(0, 1)  # (h, M, dh)
        k = self.wk(x).view(b, s, n, self.heads, self.dh).transpose(2, 3)  # (B, S, h, n, dh)
        v = self.wv(x).view(b, s, n, self.heads, self.dh).transpose(2, 3)
        att = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dh), dim=-1)  # (B, S, h, M, n)
        out = torch.matmul(att, v).transpose(2, 3).reshape(b, s, m, self.heads * self.dh)
        return self.wo(out)


def slot_statistics(slots: torch.Tensor, cumulative: bool) -> torch.Tensor:
    """The 5 statistics over the slot axis, in fp32. slots (B, S, M, H) →
    (B, 5, H) over all S·M slots, or with ``cumulative`` (B, S, 5, H) where entry i pools segments 0..i."""
    x = slots.float()
    b, s, m, h = x.shape
    if not cumulative:
        flat = x.reshape(b, 1, s * m, h)
    if cumulative:
        count = (torch.arange(1, s + 1, device=x.device, dtype=torch.float32) * m).view(1, s, 1)
        mean = x.sum(2).cumsum(1) / count
        sq = (x * x).sum(2).cumsum(1) / count
        mx = x.amax(2).cummax(1).values
        mn = x.amin(2).cummin(1).values
    else:
        mean, sq = flat.mean(2), (flat * flat).mean(2)
        mx, mn = flat.amax(2), flat.amin(2)
    std = (sq - mean * mean).clamp_min(0).sqrt().clamp_min(1e-6)  # population std
    nmean = F.normalize(mean, dim=-1)
    stats = torch.stack([mean, mx, mn, std, nmean], dim=-2)  # (B, S|1, 5, H)
    return stats if cumulative else stats[:, 0]


class GlobalIntegrator(nn.Module):
    """Multi-view statistics → shared compression → attention-based selection → gated expansion: (B, 5, H) → (B, K, H)."""

    def __init__(self, hidden: int, global_slots: int = 4, compress_dim: int = 128, expand_dim: int = 512,
                 heads: int = 8, gate_init: float = 0.1):
        super().__init__()
        self.compress = nn.Sequential(nn.Linear(hidden, compress_dim), nn.LayerNorm(compress_dim))
        self.expand = nn.Sequential(nn.Linear(compress_dim, expand_dim), nn.LayerNorm(expand_dim))
        self.queries = nn.Parameter(torch.empty(global_slots, expand_dim))
        nn.init.xavier_uniform_(self.queries)
        self.select = nn.MultiheadAttention(expand_dim, heads, batch_first=True)
        nn.init.xavier_uniform_(self.select.out_proj.weight)
        self.out = nn.Linear(expand_dim, hidden)
        nn.init.normal_(self.out.weight, std=0.02 / math.sqrt(expand_dim))
        nn.init.zeros_(self.out.bias)
        # shape (1,), not a 0-dim scalar: DeepSpeed cannot broadcast 0-dim parameters
        self.gate = nn.Parameter(torch.full((1,), inverse_softplus(gate_init)))

    def forward(self, stats: torch.Tensor) -> torch.Tensor:
        dtype = self.out.weight.dtype
        z = self.expand(self.compress(stats.to(dtype)))  # (B', 5, d)
        q = self.queries.to(dtype).unsqueeze(0).expand(z.shape[0], -1, -1)
        sel, _ = self.select(q, z, z, need_weights=False)
        return self.out(sel) * F.softplus(self.gate)


def segment_attention(q, k, v, prefix_k=None, prefix_v=None, prefix_valid=None, num_segments: int = 1):
    """Vectorised top-down broadcast.

    q (B, h, N, D) and k, v (B, kv, N, D) of the tokens; prefix_k/v (B, S, kv, P, D) per segment (or None);
    prefix_valid (S,) bool, whether segment i may see its prefix. Each query of segment i attends to segment i's
    prefix and causally to segment i's own tokens; nothing else. Returns (B, N, h, D).
    """
    b, h, n_tok, d = q.shape
    s = num_segments
    if n_tok % s:
        raise ValueError(f"sequence length {n_tok} is not divisible by hici.num_segments={s}: pad or pick data.seq_len "
                         "as a multiple of it")
    n = n_tok // s
    rep = h // k.shape[1]
    seg = lambda t: t.view(t.shape[0], t.shape[1], s, n, d).transpose(1, 2)  # (B, S, heads, n, D)
    qs, ks, vs = seg(q), seg(k), seg(v)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if prefix_k is not None and prefix_k.shape[-2] > 0:
        p = prefix_k.shape[-2]
        ks, vs = torch.cat([prefix_k, ks], dim=-2), torch.cat([prefix_v, vs], dim=-2)
        valid = torch.ones(s, dtype=torch.bool, device=q.device) if prefix_valid is None else prefix_valid
        mask = torch.cat([valid.view(s, 1, 1).expand(s, n, p), causal.expand(s, n, n)], dim=-1)  # (S, n, P+n)
    else:
        mask = causal.expand(s, n, n)
    qs = qs.reshape(b * s, h, n, d)
    ks = ks.reshape(b * s, -1, ks.shape[-2], d)
    vs = vs.reshape(b * s, -1, vs.shape[-2], d)
    ks, vs = ks.repeat_interleave(rep, dim=1), vs.repeat_interleave(rep, dim=1)
    mask = mask.unsqueeze(0).expand(b, s, n, mask.shape[-1]).reshape(b * s, 1, n, -1)
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)  # (B*S, h, n, D)
    return out.view(b, s, h, n, d).permute(0, 2, 1, 3, 4).reshape(b, h, n_tok, d).transpose(1, 2)


class HiCICore:
    """The attention core installed by ``common.attention.patch_attention``: reads ``attn.local_constructor`` and
    ``attn.global_integrator`` (attached to each layer) and runs construction → integration → broadcast."""

    def __init__(self, num_segments: int = 4, causal_mode: str = "causal_shift_g", eval_segments: int | None = None):
        if causal_mode not in CAUSAL_MODES:
            raise ValueError(f"hici.causal_mode={causal_mode!r}: choose one of {', '.join(CAUSAL_MODES)}")
        self.num_segments, self.causal_mode = num_segments, causal_mode
        self.eval_segments = eval_segments or num_segments  # in eval mode (Option B prefill: 1 = whole sequence)

    def __call__(self, attn, hidden_states, q, k, v, attention_mask=None):
        from lightning_modules.common.attention import project_kv_no_rope

        b, n_tok, hdim = hidden_states.shape
        s = self.num_segments if attn.training else self.eval_segments
        s = s if n_tok >= s else 1
        if n_tok % s:
            raise ValueError(f"sequence length {n_tok} is not divisible by hici.num_segments={s}")
        local, glob = getattr(attn, "local_constructor", None), getattr(attn, "global_integrator", None)
        mode = self.causal_mode
        parts, valid = [], None
        if local is not None:
            slots = local(hidden_states.view(b, s, n_tok // s, hdim))  # (B, S, M, H)
            if glob is not None:
                if mode == "none":
                    g = glob(slot_statistics(slots, cumulative=False)).unsqueeze(1).expand(b, s, -1, -1)
                else:
                    st = slot_statistics(slots, cumulative=True)  # (B, S, 5, H): entry i pools 0..i
                    g = glob(st.reshape(b * s, 5, hdim)).view(b, s, -1, hdim)
                    if mode in ("causal_shift", "causal_shift_g"):
                        g = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # G_{i-1}
                parts.append(g)
            if mode in ("none", "causal_gi"):
                parts.append(slots)
            elif mode == "causal_shift":
                parts.append(torch.cat([torch.zeros_like(slots[:, :1]), slots[:, :-1]], dim=1))  # L_{i-1}
            if mode in ("causal_shift", "causal_shift_g"):
                valid = torch.arange(s, device=q.device) > 0
        if not parts:
            return segment_attention(q, k, v, num_segments=s)
        prefix = torch.cat(parts, dim=2).to(hidden_states.dtype)  # (B, S, P, H)
        p = prefix.shape[2]
        pk, pv = project_kv_no_rope(attn, prefix.reshape(b, s * p, hdim))  # (B, kv, S*P, D)
        kv, d = pk.shape[1], pk.shape[-1]
        pk = pk.view(b, kv, s, p, d).transpose(1, 2)
        pv = pv.view(b, kv, s, p, d).transpose(1, 2)
        return segment_attention(q, k, v, pk, pv, valid, num_segments=s)


def local_constructor_params(hidden: int, slots: int, bottleneck: int) -> int:
    """Analytic parameter count of one LocalConstructor."""
    return slots * hidden + 3 * (hidden * bottleneck + bottleneck) + bottleneck * hidden + hidden


def global_integrator_params(hidden: int, global_slots: int, compress: int, expand: int) -> int:
    """Analytic parameter count of one GlobalIntegrator."""
    return ((hidden * compress + compress) + 2 * compress + (compress * expand + expand) + 2 * expand
            + global_slots * expand + 4 * (expand * expand + expand) + (expand * hidden + hidden) + 1)
