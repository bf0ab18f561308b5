"""Trajectory perturbations at one layer and token: h_t += δ with ‖δ‖ = s·‖h_t - h_{t-1}‖, then forward ([INF]).

Kinds (``perturb.kind``), each a dict of conditions -> δ (B, D):

- ``pca_sampled`` (default, after the precursor's perturb_straight.py, described not copied): ``n_candidates``
  random directions inside the top-``pcs`` principal components of the layer's activations (the batch's tokens at
  that layer, centred), scored by the angle at t of (h_{t-2}, h_{t-1}, h_t + δ); conditions ``straight`` (smallest angle, aligned) and ``curvy`` (largest);
- ``extrapolation``: toward the linear extrapolation ĥ_t = 2h_{t-1} - h_{t-2} (aligned);
- ``orthogonal``: a random direction ⟂ span{v_{t-2}, ĥ_t - h_t} (misaligned: first-order no change of the angle);
- ``random``: an isotropic random direction.
"""
from __future__ import annotations

import torch

from lightning_modules.common.activations import at, intervene
from lightning_modules.curvature.analysis import token_entropy

KINDS = ("pca_sampled", "extrapolation", "orthogonal", "random")
ALIGNED = {"pca_sampled": "straight", "extrapolation": "extrapolation"}


def angle_at(h2: torch.Tensor, h1: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """The angle of (h_{t-2}, h_{t-1}, h_t) between v_{t-2} = h1 - h2 and v_{t-1} = h0 - h1 (rows, or broadcast)."""
    a, b = h1 - h2, h0 - h1
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return torch.arccos(cos.clamp(-1.0, 1.0))


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def top_pcs(states: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k principal directions (k, D) of activations (N, D), centred."""
    x = states.reshape(-1, states.shape[-1]).double()
    _, _, vh = torch.linalg.svd(x - x.mean(0), full_matrices=False)
    return vh[:k].to(states.dtype)


def directions(h2, h1, h0, kind: str, scale: float, *, pcs: torch.Tensor | None = None, n_candidates: int = 64,
               generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The perturbations δ (B, D) of ``kind`` at rows (h_{t-2}, h_{t-1}, h_t), each of norm scale·‖h_t - h_{t-1}‖."""
    if kind not in KINDS:
        raise ValueError(f"perturb.kind={kind!r}: choose one of {', '.join(KINDS)}")
    norm = scale * (h0 - h1).norm(dim=-1, keepdim=True)
    rand = lambda *shape: torch.randn(*shape, generator=generator, dtype=h0.dtype).to(h0.device)  # noqa: E731
    target = (2 * h1 - h2) - h0                                   # ĥ_t - h_t
    if kind == "extrapolation":
        return {"extrapolation": norm * _unit(target)}
    if kind == "random":
        return {"random": norm * _unit(rand(*h0.shape))}
    if kind == "orthogonal":
        q, _ = torch.linalg.qr(torch.stack([h1 - h2, target], -1))   # (B, D, 2): an orthonormal basis of the span
        r = rand(*h0.shape)
        r = r - (q @ (q.transpose(-1, -2) @ r[..., None]))[..., 0]
        return {"orthogonal": norm * _unit(r)}
    if pcs is None:
        raise ValueError("perturb.kind=pca_sampled needs the layer's principal components (pcs)")
    cand = norm[:, None] * _unit(rand(h0.shape[0], n_candidates, pcs.shape[0]) @ pcs)  # (B, n, D)
    theta = angle_at(h2[:, None], h1[:, None], h0[:, None] + cand)
    rows = torch.arange(h0.shape[0], device=h0.device)
    return {"straight": cand[rows, theta.argmin(1)], "curvy": cand[rows, theta.argmax(1)]}


@torch.no_grad()
def perturbation_effects(model, input_ids: torch.Tensor, logits: torch.Tensor, states: torch.Tensor, layer: int,
                         ts: torch.Tensor, kinds, scale: float, *, pcs=None, n_candidates: int = 64,
                         generator: torch.Generator | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """ΔH_t, ΔNLL of x_{t+1} and Δθ_t per row for each condition of ``kinds`` (a kind or a list).

    ``states`` (B, T, D) are hidden-state index ``layer`` (the output of block ``layer - 1``) in the forward that gave
    ``logits``; row b is perturbed at position ``ts[b]`` (2 <= t <= T-2) and re-run up to the last t."""
    rows = torch.arange(len(ts), device=ts.device)
    h2, h1, h0 = (states[rows, ts - i].to(torch.float64) for i in (2, 1, 0))
    base_h = token_entropy(logits[rows, ts].double())
    target = input_ids[rows, ts + 1]
    base_nll = -torch.log_softmax(logits[rows, ts].double(), -1)[rows, target]
    ids = input_ids[:, : int(ts.max()) + 2]
    out = {}
    for kind in [kinds] if isinstance(kinds, str) else kinds:
        for cond, delta in directions(h2, h1, h0, kind, scale, pcs=None if pcs is None else pcs.double(),
                                      n_candidates=n_candidates, generator=generator).items():
            with intervene(model, layer - 1, at(ts, delta.to(states.dtype))):
                new = model(input_ids=ids, use_cache=False).logits[rows, ts].double()
            out[cond] = {"dH": token_entropy(new) - base_h,
                         "dNLL": -torch.log_softmax(new, -1)[rows, target] - base_nll,
                         "dtheta": angle_at(h2, h1, h0 + delta) - angle_at(h2, h1, h0)}
    return out
