"""The RL normalisers over ranks (issue 38), with 2 CPU processes (gloo): TRL's dapo / cispo token count over every
process, AReaL's batch advantage normalisation and RLKV's micro-batch penalty weights over both ranks, and Hista's
dynamic sampling ranking the groups of both ranks. Each check compares the two-rank result with the same quantity
computed in one process over the union of the ranks' data (what the releases compute)."""
from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.multiprocessing as mp

LENGTHS = {0: [3.0, 5.0], 1: [10.0, 2.0, 4.0]}
ADV = {0: [1.0, -0.5], 1: [0.3, 2.0, -1.0]}
ACC = {0: [0.5, 0.5, 0.25, 1.0], 1: [0.0, 1.0, 0.75, 0.0]}  # per group of 4
G = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_rollouts(rank: int):
    """4 groups of G=4 rollouts with the planted accuracies; each row's prompt token names its rank and group."""
    from lightning_modules.common.rl.rollouts import Rollouts

    rewards = [float(i < round(a * G)) for a in ACC[rank] for i in range(G)]
    N = len(rewards)
    ids = torch.zeros(N, 1 + 3, dtype=torch.long)
    ids[:, 0] = torch.arange(N) // G + 10 * (rank + 1)  # the prompt: 10+g on rank 0, 20+g on rank 1
    ids[:, 1:] = 7
    mask = torch.ones_like(ids)
    ro = Rollouts(ids, mask, 1, torch.ones(N, 3), G, [f"c{rank}" for _ in range(N)])
    ro.rewards = torch.tensor(rewards)
    ro.advantages = torch.zeros(N)
    ro.problem_ids = [f"r{rank}-{i // G}" for i in range(N)]
    return ro


def _worker(rank: int, port: int, out):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from lightning_modules.common.rl.advantages import batch_normalize
        from lightning_modules.common.rl.losses import divisors
        from lightning_modules.hista.sampling import dynamic_sample_ranks
        from lightning_modules.rlkv.penalty import microbatch_penalty_weight

        lengths = torch.tensor(LENGTHS[rank])
        res = {"global": divisors("token_mean", lengths, 16, "global").tolist(),
               "local": divisors("token_mean", lengths, 16, "local").tolist(),
               "adv": batch_normalize(torch.tensor(ADV[rank]), lengths).tolist()}
        kept = dynamic_sample_ranks(_group_rollouts(rank), G, 2, pad_id=0)
        res["kept"] = sorted(set(kept.problem_ids))
        res["kept_prompts"] = sorted(set(kept.input_ids[:, kept.prompt_len - 1].tolist()))
        raw = torch.tensor([1.0, 1.0]) if rank == 0 else torch.tensor([0.0, 1.0, 1.0])
        res["pen"] = microbatch_penalty_weight(raw, lengths + 5000, lengths, 0.5, 7680)
        out[rank] = res
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
    return dict(out)


def test_token_mean_divides_by_the_token_count_of_every_rank(two_ranks):
    """TRL's dapo / cispo: divisor = all tokens / world size, so after DDP's gradient average the loss is one mean
    over all 24 tokens (local: the mean of two per-rank means)."""
    total = sum(sum(v) for v in LENGTHS.values())
    for rank in (0, 1):
        assert two_ranks[rank]["global"] == [total / 2] * len(LENGTHS[rank])
        assert two_ranks[rank]["local"] == [sum(LENGTHS[rank])] * len(LENGTHS[rank])
    per_token = {0: [2.0, -1.0], 1: [0.5, 1.0, 3.0]}  # a per-token loss value per row
    ddp = sum(sum(l * t / d for l, t, d in zip(per_token[r], LENGTHS[r], two_ranks[r]["global"])) for r in (0, 1)) / 2
    union = sum(l * t for r in (0, 1) for l, t in zip(per_token[r], LENGTHS[r])) / total
    assert ddp == pytest.approx(union)


def test_batch_advantage_normalisation_uses_both_ranks_moments(two_ranks):
    from lightning_modules.common.rl.advantages import batch_normalize

    union = batch_normalize(torch.tensor(ADV[0] + ADV[1]), torch.tensor(LENGTHS[0] + LENGTHS[1])).tolist()
    assert two_ranks[0]["adv"] + two_ranks[1]["adv"] == pytest.approx(union, rel=1e-6)


def test_dynamic_sampling_ranks_every_ranks_groups(two_ranks):
    """Distances to 0.5: rank 0 [0, 0, .25, .5], rank 1 [.5, .5, .25, .5]; the 4 nearest of all 8 are rank 0's
    groups 0, 1, 2 and rank 1's group 2, dealt out two per rank in order: rank 1 trains on rank 0's group 2 (per rank,
    rank 1 would have kept its own groups 2 and 0)."""
    assert two_ranks[0]["kept"] == ["r0-0", "r0-1"] and two_ranks[0]["kept_prompts"] == [10, 11]
    assert two_ranks[1]["kept"] == ["r0-2", "r1-2"] and two_ranks[1]["kept_prompts"] == [12, 22]


def test_rlkv_penalty_weights_share_the_step_token_count(two_ranks):
    """Each sequence (5000+ tokens) is its own AReaL micro-batch; DDP averages the two ranks' penalties, so the
    effective multiplier is sum over all micro-batches of (tokens / all 24 tokens) 1[r > 0.5](e^r - 1)."""
    mean = (two_ranks[0]["pen"] + two_ranks[1]["pen"]) / 2
    assert mean == pytest.approx((3 + 5 + 2 + 4) / 24 * (math.e - 1))
