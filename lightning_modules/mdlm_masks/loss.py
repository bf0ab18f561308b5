"""The mask-agnostic (MA) loss of "Masks Can Be Distracting" (arXiv 2511.21338, Appendix B), as pure functions.

For a pair (q, a): p ~ U(p_low, p_high) masks each answer token (ã, shared by both branches); l₁, l₂ ~
U{0..min(N − |q⊕a|, max_masks)}; x_i = q ⊕ ã ⊕ [MASK]×l_i, right-padded with EOS to one length. With n_m masked
answer tokens:

    L_CE = −1/(2 p n_m) Σ_i Σ_{masked j ∈ A} log p_θ(a_j | x_i)
    L_TV = (p / n_m) Σ_{masked j ∈ A} ‖softmax(x₁)_j − softmax(x₂)_j‖₁      (the L1 distance: no ½)
    L    = α L_CE + β L_TV                                                   (α 0.1; β 1 Base, 10 Instruct, 0 CE-only)

The appended masks are never supervised. ``tv_stopgrad``: ``none`` (gradient through both branches, the spec's
[INF]) or ``second`` (branch 2 is a fixed target). A pair with no answer token masked would carry no signal: one
answer token is then masked at random [INF]. The curriculum: ``mask_budget(step)`` grows max_masks linearly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

STOPGRAD = ("none", "second")


def mask_budget(step: int, max_masks: int = 600, curriculum_steps: int = 5000, min_masks: int = 0) -> int:
    """The bound on appended masks at optimizer step ``step``: min_masks → max_masks linearly over curriculum_steps."""
    if curriculum_steps <= 0:
        return max_masks
    frac = min(1.0, max(0, step) / curriculum_steps)
    return int(min_masks + (max_masks - min_masks) * frac)


@dataclass
class MABatch:
    x1: torch.Tensor        # (B, L) q ⊕ ã ⊕ [MASK]×l₁, EOS-padded
    x2: torch.Tensor        # (B, L) q ⊕ ã ⊕ [MASK]×l₂, EOS-padded
    targets: torch.Tensor   # (B, L) the clean tokens at the answer positions (EOS elsewhere)
    masked: torch.Tensor    # (B, L) bool: answer positions that are masked (the same in both branches)
    p: torch.Tensor         # (B,) masking probability of each pair
    l1: list[int]
    l2: list[int]


def build_ma_batch(pairs, mask_token_id: int, eos_token_id: int, p_low: float = 0.2, p_high: float = 0.8,
                   max_masks: int = 600, context: int = 1024, generator: torch.Generator | None = None,
                   p: torch.Tensor | None = None, lengths: list[tuple[int, int]] | None = None) -> MABatch:
    """The two branches of a batch of (question ids, answer ids) pairs. ``p`` and ``lengths`` [(l₁, l₂), ...]
    override the draws (tests)."""
    if not 0 <= p_low < p_high <= 1:
        raise ValueError(f"model.p_low={p_low} must be < model.p_high={p_high}, both in [0, 1] (paper: 0.2, 0.8)")
    if max_masks < 0 or max_masks >= context:
        raise ValueError(f"model.max_masks={max_masks} must lie in 0..context-1={context - 1} (the masks are appended "
                         "inside the context): lower max_masks or raise model.context")
    rows1, rows2, tgts, msks, ps, l1s, l2s = [], [], [], [], [], [], []
    for i, (q, a) in enumerate(pairs):
        q, a = list(q), list(a)
        if not a:
            raise ValueError("an empty answer: the mask-agnostic loss needs answer tokens")
        if len(a) >= context:
            raise ValueError(f"an answer of {len(a)} tokens does not fit model.context={context}")
        q = q[max(0, len(q) + len(a) - context):]  # keep the answer; the question loses its start if too long
        pi = float(p[i]) if p is not None else p_low + (p_high - p_low) * float(torch.rand((), generator=generator))
        m = (torch.rand(len(a), generator=generator) < pi).tolist()
        if not any(m):
            m[int(torch.randint(len(a), (), generator=generator))] = True
        room = min(context - len(q) - len(a), max_masks)
        if lengths is not None:
            l1, l2 = lengths[i]
            if max(l1, l2) > room:
                raise ValueError(f"l={max(l1, l2)} appended masks exceed min(N - |q+a|, max_masks) = {room}")
        else:
            l1, l2 = (int(v) for v in torch.randint(room + 1, (2,), generator=generator))
        ans = [mask_token_id if mi else t for t, mi in zip(a, m)]
        rows1.append(q + ans + [mask_token_id] * l1)
        rows2.append(q + ans + [mask_token_id] * l2)
        tgts.append([eos_token_id] * len(q) + a)
        msks.append([False] * len(q) + m)
        ps.append(pi)
        l1s.append(l1)
        l2s.append(l2)
    n = max(max(map(len, rows1)), max(map(len, rows2)))

    def pad(rows, value):
        return torch.tensor([r + [value] * (n - len(r)) for r in rows])

    return MABatch(pad(rows1, eos_token_id), pad(rows2, eos_token_id), pad(tgts, eos_token_id), pad(msks, False),
                   torch.tensor(ps), l1s, l2s)


def mask_agnostic_loss(logits1: torch.Tensor, logits2: torch.Tensor, targets: torch.Tensor, masked: torch.Tensor,
                       p: torch.Tensor, alpha: float = 0.1, beta: float = 1.0, tv_stopgrad: str = "none") -> dict:
    """``{"loss", "ce", "tv"}``, each the mean over pairs, from the two branches' aligned logits (B, L, V)."""
    if tv_stopgrad not in STOPGRAD:
        raise ValueError(f"model.tv_stopgrad={tv_stopgrad!r}: choose none (both branches) or second")
    mask = masked.float()
    n_m = mask.sum(-1).clamp_min(1)
    logp1, logp2 = torch.log_softmax(logits1.float(), -1), torch.log_softmax(logits2.float(), -1)
    nll = -(logp1.gather(-1, targets[..., None]) + logp2.gather(-1, targets[..., None])).squeeze(-1)
    ce = (nll * mask).sum(-1) / (2 * p * n_m)
    q2 = logp2.exp().detach() if tv_stopgrad == "second" else logp2.exp()
    l1 = (logp1.exp() - q2).abs().sum(-1)
    tv = p * (l1 * mask).sum(-1) / n_m
    return {"loss": (alpha * ce + beta * tv).mean(), "ce": ce.mean(), "tv": tv.mean()}
