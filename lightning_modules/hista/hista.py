"""Hista: state values from the policy's own hidden states, by k-nearest prefixes in the group (spec 3.3).

Per rollout, over its unpadded prompt + response last-layer states h_t:

1. :func:`ema_smooth` — e_0 = h_0 (``ema_init=h0``, as released; ``zero``: e_{-1} = 0), e_t = α e_{t−1} + (1−α) h_t,
   output e_t / (1 − α^{t+1}). With ``h0`` the correction over-scales early tokens (constant 1, α = 0.7: 3.333,
   1.961, 1.522, …); kept for faithfulness.
2. keep every ``mean_window``-th smoothed vector: E = (ẽ_0, ẽ_w, ẽ_2w, …).
3. :func:`state_positions` — states every ``min_interval`` tokens plus the last token; the prefix of a state at token
   index p is E[: p // w + 1]. ``state_grid``: ``prompt`` (default, the release's ``steps_selection``: the grid runs
   from the prompt's first token, so the first response segment is min_interval − (L_p mod min_interval) tokens)
   or ``response`` (from the response start, as the spec reads 3.3; on a recipe-like batch 92% of the tokens' advantages
   differ between the two).
4. Library: every (rollout of the group, state) with that rollout's return. :func:`prefix_distances` — mean
   nearest-neighbour distance from the longer prefix into the shorter; a same-rollout node longer than the online
   prefix is ∞ (future leakage). One cdist per pair of rollouts, cummin/cumsum give every prefix pair at once.
5. :func:`hista_values` — intermediate state j (0-based, of M) averages the k_j = max_k − ⌊(max_k − min_k)/M⌋·j
   nearest nodes with weights 1/max(D, d_min)^t (:func:`knn_value`: ties under d_min broken deterministically). Values [group mean, V_1 … V_{m−1}, R], then GAE over the segments
   between states. ``zero_last_token`` (default, the release's ``calculate_GAE_advantages``: its segments end at the
   last token's index, which so belongs to none) gives the last response token (usually EOS) advantage 0; off, it
   gets R − V like the rest of its segment (the spec's reading).

Recipe values (used by the configs): α 0.7, mean_window 5, min_interval 50, d_min 5, t 1, max_k 66, min_k 6, λ 1.
The released dataclass defaults differ (α 0.97, mean_window 150, d_min 3); the recipes override them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_modules.common.rl.advantages import segment_gae

EMA_INITS = ("h0", "zero")


def ema_smooth(h: torch.Tensor, alpha: float, init: str = "h0") -> torch.Tensor:
    """Bias-corrected EMA over dim −2 of (…, L, H) (all rows share L: pass unpadded or left-aligned states)."""
    if init not in EMA_INITS:
        raise ValueError(f"model.ema_init={init!r}: choose one of {', '.join(EMA_INITS)}")
    h = h.float()
    out = torch.empty_like(h)
    e = h[..., 0, :] if init == "h0" else (1 - alpha) * h[..., 0, :]
    out[..., 0, :] = e / (1 - alpha)
    for t in range(1, h.shape[-2]):
        e = alpha * e + (1 - alpha) * h[..., t, :]
        out[..., t, :] = e / (1 - alpha ** (t + 1))
    return out


STATE_GRIDS = ("prompt", "response")


def state_positions(prompt_len: int, length: int, min_interval: int, grid: str = "prompt") -> list[int]:
    """Token indices (in the unpadded prompt + response) of states p_0 … p_m: the response start, the grid points
    after it, and the last token. ``grid``: ``prompt`` — multiples of ``min_interval`` counted from the prompt's first
    token (the release); ``response`` — every ``min_interval`` tokens from the response start."""
    if grid not in STATE_GRIDS:
        raise ValueError(f"model.state_grid={grid!r}: choose prompt (the release) or response")
    last = prompt_len + length - 1
    if grid == "response":
        return (list(range(prompt_len, last, min_interval)) or [prompt_len]) + [last]
    points = [g for g in range(0, last, min_interval) if g > prompt_len - min_interval]  # the first is <= prompt_len
    return [prompt_len] + points[1:] + [last]


def prefix_distances(online: torch.Tensor, library: torch.Tensor) -> torch.Tensor:
    """D[a−1, b−1] for every online prefix length a and library prefix length b (rows of E, (A, H) and (B, H)):
    (1/a) Σ_{u<a} min_{v<b} d(u, v) when a ≥ b, else (1/b) Σ_{v<b} min_{u<a} d(u, v)."""
    C = torch.cdist(online.float().unsqueeze(0), library.float().unsqueeze(0)).squeeze(0)  # (A, B)
    a = torch.arange(1, C.shape[0] + 1, device=C.device, dtype=C.dtype).view(-1, 1)
    b = torch.arange(1, C.shape[1] + 1, device=C.device, dtype=C.dtype).view(1, -1)
    from_online = C.cummin(dim=1).values.cumsum(dim=0) / a   # rows u<a, each to its nearest v<b
    from_library = C.cummin(dim=0).values.cumsum(dim=1) / b  # columns v<b, each to its nearest u<a
    return torch.where(a >= b, from_online, from_library)


def k_schedule(M: int, max_k: int = 66, min_k: int = 6) -> list[int]:
    """k at the j-th of M intermediate states: max_k − ⌊(max_k − min_k)/M⌋ · j (early states average more)."""
    step = (max_k - min_k) // M if M else 0
    return [max_k - step * j for j in range(M)]


@dataclass
class HistaConfig:
    alpha: float = 0.7
    mean_window: int = 5
    min_interval: int = 50
    d_min: float | str = 5.0   # or "median": each online rollout's median finite prefix distance (tiny scale)
    power: float = 1.0
    max_k: int = 66
    min_k: int = 6
    lam: float = 1.0
    ema_init: str = "h0"
    state_grid: str = "prompt"
    zero_last_token: bool = True

    def __post_init__(self):
        if self.state_grid not in STATE_GRIDS:
            raise ValueError(f"model.state_grid={self.state_grid!r}: choose prompt (the release) or response")
        if self.ema_init not in EMA_INITS:
            raise ValueError(f"model.ema_init={self.ema_init!r}: choose one of {', '.join(EMA_INITS)}")
        if isinstance(self.d_min, str) and self.d_min != "median":
            raise ValueError(f"model.d_min={self.d_min!r}: a number or 'median'")
        if self.mean_window < 1 or self.min_interval < 1:
            raise ValueError("model.mean_window and model.min_interval must be >= 1")


def representations(states: list[torch.Tensor], cfg: HistaConfig) -> list[torch.Tensor]:
    """Smoothed, down-sampled E per rollout from its unpadded (L_i, H) states (rows left-aligned for one EMA)."""
    L = max(s.shape[0] for s in states)
    x = states[0].new_zeros((len(states), L, states[0].shape[-1]), dtype=torch.float32)
    for i, s in enumerate(states):
        x[i, :s.shape[0]] = s.float()
    sm = ema_smooth(x, cfg.alpha, cfg.ema_init)
    return [sm[i, :s.shape[0]:cfg.mean_window] for i, s in enumerate(states)]


def knn_value(D: torch.Tensor, returns: torch.Tensor, k: int, d_min: float, power: float = 1.0) -> float:
    """Σ w R / Σ w over the k nearest finite nodes, w = 1/max(D, d_min)^power.

    The release clamps D to d_min *before* its top-k, so when more than k nodes lie under d_min (equal weight) its
    pick among them is arbitrary (``torch.topk`` on ties). Ours is one of its possible picks, made deterministic: the
    nodes nearest by raw distance, equal distances in node order (rollout, then state; a stable sort)."""
    n = min(k, int(torch.isfinite(D).sum()))
    idx = torch.argsort(D, stable=True)[:n]
    w = 1.0 / D[idx].clamp_min(d_min) ** power
    return float((w * returns[idx]).sum() / w.sum())


def library(reps: list[torch.Tensor], positions: list[list[int]], rewards: torch.Tensor, mean_window: int):
    """Every (rollout, state) node: its owner, prefix length in E and return, flattened."""
    plen = [torch.tensor([p // mean_window + 1 for p in pos]) for pos in positions]
    owner = torch.cat([torch.full((len(p),), k) for k, p in enumerate(plen)])
    returns = torch.cat([rewards[k].float().cpu().expand(len(p)) for k, p in enumerate(plen)])
    return plen, owner, torch.cat(plen), returns


def node_distances(online: torch.Tensor, a: torch.Tensor, j: int, reps, plen, owner, lengths) -> torch.Tensor:
    """D (len(a), nodes) from the online rollout ``j``'s prefixes of lengths ``a`` to every node; ∞ on rollout
    ``j``'s own nodes longer than the online prefix."""
    D = torch.cat([prefix_distances(online, reps[k])[(a - 1)][:, plen[k] - 1].cpu() for k in range(len(reps))], 1)
    future = (owner == j).unsqueeze(0) & (lengths.unsqueeze(0) > a.unsqueeze(1))
    return D.masked_fill(future, float("inf"))


def hista_values(reps: list[torch.Tensor], positions: list[list[int]], rewards: torch.Tensor,
                 cfg: HistaConfig) -> list[torch.Tensor]:
    """Per rollout of one group, its value chain [V_0 = group mean, V_1 … V_{m−1}, V_m = R].

    ``reps[j]``: E_j; ``positions[j]``: its state token indices (:func:`state_positions`); a state's prefix
    length in E is p // mean_window + 1."""
    n = len(reps)
    rewards = rewards.float().cpu()
    plen, node_owner, node_len, node_r = library(reps, positions, rewards, cfg.mean_window)
    out = []
    for j in range(n):
        m = len(plen[j]) - 1
        values = [float(rewards.mean())]
        if m > 1:
            a = plen[j][1:m]  # the intermediate states' prefix lengths
            D = node_distances(reps[j], a, j, reps, plen, node_owner, node_len)
            d_min = float(D[torch.isfinite(D)].median()) if cfg.d_min == "median" else float(cfg.d_min)
            values += [knn_value(D[i], node_r, k, d_min, cfg.power) for i, k in enumerate(k_schedule(m - 1, cfg.max_k, cfg.min_k))]
        out.append(torch.tensor(values + [float(rewards[j])], dtype=torch.float32))
    return out


def hista_token_advantages(reps, positions, prompt_lens, lengths, rewards, T: int, cfg: HistaConfig) -> torch.Tensor:
    """(n, T) token advantages of one group: GAE over each rollout's Hista value chain, segments between states."""
    chains = hista_values(reps, positions, rewards, cfg)
    rows = []
    for j, v in enumerate(chains):
        end = int(lengths[j]) - 1 if cfg.zero_last_token else int(lengths[j])  # the release: the last token is in none
        bounds = [min(p - prompt_lens[j], end) for p in positions[j][:-1]] + [end]
        rows.append(segment_gae(v, bounds, T, cfg.lam))
    return torch.stack(rows)


def cut_value(reps: list[torch.Tensor], positions: list[list[int]], rewards: torch.Tensor, cut_token: int,
              cfg: HistaConfig, protocol: str = "release") -> float:
    """Hista's SVEB estimate for rollout 0 cut after token index ``cut_token`` (its prefix's last token, in the
    unpadded prompt + response), against every (rollout, state) node of the group.

    ``release`` (the Hista release's ``sveb/hista``): the online nodes are all m + 1 states of rollout 0, k follows the
    schedule over those m + 1, and the estimate is the node just before the cut (the last state index < ``cut_token``;
    a cut on the response's first token wraps to the last node, as the release's index -1 does). ``exact``: the cut
    prefix itself is the online prefix, k the schedule's at its intermediate-state index."""
    if protocol not in ("release", "exact"):
        raise ValueError(f"model.sveb_protocol={protocol!r}: choose release or exact")
    plen, owner, node_len, returns = library(reps, positions, rewards, cfg.mean_window)
    if protocol == "release":
        i = next(j for j, p in enumerate(positions[0]) if p >= cut_token) - 1  # -1: the release's wrap-around
        a, k = plen[0], k_schedule(len(plen[0]), cfg.max_k, cfg.min_k)[i]
        D = node_distances(reps[0], a, 0, reps, plen, owner, node_len)[i]
    else:
        M = max(1, len(positions[0]) - 2)
        k = k_schedule(M, cfg.max_k, cfg.min_k)[min((cut_token - positions[0][0]) // cfg.min_interval, M - 1)]
        D = node_distances(reps[0], torch.tensor([cut_token // cfg.mean_window + 1]), 0, reps, plen, owner,
                           node_len)[0]
    d_min = float(D[torch.isfinite(D)].median()) if cfg.d_min == "median" else float(cfg.d_min)
    return knn_value(D, returns, k, d_min, cfg.power)
