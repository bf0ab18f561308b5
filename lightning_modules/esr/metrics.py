"""ESR's metrics over judged responses, and off-topic-detector (OTD) discovery.

Metrics (one list of attempt scores per response): multi-attempt = P(≥ 2 attempts), ESR = P(≥ 2 and last > first),
improvement = ESR / multi-attempt, mean Δ = mean(last − first) over multi-attempt responses; each rate with the
binomial SE √(p(1 − p)/n).

OTDs: unsteered responses; each prompt paired with its own response (on-topic) and with another prompt's response
through a derangement (off-topic); SAE activations max-pooled over positions; a detector is 0 on every on-topic
sample and > 0 on at least ``freq`` of the off-topic ones.
"""
from __future__ import annotations

import math
import random
from typing import Sequence

import torch


def _se(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def esr_metrics(attempt_scores: Sequence[Sequence[float]]) -> dict:
    n = len(attempt_scores)
    multi = [a for a in attempt_scores if len(a) >= 2]
    esr = [a for a in multi if a[-1] > a[0]]
    p_multi, p_esr = (len(multi) / n, len(esr) / n) if n else (float("nan"), float("nan"))
    return {"n": n, "multi_attempt": p_multi, "multi_attempt_se": _se(p_multi, n), "esr": p_esr,
            "esr_se": _se(p_esr, n), "improvement": len(esr) / len(multi) if multi else float("nan"),
            "mean_delta": sum(a[-1] - a[0] for a in multi) / len(multi) if multi else float("nan")}


def derangement(n: int, seed: int = 0) -> list[int]:
    """A uniformly random cyclic permutation (Sattolo): no i maps to itself; n >= 2."""
    if n < 2:
        raise ValueError(f"a derangement needs at least 2 items, got {n}: add discovery prompts")
    perm, rng = list(range(n)), random.Random(seed)
    for i in range(n - 1, 0, -1):
        j = rng.randrange(i)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def find_detectors(on_topic: torch.Tensor, off_topic: torch.Tensor, freq: float = 0.8) -> torch.Tensor:
    """Latents 0 on every on-topic sample and active on ≥ ``freq`` of the off-topic ones; inputs (N, d_sae) pooled."""
    return (((on_topic == 0).all(0)) & ((off_topic > 0).float().mean(0) >= freq)).nonzero().flatten()


def random_sets(d_sae: int, size: int, k: int, exclude: Sequence[int] = (), seed: int = 0) -> list[list[int]]:
    """``k`` random latent sets of ``size`` each, drawn from the latents not in ``exclude``."""
    pool = sorted(set(range(d_sae)) - set(int(i) for i in exclude))
    rng = random.Random(seed)
    return [sorted(rng.sample(pool, min(size, len(pool)))) for _ in range(k)]
