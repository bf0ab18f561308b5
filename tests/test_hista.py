"""Hista / Numca / SVEB (issue 17): the spec's hand cases (3.8), planted values, the core's token-advantage path."""
import math

import pytest
import torch

from lightning_modules.common.rl.advantages import grpo_advantages, scale_rewards, segment_gae
from lightning_modules.hista.critic import ValueHead
from lightning_modules.common.rl.losses import cispo_terms, policy_loss
from lightning_modules.hista.hista import (HistaConfig, ema_smooth, hista_token_advantages, hista_values, k_schedule,
                                           prefix_distances, state_positions)
from lightning_modules.hista.numca import (NumcaTable, chars_to_tokens, merge_positions, numca_chain,
                                           numca_token_advantages, parse_numbers, state_at)


# --- GAE over segments ------------------------------------------------------------------------------
def test_segment_gae_lambda_one_is_return_minus_segment_start_value_and_lambda_zero_the_td_step():
    values, bounds = [0.2, 0.5, 0.9, 1.0], [0, 3, 5, 9]
    a1 = segment_gae(values, bounds, 12, lam=1.0)
    a0 = segment_gae(values, bounds, 12, lam=0.0)
    expect1 = [1.0 - 0.2] * 3 + [1.0 - 0.5] * 2 + [1.0 - 0.9] * 4 + [0.0] * 3
    expect0 = [0.5 - 0.2] * 3 + [0.9 - 0.5] * 2 + [1.0 - 0.9] * 4 + [0.0] * 3
    assert torch.allclose(a1, torch.tensor(expect1)) and torch.allclose(a0, torch.tensor(expect0))
    # a general λ against the recursion A_i = δ_i + λ A_{i+1}
    lam = 0.5
    d = [0.3, 0.4, 0.1]
    A = [d[0] + lam * d[1] + lam ** 2 * d[2], d[1] + lam * d[2], d[2]]
    assert torch.allclose(segment_gae(values, bounds, 9, lam), torch.tensor([A[0]] * 3 + [A[1]] * 2 + [A[2]] * 4))


def test_constant_per_row_advantages_reproduce_grpo_exactly():
    """[group mean, R] with no intermediate state, std-scaled = the GRPO advantage; a (N, T) advantage constant per
    row gives the very loss and gradient of the (N,) path."""
    torch.manual_seed(0)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    G, T = 4, 6
    mean = r.view(-1, G).mean(1).repeat_interleave(G)
    rows = torch.stack([segment_gae([float(m), float(x)], [0, T], T, 1.0) for m, x in zip(mean, r)])
    tok = scale_rewards(rows, r, G, "group")
    assert torch.allclose(tok, grpo_advantages(r, G).view(-1, 1).expand(-1, T))
    logp = torch.randn(8, T, requires_grad=True)
    old, w = logp.detach() + 0.1 * torch.randn(8, T), torch.ones(8, T)
    div = torch.full((8,), 8.0 * T)
    for loss_type in ("ppo", "cispo"):
        l1, _ = policy_loss(logp, old, grpo_advantages(r, G), w, div, loss_type=loss_type)
        g1, = torch.autograd.grad(l1, logp)
        l2, _ = policy_loss(logp, old, tok, w, div, loss_type=loss_type)
        g2, = torch.autograd.grad(l2, logp)
        assert torch.equal(l1, l2) and torch.equal(g1, g2)


def test_scale_rewards_none_and_bad_mode():
    adv, r = torch.randn(4, 3), torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert torch.equal(scale_rewards(adv, r, 2, "none"), adv)
    with pytest.raises(ValueError, match="scale_rewards"):
        scale_rewards(adv, r, 2, "batchwise")


def test_cispo_is_detached_clipped_weight_times_advantage_times_logp():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -4.0, -0.2]])  # ratios 1, e^2 = 7.39 (clipped at 5), e^-0.3
    adv = torch.tensor([2.0])
    terms, clipped = cispo_terms(logp, old, adv, eps_high=5.0)
    wts = torch.tensor([1.0, 5.0, math.exp(-0.3)])
    assert torch.allclose(terms, -wts * 2.0 * logp.detach())
    assert clipped.tolist() == [[False, True, False]]
    terms.sum().backward()  # the weight carries no gradient: d/dlogp = -w A
    assert torch.allclose(logp.grad, -wts * 2.0)


# --- Numca --------------------------------------------------------------------------------------------
def test_numca_spec_case_values_and_segment_advantages():
    A, B = "3 then 5 so #### 8", "3 then 7 so #### 2"
    table = NumcaTable()
    nA, nB = parse_numbers(A), parse_numbers(B)
    assert [n for n, _ in nA] == ["3", "5"]  # the answer is dropped
    table.update("p", [n for n, _ in nA], 1.0)
    table.update("p", [n for n, _ in nB], 0.0)
    V = lambda *s: table.value("p", set(s))  # noqa: E731
    assert (V(), V("3"), V("3", "5"), V("3", "7"), V("9")) == (0.5, 0.5, 1.0, 0.0, 0.0)
    assert V("5", "3") == V("3", "5")  # a set: order-invariant
    pos = [1, 3]  # token positions far enough apart (gap 1) to stay separate segments
    segs = lambda nums, R, lam: numca_token_advantages(table, "p", nums, R, 6, 6, 1, lam, pos)  # noqa: E731
    # segments [0,1) [1,3) [3,6) carry A_1, A_2, A_3
    assert segs(nA, 1.0, 0.0)[[0, 1, 3]].tolist() == [0.0, 0.5, 0.0]
    assert segs(nA, 1.0, 1.0)[[0, 1, 3]].tolist() == [0.5, 0.5, 0.0]
    assert segs(nB, 0.0, 1.0)[[0, 1, 3]].tolist() == [-0.5, -0.5, 0.0]


def test_numca_parsing_merging_and_token_mapping():
    assert [n for n, _ in parse_numbers("pi is 3.14, -2 and 7")] == ["3", "14", "2"]
    assert merge_positions([0, 30, 60, 200], 50) == [0, 60, 60, 200]  # earlier snaps onto later, from the right
    assert merge_positions([10, 20, 30], 50) == [30, 30, 30]
    # tokens "ab" "c3" "4 " "x": char 3 ('3') sits in token 1 -> boundary 2; char 4 ('4') in token 2 -> 3
    assert chars_to_tokens([3, 4, 0], [2, 4, 6, 7]) == [2, 3, 1]
    # two new numbers merged onto one position are one transition to the latest state
    table = NumcaTable()
    table.update("q", ["1", "2"], 1.0)
    table.update("q", ["1", "5"], 0.0)
    values, bounds = numca_chain(table, "q", [("1", 0), ("2", 4)], 1.0, end=100, gap=50)
    assert bounds == [0, 4, 100] and values == [0.5, 1.0, 1.0]
    # a repeated number is no new state
    values, bounds = numca_chain(table, "q", [("1", 0), ("1", 60), ("2", 120)], 1.0, end=200, gap=50)
    assert bounds == [0, 0, 120, 200] and values == [0.5, 0.5, 1.0, 1.0]
    assert state_at([("3", 0), ("17", 6)], 7) == {"3"} and state_at([("3", 0), ("17", 6)], 8) == {"3", "17"}


def test_numca_planted_value_from_the_first_numbers_parity():
    """Reward = parity of the first number; Numca's V after it is within 0.05 of 0 or 1, V_grpo is 0.5 off."""
    import random

    rng = random.Random(0)
    table, rows = NumcaTable(), []
    for _ in range(400):
        first, mid = rng.randint(0, 9), rng.randint(10, 99)
        nums = [str(first), str(mid)]
        R = float(first % 2 == 0)
        table.update("p", nums, R)
        rows.append((nums, R))
    grpo = sum(r for _, r in rows) / len(rows)
    for first in range(10):
        v = table.value("p", {str(first)})
        assert abs(v - float(first % 2 == 0)) < 0.05
    assert abs(grpo - 0.5) < 0.1  # the group mean knows nothing of the first number: |V_grpo - truth| ~ 0.5


# --- Hista --------------------------------------------------------------------------------------------
def test_ema_quirk_values_and_zero_init():
    x = torch.ones(1, 5, 2)
    h0 = ema_smooth(x, 0.7, "h0")[0, :, 0]
    assert torch.allclose(h0, torch.tensor([10 / 3, 1 / 0.51, 1 / 0.657, 1 / 0.7599, 1 / 0.83193]), atol=1e-4)
    assert [round(v, 3) for v in h0.tolist()] == [3.333, 1.961, 1.522, 1.316, 1.202]
    assert torch.allclose(ema_smooth(x, 0.7, "zero"), x)
    with pytest.raises(ValueError, match="ema_init"):
        ema_smooth(x, 0.7, "ones")


def test_prefix_distance_against_the_definition():
    torch.manual_seed(0)
    P, Q = torch.randn(6, 3), torch.randn(4, 3)
    D = prefix_distances(P, Q)
    for a in range(1, 7):
        for b in range(1, 5):
            C = torch.cdist(P[:a], Q[:b])
            ref = C.min(1).values.mean() if a >= b else C.min(0).values.mean()
            assert D[a - 1, b - 1] == pytest.approx(float(ref), abs=1e-5)


def test_k_schedule_and_state_positions():
    assert k_schedule(10) == [66, 60, 54, 48, 42, 36, 30, 24, 18, 12]
    assert state_positions(7, 120, 50, "response") == [7, 57, 107, 126]
    assert state_positions(7, 100, 50, "response") == [7, 57, 106]
    assert state_positions(7, 1, 50, "response") == [7, 7]


def test_hista_two_identical_prefixes_give_the_weight_balanced_mean_and_future_is_masked():
    """Rollouts 0 (R=1) and 1 (R=0) share E up to state 1; a third (R=1) is far. With k = 2 the nearest two nodes
    are at distance 0, both clamped to d_min, so V_1 is their weight-balanced (here plain) mean 0.5."""
    cfg = HistaConfig(alpha=0.7, mean_window=1, min_interval=4, d_min=1.0, max_k=2, min_k=2, state_grid="response")
    shared = torch.randn(8, 3)
    e0 = torch.cat([shared, torch.randn(4, 3)])          # 12 reps
    e1 = torch.cat([shared, torch.randn(4, 3) + 5.0])
    e2 = torch.randn(12, 3) + 40.0
    pos = [state_positions(4, 8, 4, "response")] * 3     # prompt 4 + 8 response tokens: states at 4, 8, 11
    assert pos[0] == [4, 8, 11]
    chains = hista_values([e0, e1, e2], pos, torch.tensor([1.0, 0.0, 1.0]), cfg)
    assert chains[0].tolist() == pytest.approx([2 / 3, 0.5, 1.0])
    # the far rollout is 40 away: it does not enter either rollout's value at state 1
    assert chains[1].tolist() == pytest.approx([2 / 3, 0.5, 0.0])


def test_hista_future_nodes_are_infinite_and_never_selected(monkeypatch):
    from lightning_modules.hista import hista as H

    seen = []
    orig = H.prefix_distances

    def spy(a, b):
        d = orig(a, b)
        seen.append(d)
        return d

    torch.manual_seed(0)
    e = torch.randn(12, 3)
    monkeypatch.setattr(H, "prefix_distances", spy)
    cfg = HistaConfig(alpha=0.7, mean_window=1, min_interval=2, d_min=1.0, max_k=66, min_k=6)
    pos = [state_positions(2, 10, 2, "response")] * 2  # states at 2, 4, 6, 8, 10, 11
    # rollout 1 (R = 0) is near; rollout 0's future nodes carry reward 1 at small D but must be masked: with k
    # covering every node, V_1 averages rollout 0's nodes of length <= its own plus all of rollout 1's
    v = H.hista_values([e, e + 0.5 * torch.randn(12, 3)], pos, torch.tensor([1.0, 0.0]), cfg)[0]
    D00, D01 = seen[0], seen[1]
    plen = torch.tensor([p + 1 for p in pos[0]])
    a = plen[1]
    own = plen[plen <= a]
    d = torch.cat([D00[a - 1, own - 1], D01[a - 1, plen - 1]])
    r = torch.cat([torch.ones(len(own)), torch.zeros(len(plen))])
    w = 1 / d.clamp_min(1.0)
    assert v[1] == pytest.approx(float((w * r).sum() / w.sum()), rel=1e-5)
    # were the future nodes (reward 1, near) admitted, the value would be higher
    d_all = torch.cat([D00[a - 1, plen - 1], D01[a - 1, plen - 1]])
    r_all = torch.cat([torch.ones(len(plen)), torch.zeros(len(plen))])
    w_all = 1 / d_all.clamp_min(1.0)
    assert float((w_all * r_all).sum() / w_all.sum()) > v[1] + 0.01


def test_hista_gae_on_tokens():
    cfg = HistaConfig(alpha=0.7, mean_window=1, min_interval=3, d_min=1.0, max_k=4, min_k=2, zero_last_token=False)
    torch.manual_seed(1)
    reps = [torch.randn(10, 4) for _ in range(2)]
    pos = [state_positions(2, 8, 3, "response")] * 2  # [2, 5, 8, 9]
    r = torch.tensor([1.0, 0.0])
    adv = hista_token_advantages(reps, pos, [2, 2], [8, 8], r, 10, cfg)
    chain = hista_values(reps, pos, r, cfg)[0]
    assert torch.allclose(adv[0, :3], 1.0 - chain[0]) and torch.allclose(adv[0, 3:6], 1.0 - chain[1])
    assert torch.allclose(adv[0, 6:8], 1.0 - chain[2]) and (adv[:, 8:] == 0).all()


# --- the critic -----------------------------------------------------------------------------------------
def test_value_head_recovers_a_planted_linear_value():
    torch.manual_seed(0)
    X = torch.randn(200, 5)
    w, b = torch.tensor([0.5, -1.0, 0.0, 2.0, 0.1]), 0.3
    head = ValueHead(5).fit(X, X @ w + b, ridge=1e-8)
    assert torch.allclose(head(X), X @ w + b, atol=1e-4)
    with pytest.raises(ValueError, match="features"):
        head.fit(X, torch.zeros(3))


# --- end to end -------------------------------------------------------------------------------------------
def test_hista_tiny_smoke(tmp_path, tiny_lm_dir):
    """hista_tiny through run.py's path (debug=smoke: 20 steps). The tiny run already shrinks the procedure's
    sizes (min_interval 4, mean_window 1, merge_gap 2, d_min median); the overrides shrink the evaluation and the
    cached warm-up (SMOKE_WARMUP: 40 steps at batch 16, not 200 at 32; the key test_ps_ppo_tiny's smoke runs share)."""
    from tests.helpers import SMOKE_WARMUP, run_experiment

    value, metrics = run_experiment("hista_tiny", tmp_path, overrides=("debug=smoke", "data.n_val=16", *SMOKE_WARMUP))
    final = metrics["final"]
    assert metrics["status"] == "ok" and metrics["global_step"] == 20
    assert math.isfinite(final["train/loss"]) and math.isfinite(final["train/grad_norm"])
    assert 0 <= value <= 1 and final["train/advantage_s"] > 0


def test_sveb_metrics_on_stored_json_match_hand_values(tmp_path):
    import json

    from lightning_modules.hista.sveb import check_field, cut_points, sveb_metrics

    cases = [{"grpo_rewards": [1, 0, 0, 0], "mc_rewards": [1, 1, 0, 0], "estimates": {"hista": 0.4, "numca": 1.0}},
             {"grpo_rewards": [1, 1, 1, 1], "mc_rewards": [0, 1, 0, 1], "estimates": {"hista": 0.5, "ppo-n": None}}]
    path = tmp_path / "sveb.json"
    path.write_text(json.dumps(cases))
    m = sveb_metrics(json.loads(path.read_text()))
    # V_mc = 0.5, 0.5; V_grpo = 0.25, 1
    assert m["mae/grpo"] == pytest.approx((0.25 + 0.5) / 2)
    assert m["mae/hista"] == pytest.approx((0.1 + 0.0) / 2) and m["mae/numca"] == pytest.approx(0.5)
    assert m["n/numca"] == 1 and "mae/ppo-n" not in m
    # first n continuations: n=1 -> |1-.5|, |0-.5|; n=2 -> |1-.5|, |.5-.5|; n=3 -> |2/3-.5|, |1/3-.5|; n=4 -> 0
    assert m["noise_mae"] == pytest.approx([0.5, 0.25, 1 / 6, 0.0])
    assert cut_points(["3", " +", " 4", "=", " 7"]) == [1, 2, 4]
    with pytest.raises(ValueError, match="judge"):
        check_field("science")


@pytest.mark.parametrize("experiment,overrides,match", [
    ("hista_tiny", ["model.min_interval=16"], "model.min_interval=16 >= model.max_new_tokens=16"),
    ("hista_tiny", ["model.group_size=1"], "G >= 2"),
    ("hista_tiny", ["model.estimator=critic"], "model.estimator='critic': choose one of grpo, numca, hista"),
    ("hista_tiny", ["model.ema_init=ones"], "model.ema_init='ones': choose one of h0, zero"),
    ("hista_tiny", ["model.d_min=mean"], "model.d_min='mean': a number or 'median'"),
    ("hista_tiny", ["model.loss_type=grpo"], "model.loss_type='grpo': choose one of ppo, cispo"),
    ("numca_tiny", ["data.dynamic_sampling_scale=0"], "data.dynamic_sampling_scale=0: must be an integer >= 1"),
    ("sveb_tiny", ["model.sveb_field=program"], "model.sveb_field=program: that field needs an external LLM judge"),
])
def test_bad_input_is_one_line_naming_the_fix(experiment, overrides, match):
    from hydra.utils import instantiate

    from tests.helpers import compose

    cfg = compose(experiment, overrides)
    target = cfg.data if overrides[0].startswith("data.") else cfg.model
    with pytest.raises(Exception) as info:  # hydra wraps the constructor's error; the cause is ours
        instantiate(target, _convert_="all")
    err = info.value.__cause__ or info.value
    assert isinstance(err, ValueError) and match in str(err) and "\n" not in str(err)


@pytest.mark.slow
def test_numca_tiny_and_sveb_tiny_run(tmp_path, tiny_lm_dir):
    """numca_tiny trains (smoke); sveb_tiny scores every estimator against V_mc. Beyond debug=smoke, SVEB's sizes
    shrink by overrides: 4 problems, 8 samples, 4 continuations, 4 critic problems."""
    from lightning_modules.hista.sveb import sveb_metrics
    from tests.helpers import run_experiment

    _, metrics = run_experiment("numca_tiny", tmp_path / "numca", overrides=("debug=smoke", "data.n_val=16"))
    assert metrics["status"] == "ok" and math.isfinite(metrics["final"]["train/loss"])
    value, metrics = run_experiment("sveb_tiny", tmp_path / "sveb", overrides=(
        "debug=smoke", "data.n_test=4", "model.group_size=8", "model.mcs_num=4", "model.critic_problems=4"))
    sveb = metrics["results"]["sveb"]
    again = sveb_metrics(sveb["cases"])  # the stored JSON re-scores the same
    assert sveb["metrics"].keys() == again.keys() and sveb["metrics"]["noise_mae"] == pytest.approx(again["noise_mae"])
    assert all(sveb["metrics"][k] == pytest.approx(again[k]) for k in again if k != "noise_mae")
    assert value == pytest.approx(sveb["metrics"]["mae/hista"])
    for c in sveb["cases"]:
        assert len(c["grpo_rewards"]) == 8 and len(c["mc_rewards"]) == 4 and 0 <= c["estimates"]["numca"] <= 1


# --- the core's token-advantage path ------------------------------------------------------------------------
@pytest.mark.parametrize("packing", [False, True])
def test_update_slices_2d_advantages_per_micro_batch_padded_and_packed(packing):
    """A planted (N, T) advantage through update() — truncated PS-PPO prefixes, micro-batches of 4, padded or packed —
    gives the gradient of one full-batch loss with that advantage; the π_old pass hands the hook the last layer's
    states of every real prompt + response token."""
    from lightning_modules.common.rl.losses import divisors
    from lightning_modules.common.rl.rollouts import position_ids, response_logprobs
    from lightning_modules.ps_ppo import PSPPOModule
    from tests.test_ps_ppo_packing import _Capture, rollouts
    from tests.test_rl_core import tiny_policy

    ro = rollouts([9, 3, 7, 1, 12, 5, 10, 2, 6], seed=1)
    planted = torch.randn(len(ro), ro.response_mask.shape[1], generator=torch.Generator().manual_seed(5))
    seen = {}

    class Planted(PSPPOModule):
        needs_hidden = True

        def token_advantages(self, ro, hidden):
            seen["hidden"] = hidden.clone()
            return planted

    spec = {"family": "llama", "pretrained": None, "config": {}}
    m = Planted(spec, micro_batch_size=4, max_new_tokens=12, ppo_epochs=1, packing=packing, cutoff="mixture_full",
                p_full=0.2, aggregation="token_mean")
    m.model = tiny_policy(seed=4).train()
    cap = _Capture(m)
    plan = m.token_weights(ro, 0)
    m.update(ro, [plan])
    # the reference: one forward over the whole batch, the same per-token weights and divisor
    kept, w = plan
    T = ro.response_mask.shape[1]
    m.model.zero_grad()
    logp = response_logprobs(m.model, ro.input_ids, ro.attention_mask, ro.prompt_len, T)
    loss, _ = policy_loss(logp, logp.detach(), planted, w, divisors("token_mean", ro.lengths, 12))
    loss.backward()
    ref = torch.cat([p.grad.reshape(-1) for p in m.model.parameters()])
    torch.testing.assert_close(cap.grads[0], ref, atol=1e-6, rtol=1e-4)
    with torch.no_grad():
        out = m.model(input_ids=ro.input_ids, attention_mask=ro.attention_mask,
                      position_ids=position_ids(ro.attention_mask), output_hidden_states=True)
    real = ro.attention_mask.bool() & (torch.arange(ro.input_ids.shape[1]) < ro.prompt_len + kept.unsqueeze(1))
    torch.testing.assert_close(seen["hidden"][real], out.hidden_states[-1][real], atol=1e-5, rtol=1e-4)


def test_dynamic_sampling_keeps_the_groups_nearest_half_and_problem_ids_are_stable(tiny_tokenizer):
    from datamodules.verifiable import Problems, generate_problems
    from lightning_modules.hista.sampling import dynamic_sample
    from tests.test_ps_ppo_packing import rollouts

    # 4 groups of 3: accuracies 1, 1/3, 0, 2/3 -> the two nearest 0.5 are groups 1 and 3 (|-1/6| ties: stable order)
    r = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0], dtype=torch.float)
    assert dynamic_sample(r, 3, 2).tolist() == [1, 3]
    ro = rollouts([2, 3, 1, 4, 2, 2, 3, 1, 2, 5, 1, 2], seed=2)
    ro.rewards, ro.problem_ids = r, [f"p{i // 3}" for i in range(12)]
    sub = ro.select_groups(torch.tensor([1, 3]))
    assert sub.problem_ids == ["p1"] * 3 + ["p3"] * 3 and torch.equal(sub.rewards, r[[3, 4, 5, 9, 10, 11]])
    assert torch.equal(sub.input_ids, ro.input_ids[[3, 4, 5, 9, 10, 11]])
    probs = generate_problems("arithmetic", 6, seed=0, digits=1)
    a, b = Problems(probs, tiny_tokenizer, 64), Problems(list(reversed(probs)), tiny_tokenizer, 64)
    ids = {it["prompt"]: it["id"] for it in a.items}
    assert all(ids[it["prompt"]] == it["id"] for it in b.items)  # the id follows the problem, not its position
    assert len({it["id"] for it in a.items}) == len({p["key"] for p in probs})


def test_module_hook_grpo_equals_the_core_and_numca_follows_the_spec_case(tiny_tokenizer):
    from lightning_modules.common.rl.module import RLModule
    from lightning_modules.common.rl.rollouts import Rollouts, left_pad
    from lightning_modules.hista.module import HistaModule

    spec = {"family": "llama", "pretrained": None, "config": {}}
    tok = tiny_tokenizer
    texts = ["3 then 5 so #### 8", "3 then 7 so #### 2"]
    resp = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    T = max(map(len, resp))
    ids, mask = left_pad([[5, 6], [5, 6]], pad_id=tok.pad_token_id)
    rmask = torch.tensor([[1.0] * len(r) + [0.0] * (T - len(r)) for r in resp])
    rids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in resp])
    ro = Rollouts(torch.cat([ids, rids], 1), torch.cat([mask, rmask.long()], 1), 2, rmask, 2, texts,
                  torch.tensor([1.0, 0.0]), problem_ids=["p", "p"])
    ro.advantages = grpo_advantages(ro.rewards, 2)
    core = RLModule(spec, group_size=2, max_new_tokens=T).token_advantages(ro, None)
    m = HistaModule(spec, group_size=2, max_new_tokens=T, estimator="grpo")
    assert torch.allclose(m.token_advantages(ro, None), core * rmask) and torch.allclose(core[:, 0], ro.advantages)
    m = HistaModule(spec, group_size=2, max_new_tokens=T, estimator="numca", merge_gap=1)
    m.tokenizer = tok
    adv = m.token_advantages(ro, None)
    s = float(torch.tensor([1.0, 0.0]).std()) + 1e-4
    first, last = adv[:, 0], adv[torch.arange(2), ro.lengths - 1]
    assert first.tolist() == pytest.approx([0.5 / s, -0.5 / s]) and last.tolist() == pytest.approx([0.0, 0.0])
    assert m.numca.value("p", {"3", "5"}) == 1.0  # the table was filled with the batch before the advantages


def test_value_head_cv_picks_a_strong_ridge_for_noise_and_a_weak_one_for_signal():
    torch.manual_seed(0)
    X, groups = torch.randn(400, 20), torch.arange(400) // 10
    noise = (torch.rand(400) > 0.5).float()  # rewards independent of the states: the mean is the best value
    head = ValueHead(20).fit_cv(X, noise, groups)
    assert head.ridge >= 1e2 and (head(X) - noise.mean()).abs().max() < 0.1
    signal = X @ torch.randn(20)
    assert ValueHead(20).fit_cv(X, signal, groups).ridge <= 1e-1


# --- the release's recipe (issue 38) ------------------------------------------------------------------------------
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_paper_scale_prompts_are_the_chat_template_with_the_release_system_prompt(tmp_path, tiny_tokenizer):
    """Both releases render prompts with the tokenizer's chat template (Hista adds its system prompt): the datamodule's
    prompt and ids equal apply_chat_template on a saved tokenizer; the tiny runs keep "Question: ...\\nAnswer:"."""
    from datamodules.common.tokenizer import load_tokenizer
    from datamodules.verifiable import PROMPT, VerifiableDataModule
    from runner import compose

    tiny_tokenizer.chat_template = CHAT
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(pretrained=str(tmp_path / "tok"))
    dm = VerifiableDataModule(tok, task="arithmetic", digits=1, n_val=4, n_test=4, chat_template=True,
                              system_prompt="Box it.")
    dm.setup()
    item = dm.train_set[0]
    messages = [{"role": "system", "content": "Box it."}, {"role": "user", "content": item["question"]}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert item["prompt"] == rendered and rendered.startswith("<|system|>Box it.")
    assert item["prompt_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    plain = VerifiableDataModule(tok, task="arithmetic", digits=1, n_val=4, n_test=4)
    plain.setup()
    assert plain.train_set[0]["prompt"] == PROMPT.format(q=plain.train_set[0]["question"])
    tiny_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        VerifiableDataModule(tiny_tokenizer, task="arithmetic", digits=1, chat_template=True).setup()
    for experiment in ("hista_qwen25_3b", "sveb_qwen25_3b"):
        data = compose(experiment).data
        assert data.chat_template and data.system_prompt.startswith("A conversation between a User and an Assistant")
        assert data.system_prompt.endswith("in \\boxed{}.")
    assert not compose("hista_tiny").data.chat_template


def test_math_verify_reward_is_symbolic_equivalence_of_the_boxed_answer():
    """The release's accuracy reward: \\frac12 = 0.5 = \\dfrac{1}{2}; the completion's answer must be boxed or
    announced (no anchor-less guess); a GSM8K-style gold works; exact match cannot see the equivalences."""
    from lightning_modules.common.rl.rewards import boxed_math_reward as math_equivalence_reward, exact_match_reward
    from lightning_modules.common.rl.scorers import ExactMatch

    assert math_equivalence_reward("so it is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_equivalence_reward("\\boxed{0.5}", "\\dfrac{1}{2}") == 1.0
    assert exact_match_reward("\\boxed{0.5}", "\\dfrac{1}{2}") == 0.0
    assert math_equivalence_reward("\\boxed{x^2 + 2x + 1}", "(x+1)^2") == 1.0
    assert math_equivalence_reward("The answer is \\boxed{7}", "3 + 4 = 7\n#### 7") == 1.0
    assert math_equivalence_reward("\\boxed{8}", "7") == 0.0
    assert math_equivalence_reward("3 + 4 = 7, I think 7", "7") == 0.0  # no box, no anchor
    assert ExactMatch(compare="math_boxed")(["q"] * 2, ["\\boxed{2/4}", "\\boxed{3}"], ["\\frac{1}{2}", "4"]).tolist() == [1.0, 0.0]


def test_hista_recipe_runs_the_release_batch_and_sveb_its_instruct_model():
    """scripts/train/80G/math/train_qwen2.5-3B.sh: 2 processes x 4 per device x 16 accumulated = 128 completions (4
    prompts of G 32) per optimizer step, 8 served for dynamic sampling x2, 4 PPO epochs: ~3,750 steps per epoch of
    7,500 problems; math-verify reward. SVEB: Qwen2.5-3B-Instruct, the stratified math draw, math-verify."""
    from runner import compose

    cfg = compose("hista_qwen25_3b")
    per_step = cfg.data.batch_size * cfg.trainer.devices
    assert per_step * cfg.model.group_size == 128 and cfg.data.dynamic_sampling_scale == 2
    served = per_step * cfg.data.dynamic_sampling_scale
    assert abs(cfg.trainer.max_steps - 7500 / served * cfg.model.ppo_epochs) <= cfg.model.ppo_epochs
    assert cfg.model.reward.compare == "math_boxed"
    sveb = compose("sveb_qwen25_3b")
    assert sveb.backbone.pretrained == "Qwen/Qwen2.5-3B-Instruct"
    assert sveb.data._target_.endswith("SVEBDataModule") and sveb.model.reward.compare == "math_boxed"


def test_sveb_problems_are_drawn_per_pass_rate_tier(tmp_path, tiny_tokenizer):
    """The release's SVEB draw: per (lower, upper] pass-rate tier, per_tier problems (seeded), pass rates read from a
    field or from the correct / wrong response lists; gold answers kept as stored."""
    import json

    from lightning_modules.hista.data import SVEBDataModule

    rows = [{"problem": f"p{i}", "solution": f"\\frac{{{i}}}{{3}}", "pass_rate": i / 40} for i in range(40)]
    rows += [{"problem": f"q{i}", "solution": "7", "correct_responses": ["a"] * i, "wrong_responses": ["b"] * (20 - i)}
             for i in range(21)]
    test = tmp_path / "sveb.jsonl"
    test.write_text("\n".join(json.dumps(r) for r in rows))
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"problem": "t", "solution": "\\boxed{1}"}))
    dm = SVEBDataModule(tiny_tokenizer, task="math", files=str(train), test_files=str(test), per_tier=3, n_test=None,
                        val_fraction=0.0, val_files=str(train))
    dm.setup()
    picked = dm.test_set.items
    assert len(picked) == 9
    rate = {r["problem"]: r.get("pass_rate", len(r.get("correct_responses", [])) / 20) for r in rows}
    tiers = [sum(lo < rate[it["question"]] <= hi for it in picked) for lo, hi in ((0.07, 0.17), (0.17, 0.37),
                                                                                  (0.37, 0.77))]
    assert tiers == [3, 3, 3]
    stored = {r["problem"]: r["solution"] for r in rows}
    assert all(it["answer"] == stored[it["question"]] for it in picked)
    again = SVEBDataModule(tiny_tokenizer, task="math", files=str(train), test_files=str(test), per_tier=3,
                           n_test=None, val_fraction=0.0, val_files=str(train))
    again.setup()
    assert [it["question"] for it in again.test_set.items] == [it["question"] for it in picked]


def test_state_grid_counts_from_the_prompt_start_as_released():
    """The release's steps_selection lays the grid from the prompt's first token and starts the first state at the
    response start: the first response segment is min_interval - (L_p mod min_interval) tokens, the others
    min_interval, the last up to the last token; ``response`` lays it from the response start (the spec's reading)."""
    assert state_positions(7, 120, 50) == [7, 50, 100, 126]
    assert state_positions(57, 100, 50) == [57, 100, 150, 156]
    assert state_positions(100, 60, 50) == [100, 150, 159]  # a prompt on the grid: a full first segment
    assert state_positions(100, 1, 50) == [100, 100]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        P, n, mi = (int(torch.randint(1, 300, (1,), generator=g)), int(torch.randint(1, 400, (1,), generator=g)),
                    int(torch.randint(2, 60, (1,), generator=g)))
        pos = state_positions(P, n, mi)
        assert pos[0] == P and pos[-1] == P + n - 1 and pos == sorted(pos)
        inner = pos[1:-1]
        assert all(p % mi == 0 for p in inner)  # multiples of the interval from the prompt's first token
        if inner:
            assert inner[0] - P == mi - P % mi and all(b - a == mi for a, b in zip(inner, inner[1:]))
    with pytest.raises(ValueError, match="state_grid"):
        state_positions(7, 10, 5, "tokens")


def test_last_response_token_gets_zero_advantage_as_released():
    """calculate_GAE_advantages ends its segments at the last token's index, so the last response token (usually
    EOS) gets 0; every other token is unchanged. ``zero_last_token=False`` gives it R - V of its segment."""
    torch.manual_seed(1)
    reps = [torch.randn(12, 4) for _ in range(3)]
    lengths = [9, 7, 9]
    pos = [state_positions(3, n, 3) for n in lengths]
    r = torch.tensor([1.0, 0.0, 1.0])
    cfg = dict(alpha=0.7, mean_window=1, min_interval=3, d_min=1.0, max_k=4, min_k=2)
    released = hista_token_advantages(reps, pos, [3] * 3, lengths, r, 10, HistaConfig(**cfg))
    ours = hista_token_advantages(reps, pos, [3] * 3, lengths, r, 10, HistaConfig(**cfg, zero_last_token=False))
    chains = hista_values(reps, pos, r, HistaConfig(**cfg))
    for j, n in enumerate(lengths):
        assert released[j, n - 1] == 0 and torch.allclose(ours[j, n - 1], r[j] - chains[j][-2])
        assert torch.equal(released[j, :n - 1], ours[j, :n - 1]) and (released[j, n:] == 0).all()


def test_numca_sveb_value_follows_the_release_sum_of_changes():
    """sveb/numca: V(∅) plus each λ=0 segment's δ where the per-character advantage changes, before the cut. Planted
    table: V(∅)=1/2, V({3})=3/4, V({3,5})=1; the response writes 3 (char 10) and 5 (char 100), reward 1."""
    from lightning_modules.hista.numca import cut_value

    t = NumcaTable()
    for nums, r in ([["3", "5"], 1], [["3", "5"], 1], [["3"], 1], [["3"], 0], [[], 0], [[], 0]):
        t.update("p", nums, r)
    nums = [("3", 10), ("5", 100)]
    assert cut_value(t, "p", nums, 1.0, 250, 150, protocol="exact") == pytest.approx(1.0)
    # two equal δ (1/4, 1/4): no change between them, so the first is never added
    assert cut_value(t, "p", nums, 1.0, 250, 150) == pytest.approx(0.75)
    assert cut_value(t, "p", nums, 1.0, 250, 50) == pytest.approx(0.5)
    # merged within 50 characters: 3 (char 10) snaps onto 5 (char 40), past a cut at 30
    close = [("3", 10), ("5", 40)]
    assert cut_value(t, "p", close, 1.0, 250, 30, protocol="exact") == pytest.approx(0.75)
    assert cut_value(t, "p", close, 1.0, 250, 30) == pytest.approx(0.5)
    assert cut_value(t, "p", close, 1.0, 250, 45) == pytest.approx(1.0)  # both counted once the cut passes 40


def test_hista_sveb_value_is_the_node_before_the_cut_with_k_over_all_nodes():
    """sveb/hista: all m + 1 states of sample 0 are online nodes, k follows the schedule over m + 1, and the value is
    the last node before the cut's last token (a cut on the first response token wraps to the last node). Checked
    against a brute-force mean-nearest-neighbour distance."""
    from lightning_modules.hista.hista import cut_value, library

    torch.manual_seed(3)
    reps = [torch.randn(n, 3) for n in (14, 11, 16)]
    pos = [state_positions(2, n - 2, 4) for n in (14, 11, 16)]  # [2, 4, 8, 12, 13], ...
    r = torch.tensor([1.0, 0.0, 1.0])
    cfg = HistaConfig(alpha=0.7, mean_window=1, min_interval=4, d_min=0.5, max_k=5, min_k=1)
    plen, owner, node_len, returns = library(reps, pos, r, 1)

    def brute(i):
        a = int(plen[0][i])
        P = reps[0][:a]
        D = []
        for k, L in zip(owner.tolist(), node_len.tolist()):
            if k == 0 and L > a:
                D.append(float("inf"))
                continue
            C = torch.cdist(P, reps[k][:L])
            D.append(float(C.min(1).values.mean() if a >= L else C.min(0).values.mean()))
        D = torch.tensor(D)
        kk = min(5 - (5 - 1) // len(plen[0]) * i, int(torch.isfinite(D).sum()))
        idx = D.argsort(stable=True)[:kk]
        w = 1 / D[idx].clamp_min(0.5)
        return float((w * returns[idx]).sum() / w.sum())

    for cut in range(3, 13):  # prefix's last token index; node before it: the last state index < cut
        i = max(j for j, p in enumerate(pos[0]) if p < cut)
        assert cut_value(reps, pos, r, cut, cfg) == pytest.approx(brute(i), rel=1e-5)
    assert cut_value(reps, pos, r, 2, cfg) == pytest.approx(brute(len(pos[0]) - 1), rel=1e-5)  # the wrap-around
    assert cut_value(reps, pos, r, 5, cfg) == cut_value(reps, pos, r, 8, cfg)  # constant between states
    assert cut_value(reps, pos, r, 5, cfg, "exact") != pytest.approx(cut_value(reps, pos, r, 8, cfg, "exact"))


def test_knn_ties_under_d_min_are_broken_by_distance_then_node_order():
    """The release clamps to d_min before its top-k, so with more than k nodes under d_min its pick is arbitrary
    (torch.topk on ties); ours takes the nearest raw distances, equal ones in node order: deterministic."""
    from lightning_modules.hista.hista import knn_value

    D = torch.zeros(400)  # 400 identical prefixes (distance 0), the first 200 correct
    returns = torch.cat([torch.ones(200), torch.zeros(200)])
    assert knn_value(D, returns, 66, d_min=5.0) == 1.0  # the first 66 in node order
    D = torch.tensor([0.5, 0.1, 0.1, 0.3, 7.0, float("inf")])  # four under d_min = 5: same weight, pick by distance
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    assert knn_value(D, r, 1, 5.0) == 0.0 and knn_value(D, r, 2, 5.0) == 0.5  # 0.1 (node 1), then 0.1 (node 2)
    assert knn_value(D, r, 4, 5.0) == 0.5 and knn_value(D, r, 10, 5.0) == pytest.approx((2 / 5 + 1 / 7) / (4 / 5 + 1 / 7))
