"""CGQ (Certainty-Guided Quantization): per-token weights for GPTQ's statistics, H ∝ Σ_j c_j x_j x_jᵀ.

c_j = w_mask for [MASK] positions and w_unmask (0.7, reviewers' reading of the paper) for the others, times f(score_j)
with ``score_fn``: ``none`` (f ≡ 1, default: the sources do not say how scores enter) or ``confidence`` (the FP
model's top probability at j [INF]). The driver reads them as ``batch["token_weight"]``; the quantizer stays GPTQ.
"""
from __future__ import annotations

import torch

SCORE_FNS = ("none", "confidence")


def check_score_fn(score_fn: str) -> str:
    if score_fn not in SCORE_FNS:
        raise ValueError(f"model.cgq.score_fn={score_fn!r}: choose one of {', '.join(SCORE_FNS)}")
    return score_fn


@torch.no_grad()
def token_weights(ids: torch.Tensor, mask_token_id: int, w_mask: float = 1.0, w_unmask: float = 0.7,
                  score_fn: str = "none", logits: torch.Tensor | None = None) -> torch.Tensor:
    """c (B×S, float64) for the states ``ids``; ``logits`` (the FP model's, B×S×V) for ``score_fn=confidence``."""
    check_score_fn(score_fn)
    masked = ids == mask_token_id
    c = torch.where(masked, torch.full(ids.shape, float(w_mask), dtype=torch.float64, device=ids.device),
                    torch.full(ids.shape, float(w_unmask), dtype=torch.float64, device=ids.device))
    if score_fn == "confidence":
        if logits is None:
            raise ValueError("score_fn=confidence needs the full-precision logits of the calibration states")
        c = c * torch.softmax(logits.double(), -1).amax(-1).to(c.device)
    return c
