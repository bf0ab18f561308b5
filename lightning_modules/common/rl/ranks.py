"""Reductions over the data-parallel ranks of an RL step (identity in a single process).

The released trainers normalise over the whole step, not per rank: TRL's ``dapo`` / ``cispo`` divide by the token
count of every process, AReaL's batch advantage normalisation all-reduces its moments, Hista's dynamic sampling
ranks the groups of every process. These helpers are the one place that talks to ``torch.distributed``.
"""
from __future__ import annotations

import torch


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if distributed() else 1


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if distributed() else 0


def _all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
    if not distributed():
        return t
    import torch.distributed as dist

    out = t.detach().clone()
    dist.all_reduce(out, op=getattr(dist.ReduceOp, op))
    return out


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks (a copy; ``t`` itself in a single process)."""
    return _all_reduce(t, "SUM")


def all_max(t: torch.Tensor) -> torch.Tensor:
    """``t`` maximised over the ranks (a copy; ``t`` itself in a single process)."""
    return _all_reduce(t, "MAX")


def gather_objects(items: list) -> list:
    """``items`` of every rank, concatenated in rank order (this rank's alone when not distributed)."""
    if not distributed():
        return items
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]
