"""TMAS (Temporal-Mask Adaptive Sampling): calibration states drawn from the full-precision sampler's trajectories.

``record_trajectory`` runs the FP sampler (LLaDA's ``sample``) on calibration prompts and keeps every intermediate
state x_t with its step and mask ratio (masks left in the generated region / generated length). ``stages`` splits the
states into 4 stages, by mask ratio (default [INF]: stage 0 = ratio in (0.75, 1], ..., stage 3 = [0, 0.25]) or by
step (4 equal runs of steps); ``draw`` takes ``largest_remainder(n, proportions)`` states from each stage (the paper's
U-shaped [0.3, 0.2, 0.2, 0.3]: most from the earliest and the latest stages), seeded, without replacement while a
stage has enough states.
"""
from __future__ import annotations

import math

import torch

STAGE_BY = ("mask_ratio", "step")
PROPORTIONS = (0.3, 0.2, 0.2, 0.3)


def check_proportions(proportions) -> list[float]:
    p = [float(v) for v in proportions]
    if len(p) != 4 or any(v < 0 for v in p) or abs(sum(p) - 1) > 1e-6:
        raise ValueError(f"model.tmas.proportions={list(proportions)}: give four non-negative stage shares summing to 1")
    return p


def largest_remainder(n: int, proportions) -> list[int]:
    """Integer counts summing to ``n``, each ⌊n·p⌋ plus one for the largest remainders (ties: earlier stage)."""
    raw = [n * p for p in proportions]
    counts = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


@torch.no_grad()
def record_trajectory(dlm, prompts: list[list[int]], gen_length: int, steps: int, block_length: int | None = None,
                      pad_id: int = 0) -> list[dict]:
    """Every state of the FP sampler on ``prompts`` (one at a time, no padding): {ids (1-D), step, mask_ratio,
    prompt_len}; step −1 is the fully masked start."""
    states = []
    dev = next(dlm.parameters()).device
    for p in prompts:
        prompt = torch.tensor([p], device=dev)

        def keep(step, x, _transfer, n=len(p)):
            ratio = float((x[0, n:] == dlm.mask_token_id).float().mean())
            states.append({"ids": x[0].cpu().clone(), "step": step, "mask_ratio": ratio, "prompt_len": n})

        start = torch.cat([prompt, torch.full((1, gen_length), dlm.mask_token_id, device=dev)], 1)
        keep(-1, start, None)
        dlm.sample(prompt, gen_length=gen_length, steps=steps, block_length=block_length, callback=keep)
    return states


def stages(states: list[dict], stage_by: str = "mask_ratio", steps: int | None = None) -> list[list[int]]:
    """Indices of ``states`` in each of the 4 stages (earliest = most masked first)."""
    if stage_by not in STAGE_BY:
        raise ValueError(f"model.tmas.stage_by={stage_by!r}: choose one of {', '.join(STAGE_BY)}")
    out: list[list[int]] = [[], [], [], []]
    for i, s in enumerate(states):
        if stage_by == "mask_ratio":
            k = min(3, int((1 - s["mask_ratio"]) * 4))  # ratio 1 -> 0, ratio 0 -> 3
        else:
            k = min(3, max(0, (s["step"] + 1) * 4 // (steps + 1)))
        out[k].append(i)
    return out


def draw(states: list[dict], n: int, proportions=PROPORTIONS, stage_by: str = "mask_ratio",
         steps: int | None = None, seed: int = 0) -> list[dict]:
    """``n`` states, ``largest_remainder(n, proportions)`` from each stage (module doc)."""
    counts = largest_remainder(n, check_proportions(proportions))
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (idx, c) in enumerate(zip(stages(states, stage_by, steps), counts)):
        if c and not idx:
            raise ValueError(f"TMAS stage {k} holds no trajectory state: raise model.sampler.steps or the prompts")
        if c <= len(idx):
            pick = torch.randperm(len(idx), generator=g)[:c]
        else:
            pick = torch.randint(len(idx), (c,), generator=g)
        out += [{**states[idx[int(j)]], "stage": k} for j in pick]
    return out


def uniform(states: list[dict], n: int, seed: int = 0) -> list[dict]:
    """``n`` states drawn uniformly from the trajectories (the ablation without stage proportions)."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(states), generator=g)[:n] if n <= len(states) else torch.randint(len(states), (n,), generator=g)
    return [states[int(j)] for j in pick]
