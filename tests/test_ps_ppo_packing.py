"""Packed update pass (``model.packing=true``): a micro-batch's kept prefixes as one unpadded row give the padded
pass's log-probs (1e-5) and gradients, and the bytes autograd saves follow the sum of kept tokens."""
import pytest
import torch

from lightning_modules.common.rl.advantages import compute_advantages
from lightning_modules.common.rl.module import SavedBytes
from lightning_modules.common.rl.rollouts import Rollouts, left_pad, packed_logprobs, response_logprobs
from tests.test_rl_core import tiny_policy


def rollouts(lengths, seed=0) -> Rollouts:
    g = torch.Generator().manual_seed(seed)
    prompts = [[int(x) for x in torch.randint(2, 16, (int(k),), generator=g)] for k in torch.randint(1, 6, (len(lengths),), generator=g)]
    ids, mask = left_pad(prompts, pad_id=1)
    lengths = torch.tensor(lengths)
    T = int(lengths.max())
    rmask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    resp = torch.where(rmask.bool(), torch.randint(2, 16, (len(prompts), T), generator=g), torch.ones(1, dtype=torch.long))
    ro = Rollouts(torch.cat([ids, resp], 1), torch.cat([mask, rmask.long()], 1), ids.shape[1], rmask, 3)
    ro.rewards = (torch.rand(len(prompts), generator=g) > 0.5).float()
    ro.advantages = compute_advantages("grpo", ro.rewards, 3) + 0.1  # no row without signal
    return ro


def test_packed_logprobs_equal_padded_on_kept_positions():
    model = tiny_policy(seed=3)
    ro = rollouts([9, 3, 7, 1, 12, 5])
    kept = torch.tensor([4, 0, 7, 1, 12, 2])  # row 1 keeps nothing: it must drop out of the packed row
    n = int(kept.max())
    with torch.no_grad():
        padded = response_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len, n)
        packed, valid = packed_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len, kept)
    assert torch.equal(valid.sum(1), kept) and torch.equal(valid, torch.arange(n) < kept.unsqueeze(1))
    torch.testing.assert_close(packed[valid], padded[valid], atol=1e-5, rtol=0)
    assert (packed[~valid] == 0).all()


class _Capture:
    """Stands in for the trainer: backward as plain autograd; an optimizer step records the gradient instead."""

    def __init__(self, module):
        self.module, self.grads = module, []
        module.manual_backward = lambda loss: loss.backward()
        module._step = self.step

    def step(self):
        self.grads.append(torch.cat([p.grad.reshape(-1).clone() for p in self.module.model.parameters()]))
        self.module.model.zero_grad(set_to_none=False)
        return 0.0


@pytest.mark.parametrize("method", ["grpo", "ps_ppo"])
def test_packed_update_matches_padded_loss_and_gradient(method):
    from lightning_modules.common.rl.module import RLModule
    from lightning_modules.ps_ppo import PSPPOModule

    ro = rollouts([9, 3, 7, 1, 12, 5, 10, 2, 6], seed=1)
    spec = {"family": "llama", "pretrained": None, "config": {}}
    results = {}
    for packing in (False, True):
        cls, kw = (RLModule, {}) if method == "grpo" else (PSPPOModule, dict(cutoff="mixture_full", p_full=0.2))
        m = cls(spec, micro_batch_size=4, max_new_tokens=12, ppo_epochs=2, packing=packing, measure_activations=True, **kw)
        m.model = tiny_policy(seed=4).train()
        with torch.no_grad():  # a π_old different from π_θ so ratios and clipping are exercised
            m.model.lm_head.weight.mul_(5.0)
        cap = _Capture(m)
        plans = [m.token_weights(ro, e) for e in range(2)]
        old = {k: v.clone() for k, v in m.model.state_dict().items()}
        st = m.update(ro, plans)
        m.model.load_state_dict(old)
        results[packing] = (st, torch.stack(cap.grads), plans)
    (sp, gp, plans_p), (sk, gk, plans_k) = results[False], results[True]
    for (cp, wp), (ck, wk) in zip(plans_p, plans_k):  # the same cutoffs in both runs
        assert torch.equal(cp, ck) and torch.equal(wp, wk)
    assert abs(sp["loss"] - sk["loss"]) < 1e-5
    torch.testing.assert_close(gk, gp, atol=1e-6, rtol=1e-4)
    assert sk["kept"] == sp["kept"] and sk["clipped"] == sp["clipped"]
    if method == "ps_ppo":  # truncated rows of unequal length: padding costs the longest, packing the sum
        assert sk["saved_bytes_sum"] < sp["saved_bytes_sum"] and sk["saved_bytes"] < sp["saved_bytes"]


def test_packed_saved_activations_follow_the_sum_of_kept_tokens():
    """One long row among short ones: the padded forward pays rows x longest, the packed one the sum."""
    model = tiny_policy(seed=5).train()
    ro = rollouts([24, 2, 2, 2, 2, 2], seed=2)
    kept = ro.lengths

    def saved(fn):
        with SavedBytes() as s:
            fn().sum().backward()
        return s.bytes

    pad = saved(lambda: response_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len, int(kept.max())))
    pack = saved(lambda: packed_logprobs(model, ro.input_ids, ro.attention_mask, ro.prompt_len, kept)[0])
    tokens_pad = len(ro) * (ro.prompt_len + int(kept.max()))
    tokens_pack = int(ro.prompt_lengths.sum() + kept.sum())
    assert pack < pad * (tokens_pack / tokens_pad) * 1.5 and pack < 0.6 * pad


def test_packed_micro_batches_balance_tokens():
    """Packed: as many forwards as padded, every row once, each within one row of the mean load (greedy LPT)."""
    from lightning_modules.common.rl.module import RLModule

    g = torch.Generator().manual_seed(0)
    kept, prompts = torch.randint(0, 40, (37,), generator=g), torch.randint(1, 9, (37,), generator=g)
    spec = {"family": "llama", "pretrained": None, "config": {}}
    padded = RLModule(spec, micro_batch_size=8).micro_batches(kept, prompts)
    packed = RLModule(spec, micro_batch_size=8, packing=True).micro_batches(kept, prompts)
    assert len(packed) == len(padded) == 5
    assert sorted(torch.cat(packed).tolist()) == list(range(37))
    cost = kept + prompts * (kept > 0)
    loads = [int(cost[b].sum()) for b in packed]
    assert max(loads) <= cost.sum() / len(packed) + cost.max()
    assert max(loads) < max(len(b) * int(kept[b].max() + prompts.max()) for b in padded)  # padded's largest forward
