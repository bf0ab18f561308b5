"""lightning_modules/spard/selection.py: greedy DPP MAP against brute force, the RD-DPP kernel's properties."""
import math
import random

import pytest
import torch

from lightning_modules.spard.selection import (budget, greedy_dpp, greedy_dpp_factor, mean_pairwise_cosine,
                                                rd_dpp_factor, rd_dpp_kernel, relevance, select)


def brute_greedy(L: torch.Tensor, k: int) -> list[int]:
    """Greedy by recomputing log det(L_{S+x}) from scratch for every candidate."""
    chosen = []
    for _ in range(k):
        best = max((x for x in range(len(L)) if x not in chosen),
                   key=lambda x: torch.linalg.slogdet(L[[*chosen, x]][:, [*chosen, x]])[1].item())
        chosen.append(best)
    return chosen


def planted(seed=0, n=200, d=16, m=50):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(m, d, generator=g, dtype=torch.float64)


def test_logdet_identity_and_first_pick():
    pool, ref = planted()
    L = rd_dpp_kernel(pool, ref, beta=4)
    S, logdet = greedy_dpp(L, 12)
    sign, exact = torch.linalg.slogdet(L[S][:, S])
    assert sign > 0 and logdet == pytest.approx(exact.item(), abs=1e-8)
    r = relevance(pool, ref, 4)
    assert S[0] == int(torch.argmax(r)) and len(set(S)) == 12


def test_factor_form_equals_the_kernel():
    pool, ref = planted(5)
    S, logdet = greedy_dpp(rd_dpp_kernel(pool, ref, 4), 20)
    S2, logdet2 = greedy_dpp_factor(rd_dpp_factor(pool, ref, 4), 20)
    assert S == S2 == select(pool, ref, 20) and logdet2 == pytest.approx(logdet, abs=1e-8)


@pytest.mark.parametrize("seed", [1, 2])
def test_matches_brute_force_greedy(seed):
    pool, ref = planted(seed, n=30, d=6, m=10)
    L = rd_dpp_kernel(pool, ref, beta=2)
    assert greedy_dpp(L, 6)[0] == brute_greedy(L, 6)


def test_duplicates_are_skipped():
    pool = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    ref = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=torch.float64)  # item 3 relevant at 0.8 < 1
    L = rd_dpp_kernel(pool, ref, beta=4, eps=1e-6)
    S, logdet = greedy_dpp(L, 3, eps=1e-6)
    assert S == [0, 2, 1]
    # the duplicate's gain is O(ε): its Schur complement (1+ε) - 1/(1+ε) ≈ 2ε
    _, two = greedy_dpp(L, 2, eps=1e-6)
    assert 0.9e-6 < math.exp(logdet - two) < 2.1e-6
    assert logdet == pytest.approx(torch.linalg.slogdet(L)[1].item(), abs=1e-6)


def test_relevance_of_selection_rises_with_beta():
    pool, ref = planted(3)
    k = budget(len(ref) * 20, 0.03, len(pool))  # 30
    r1 = relevance(pool, ref, 1)
    means = [float(r1[select(pool, ref, k, "rd_dpp", beta)].mean()) for beta in (1, 2, 4, 8)]
    assert all(a < b for a, b in zip(means, means[1:])), means


def test_odd_beta_keeps_sign_and_random_selector():
    pool = torch.tensor([[-1.0, 0.0], [0.0, 1.0]])
    ref = torch.tensor([[1.0, 0.0], [0.0, -1.0]])
    assert relevance(pool, ref, 3).tolist() == pytest.approx([0.0, 0.0])
    ref = torch.tensor([[1.0, 0.1]])
    r = relevance(pool, ref, 3)
    assert r[0] < 0 and relevance(pool, ref, 4)[0] > 0
    pool, ref = planted(4)
    assert select(pool, ref, 5, "random", seed=42) == random.Random(42).sample(range(200), 5)


def test_budget_and_bad_input():
    assert budget(1000, 0.03, 500) == 30 and budget(1000, 0.03, 10) == 10
    with pytest.raises(ValueError, match=r"dpp.ratio"):
        budget(10, 0.0, 5)
    with pytest.raises(ValueError, match=r"dpp.selector"):
        select(torch.eye(3), torch.eye(3), 1, "greedy")


def test_mean_pairwise_cosine():
    e = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    c = 1 / math.sqrt(2)
    assert mean_pairwise_cosine(e) == pytest.approx((0 + c + c) / 3)
