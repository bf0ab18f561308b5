"""PS-PPO: the prefix-sampled, 1/S(t)-weighted loss is an unbiased estimator of the full-trajectory gradient.

Central test: on a fixed small policy and fixed rollouts, the mean PS-PPO gradient over M cutoff draws converges
to the full-trajectory gradient with relative error shrinking like 1/sqrt(M), for every cutoff family and for
the seq_mean and dr_grpo aggregations, while naive truncation (no weights) and dividing by C stay biased.
"""
import math

import pytest
import torch

from lightning_modules.common.rl.advantages import compute_advantages
from lightning_modules.common.rl.losses import divisors, policy_loss, ppo_clip_terms
from lightning_modules.common.rl.rollouts import Rollouts, left_pad, response_logprobs
from lightning_modules.ps_ppo.cutoffs import build_cutoff, prefix_weights
from tests.test_rl_core import tiny_policy

FAMILIES = {"mixture_full": dict(p_full=0.2), "uniform": dict(c_min=2), "beta": dict(beta_a=1.0, beta_b=2.0, p_full=0.1),
            "group": dict(p_min=0.1, p_max=0.5, skip_zero_adv=True)}


@pytest.fixture(scope="module")
def setup():
    """A fixed policy, fixed rollouts (3 groups of 3, response lengths 2..10), a perturbed pi_old, GRPO advantages
    (group 2 has equal rewards, so A = 0 there), and the per-token gradient matrix J of the full forward."""
    model = tiny_policy(seed=1)
    old = tiny_policy(seed=1)
    with torch.no_grad():  # sharpen the policy, and make pi_old differ enough that some ratios leave [0.8, 1.2]
        g = torch.Generator().manual_seed(2)
        model.lm_head.weight.mul_(30.0)
        old.lm_head.weight.copy_(model.lm_head.weight + 0.4 * torch.randn(model.lm_head.weight.shape, generator=g))
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 13], [14], [3, 5, 7], [2, 4], [9, 9, 9], [5]]
    lengths = torch.tensor([10, 4, 7, 2, 9, 5, 10, 3, 8])
    ids, mask = left_pad(prompts, pad_id=1)
    T = int(lengths.max())
    resp = torch.randint(2, 16, (len(prompts), T), generator=g)
    rmask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    ro = Rollouts(torch.cat([ids, resp], 1), torch.cat([mask, rmask.long()], 1), ids.shape[1], rmask, 3)
    ro.rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1, 1])
    ro.advantages = compute_advantages("grpo", ro.rewards, 3)
    with torch.no_grad():
        logp_old = response_logprobs(old, ro.input_ids, ro.attention_mask, ro.prompt_len, T)
    params = [p for p in model.parameters()]
    logp = response_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len, T)
    terms, clipped = ppo_clip_terms(logp, logp_old, ro.advantages, 0.2, 0.2)
    assert clipped[rmask.bool()].any() and not clipped[rmask.bool()].all()  # both branches of the clip occur
    J = torch.zeros(len(prompts), T, sum(p.numel() for p in params))
    for i in range(len(prompts)):
        for t in range(int(lengths[i])):
            gr = torch.autograd.grad(terms[i, t], params, retain_graph=True, allow_unused=True)
            J[i, t] = torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1) for x, p in zip(gr, params)])
    return model, params, ro, logp_old, J


def real_gradient(model, params, ro, logp_old, kept, weights, div):
    """The PS-PPO update's own path: forward only the longest kept prefix, weighted loss, backward."""
    n = int(kept.max())
    logp = response_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len, n)
    loss, _ = policy_loss(logp, logp_old[:, :n], ro.advantages, weights[:, :n], div)
    gr = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1) for x, p in zip(gr, params)])


def draw_weights(cut, ro, M, seed):
    """M cutoff draws (one vectorised call over M copies of the batch) -> PS-PPO weights, naive (unweighted)
    truncation weights, and the cutoffs, each with a leading M dimension."""
    g = torch.Generator().manual_seed(seed)
    N = len(ro)
    C, S = cut.sample(ro.lengths.repeat(M), g, ro.rewards.repeat(M), ro.group_size)
    W = prefix_weights(C, S).view(M, N, -1)
    return W, (W > 0).float(), C.view(M, N)


def rel_err(est, g):
    return float((est - g).norm() / g.norm())


@pytest.mark.parametrize("aggregation", ["seq_mean", "dr_grpo"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_ps_ppo_gradient_is_unbiased_and_error_shrinks_like_inverse_sqrt_draws(setup, family, aggregation):
    model, params, ro, logp_old, J = setup
    div = divisors(aggregation, ro.lengths, max_len=12)
    full_w = ro.response_mask / div.unsqueeze(1)
    g_full = torch.einsum("nt,ntp->p", full_w, J)
    cut = build_cutoff(family, **FAMILIES[family])
    # the update's real truncated path gives exactly the linear-in-weights gradient, draw by draw
    W, naive, Cs = draw_weights(cut, ro, 3, seed=11)
    for m in range(3):
        if Cs[m].max() == 0:
            continue
        _, g_real = real_gradient(model, params, ro, logp_old, Cs[m].long(), W[m], div)
        assert rel_err(g_real, torch.einsum("nt,ntp->p", W[m] / div.unsqueeze(1), J)) < 1e-5
    # relative error of the mean over M draws, averaged over R independent replicates
    R, Ms = 12, (16, 256, 4096)
    W, naive, Cs = draw_weights(cut, ro, R * Ms[-1], seed=5)
    Jd = J / div.view(-1, 1, 1)

    def mean_err(weights, M):  # root-mean-square over replicates: E|err|^2 = tr(Cov)/M when unbiased
        errs = []
        for r in range(R):
            wbar = weights[r * Ms[-1]: r * Ms[-1] + M].mean(0)
            errs.append(rel_err(torch.einsum("nt,ntp->p", wbar, Jd), g_full) ** 2)
        return math.sqrt(sum(errs) / R)

    e = {M: mean_err(W, M) for M in Ms}
    assert e[4096] < 0.06, e
    for a, b in zip(Ms, Ms[1:]):  # 1/sqrt(M): x16 draws -> error / 4 (allow 2.5 .. 6.5)
        assert 2.5 < e[a] / e[b] < 6.5, e
    # negative control 1: truncation without the 1/S(t) weights keeps a bias that does not shrink
    en = {M: mean_err(naive, M) for M in (256, 4096)}
    assert en[4096] > 0.15 and en[256] / en[4096] < 1.5, en
    # negative control 2 (seq_mean): 1/S(t) weights but each sequence divided by its kept length C, not T
    if aggregation == "seq_mean":
        c_div = (Cs.clamp_min(1) / ro.lengths.float()).unsqueeze(-1)
        ec = mean_err(W / c_div, 4096)
        assert ec > 0.15, ec


def test_survival_matches_empirical_cutoffs_and_weights_average_to_one():
    lengths = torch.tensor([1, 5, 17, 30])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])  # groups of 2: one mixed, one all-equal
    for family, kw in FAMILIES.items():
        kw = {**kw, "skip_zero_adv": False} if family == "group" else kw
        cut = build_cutoff(family, **kw)
        g = torch.Generator().manual_seed(0)
        M = 20000
        C, S = cut.sample(lengths.repeat(M), g, rewards.repeat(M), 2)
        w = prefix_weights(C, S).view(M, len(lengths), -1)
        C, S = C.view(M, -1).float(), S[:len(lengths)]
        assert ((C >= 1) & (C <= lengths)).all(), family
        t = torch.arange(1, S.shape[1] + 1)
        emp = (C.unsqueeze(-1) >= t).float().mean(0)
        valid = t.unsqueeze(0) <= lengths.unsqueeze(1)
        assert (emp - S)[valid].abs().max() < 0.02, family
        assert (S[valid] > 0).all() and (S[~valid] == 0).all()
        wbar = w.mean(0)
        assert (wbar[valid] - 1).abs().max() < 0.1, (family, wbar)
    # mixture_full: every weight is at most 1/p_full, and E[C]/T ~ (1 + p_full)/2 for long T
    cut = build_cutoff("mixture_full", p_full=0.2)
    g = torch.Generator().manual_seed(1)
    T = torch.full((4000,), 200)
    C, S = cut.sample(T, g)
    assert prefix_weights(C, S).max() <= 1 / 0.2 + 1e-6
    assert abs(float(C.float().mean() / 200) - 0.6) < 0.02


def test_p_full_one_is_exactly_the_full_trajectory_loss(setup):
    model, params, ro, logp_old, _ = setup
    div = divisors("seq_mean", ro.lengths, 12)
    C, S = build_cutoff("mixture_full", p_full=1.0).sample(ro.lengths, torch.Generator().manual_seed(0))
    assert torch.equal(C, ro.lengths)
    w = prefix_weights(C, S)
    assert torch.equal(w, ro.response_mask)
    l1, g1 = real_gradient(model, params, ro, logp_old, C, w, div)
    l2, g2 = real_gradient(model, params, ro, logp_old, ro.lengths, ro.response_mask, div)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)


def test_group_cutoff_skips_only_zero_advantage_groups_and_needs_beta_zero(setup):
    _, _, ro, _, _ = setup
    cut = build_cutoff("group", p_min=0.1, p_max=0.5, skip_zero_adv=True)
    C, _ = cut.sample(ro.lengths, torch.Generator().manual_seed(0), ro.rewards, 3)
    assert C[3:6].tolist() == [0, 0, 0] and (C[:3] > 0).all() and (C[6:] > 0).all()
    p = cut.p_full(ro.rewards, 3)  # pass rate 1/3 and 2/3 -> 0.1 + 0.4 * 8/9 ; all-equal group -> p_min
    torch.testing.assert_close(p[[0, 6]], torch.full((2,), 0.1 + 0.4 * 8 / 9))
    assert float(p[3]) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="beta=0"):
        build_cutoff("group", skip_zero_adv=True, beta=0.04)
    with pytest.raises(ValueError, match="p_full"):
        build_cutoff("mixture_full", p_full=0.0)


def test_module_hook_resamples_per_epoch_or_keeps_the_cutoff(setup):
    from lightning_modules.ps_ppo import PSPPOModule

    _, _, ro, _, _ = setup
    spec = {"family": "llama", "pretrained": None, "config": {}}
    fresh = PSPPOModule(spec, cutoff="mixture_full", p_full=0.2, resample_per_epoch=True)
    fixed = PSPPOModule(spec, cutoff="mixture_full", p_full=0.2, resample_per_epoch=False)
    a0, a1 = fresh.token_weights(ro, 0), fresh.token_weights(ro, 1)
    b0, b1 = fixed.token_weights(ro, 0), fixed.token_weights(ro, 1)
    assert not torch.equal(a0[1], a1[1]) and torch.equal(b0[1], b1[1])
    assert ((a0[1] > 0).sum(1) == a0[0]).all()  # exactly C kept tokens per row, weights 1/S(t) on them
    assert (a0[1][ro.response_mask == 0] == 0).all()
    full = PSPPOModule(spec, cutoff="mixture_full", p_full=1.0)
    C, w = full.token_weights(ro, 0)
    assert torch.equal(C, ro.lengths) and torch.equal(w, ro.response_mask)


@pytest.mark.parametrize("arms", [("grpo_tiny", "rloo_tiny", "ps_ppo_tiny"),
                                  ("grpo_qwen25_7b", "rloo_qwen25_7b", "ps_ppo_qwen25_7b"),
                                  ("grpo_rlhf_qwen25_7b", "ps_ppo_rlhf_qwen25_7b")])
def test_baselines_pack_like_ps_ppo_so_the_gap_is_the_method(arms):
    """Issue 38: PS-PPO packs its micro-batches; its GRPO / RLOO baselines must too, or part of the measured compute
    and memory gap is padding. Every arm of a comparison packs, and otherwise differs from PS-PPO only in the model."""
    from runner import compose

    cfgs = {a: compose(a) for a in arms}
    assert all(c.model.packing for c in cfgs.values()), {a: c.model.packing for a, c in cfgs.items()}
    same = lambda c: (c.model.micro_batch_size, c.model.group_size, c.data.batch_size, c.model.aggregation)  # noqa: E731
    assert len({same(c) for c in cfgs.values()}) == 1
