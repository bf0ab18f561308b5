"""Dynamic sampling (the Hista recipes' ``dynamic_sampling_scale``): keep the prompt groups whose accuracy is nearest
0.5, ranked over every rank's groups as the release does. Plain torch, so ranks can be tested without the training
stack.
"""
from __future__ import annotations

import torch

from lightning_modules.common.rl.rollouts import Rollouts


def dynamic_sample(rewards: torch.Tensor, group_size: int, keep: int) -> torch.Tensor:
    """Indices (ascending) of the ``keep`` groups whose accuracy (reward > 0.5) is nearest 0.5."""
    acc = (rewards.float().view(-1, group_size) > 0.5).float().mean(1)
    order = torch.argsort((acc - 0.5).abs().cpu(), stable=True)
    return order[:max(1, keep)].sort().values


def rollout_rows(ro: Rollouts) -> list[dict]:
    """Each rollout as plain CPU data (real prompt and response tokens, reward, advantage, text, problem id)."""
    plens, lengths = ro.prompt_lengths.tolist(), ro.lengths.tolist()
    P = ro.prompt_len
    return [{"prompt": ro.input_ids[i, P - plens[i]:P].tolist(), "response": ro.input_ids[i, P:P + lengths[i]].tolist(),
             "reward": float(ro.rewards[i]), "advantage": float(ro.advantages[i]) if ro.advantages is not None else 0.0,
             "completion": ro.completions[i] if ro.completions else "",
             "problem_id": ro.problem_ids[i] if ro.problem_ids else None} for i in range(len(ro))]


def rollouts_from_rows(rows: list[dict], group_size: int, pad_id: int, device) -> Rollouts:
    """:func:`rollout_rows` back into a left-padded prompt / right-padded response batch."""
    P = max(len(r["prompt"]) for r in rows)
    T = max(1, max(len(r["response"]) for r in rows))
    ids = torch.full((len(rows), P + T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), P + T), dtype=torch.long)
    for i, r in enumerate(rows):
        p, n = len(r["prompt"]), len(r["response"])
        ids[i, P - p:P], ids[i, P:P + n] = torch.tensor(r["prompt"], dtype=torch.long), torch.tensor(r["response"],
                                                                                                   dtype=torch.long)
        mask[i, P - p:P + n] = 1
    ro = Rollouts(ids.to(device), mask.to(device), P, mask[:, P:].to(device, torch.float32), group_size,
                  [r["completion"] for r in rows])
    ro.rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float32, device=device)
    ro.advantages = torch.tensor([r["advantage"] for r in rows], dtype=torch.float32, device=device)
    ro.problem_ids = [r["problem_id"] for r in rows]
    return ro


def dynamic_sample_ranks(ro: Rollouts, group_size: int, keep: int, pad_id: int) -> Rollouts:
    """Dynamic sampling over every rank, as the Hista release's ``_dynamic_sampling_overlong_filter``: the groups of all
    ranks (in rank order) are ranked by accuracy distance to 0.5 (ties by that order), the ``keep`` x world size
    nearest kept in that order and dealt out in consecutive slices of ``keep`` groups, rank 0 first; so a rank may
    train on groups another rank sampled. One process: :func:`dynamic_sample` on its own groups."""
    from lightning_modules.common.rl import ranks

    if not ranks.distributed():
        return ro.select_groups(dynamic_sample(ro.rewards, group_size, keep))
    rows = rollout_rows(ro)
    groups = ranks.gather_objects([rows[g:g + group_size] for g in range(0, len(rows), group_size)])
    rewards = torch.tensor([row["reward"] for grp in groups for row in grp])
    chosen = dynamic_sample(rewards, group_size, keep * ranks.world_size()).tolist()
    mine = chosen[ranks.rank() * keep:(ranks.rank() + 1) * keep]
    return rollouts_from_rows([row for g in mine for row in groups[g]], group_size, pad_id, ro.input_ids.device)
