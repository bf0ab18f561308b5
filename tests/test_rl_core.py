"""The shared RL core: advantages on hand-worked groups, PPO-clip/KL terms, answer extraction, padding-exact
log-probs, and the verifiable datamodule."""
import json
import math

import pytest
import torch

from lightning_modules.common.rl.advantages import compute_advantages
from lightning_modules.common.rl.losses import divisors, k3_kl, policy_loss, ppo_clip_terms
from lightning_modules.common.rl.rewards import exact_match_reward, extract_answer
from lightning_modules.common.rl.rollouts import left_pad, response_logprobs, response_mask_from


def tiny_policy(seed=0, vocab=16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def test_advantages_hand_worked():
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])
    std = math.sqrt(1 / 3)  # unbiased std of {1, 0, 0, 1}
    torch.testing.assert_close(compute_advantages("grpo", r, 4)[:4], torch.tensor([1, -1, -1, 1.0]) * 0.5 / (std + 1e-4))
    torch.testing.assert_close(compute_advantages("grpo", r, 4)[4:], torch.zeros(4))  # a solved group carries no signal
    torch.testing.assert_close(compute_advantages("dr_grpo", r, 4), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    # RLOO: 1 - mean(1, 0, 0) = 2/3 ; 0 - mean(1, 0, 1) = -2/3
    torch.testing.assert_close(compute_advantages("rloo", r, 4), torch.tensor([2, -2, -2, 2, 0, 0, 0, 0]) / 3.0)
    r3 = torch.tensor([3.0, 1.0, 2.0])  # RLOO = G/(G-1) (R - mean)
    torch.testing.assert_close(compute_advantages("rloo", r3, 3), 1.5 * (r3 - 2.0))
    with pytest.raises(ValueError, match="model.advantage"):
        compute_advantages("ppo", r, 4)


def test_ppo_clip_and_k3_by_hand():
    logp_old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    loss, clipped = ppo_clip_terms(logp, logp_old, torch.tensor([1.0]), 0.2, 0.28)
    torch.testing.assert_close(loss, -torch.tensor([[1.28, 0.5, 1.1]]))  # ratio 1.5 clipped at 1+eps_high
    assert clipped.tolist() == [[True, False, False]]
    loss, clipped = ppo_clip_terms(logp, logp_old, torch.tensor([-1.0]), 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor([[1.5, 0.8, 1.1]]))  # negative A: the low side clips at 1-eps_low
    assert clipped.tolist() == [[False, True, False]]
    torch.testing.assert_close(k3_kl(logp, logp), torch.zeros(1, 3))
    d = math.log(2.0)  # log pi_ref - log pi = log 2 -> 2 - log 2 - 1
    assert abs(float(k3_kl(torch.zeros(1), torch.tensor([d]))) - (1 - d)) < 1e-6


def test_aggregation_divisors_count_full_lengths():
    T = torch.tensor([2, 4])
    lp = torch.zeros(2, 4)
    w = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, 2.0])  # ratio 1 -> each token's term is -A
    seq, _ = policy_loss(lp, lp, adv, w, divisors("seq_mean", T, 8))
    assert abs(float(seq) - (-(2 * 1 / 2 + 4 * 2 / 4) / 2)) < 1e-6
    tok, _ = policy_loss(lp, lp, adv, w, divisors("token_mean", T, 8))
    assert abs(float(tok) - (-(2 + 8) / 6)) < 1e-6
    dr, _ = policy_loss(lp, lp, adv, w, divisors("dr_grpo", T, 8))
    assert abs(float(dr) - (-(2 + 8) / 16)) < 1e-6
    with pytest.raises(ValueError, match="model.aggregation"):
        divisors("seq_sum", T, 8)
    # the k3 KL term gets the same per-token weights as the policy term (PS-PPO spec 1.4)
    ref = torch.full((2, 4), math.log(0.5))
    w2 = torch.tensor([[2.0, 0.5, 0, 0], [1, 1, 3, 1]])
    kl = k3_kl(lp, ref)
    withkl, st = policy_loss(lp, lp, adv, w2, divisors("token_mean", T, 8), logp_ref=ref, beta=0.1)
    expect = ((w2 * (-adv.unsqueeze(1) + 0.1 * kl)).sum() / 6)
    assert abs(float(withkl) - float(expect)) < 1e-6 and float(st["kept"]) == 6


@pytest.mark.parametrize("text,expected", [
    ("12 + 30 = 42\n#### 42", "42"),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("It costs $18.00 in total.", "18"),        # no ####: the last number
    ("first 3 then -7", "-7"),
    ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("no digits here", None),
])
def test_extract_answer_gsm8k_format(text, expected):
    assert extract_answer(text) == expected


def test_exact_match_reward():
    assert exact_match_reward("12 + 30 = 42\n#### 42", "42") == 1.0
    assert exact_match_reward("12 + 30 = 42\n#### 41", "42") == 0.0
    assert exact_match_reward("the result is 42.0", "#### 42") == 1.0
    assert exact_match_reward("", "42") == 0.0
    assert exact_match_reward("#### -7", "7") == 0.0 and exact_match_reward("#### 6.50", "6.5") == 1.0


def test_response_mask_stops_after_first_eos():
    resp = torch.tensor([[5, 6, 0, 7, 0], [5, 5, 5, 5, 5], [0, 3, 3, 3, 3]])
    assert response_mask_from(resp, 0).tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0]]


def test_left_padding_and_truncation_give_exact_logprobs():
    """Left-padded batched log-probs equal each row alone, and a truncated forward equals the full one for t <= C."""
    model = tiny_policy()
    g = torch.Generator().manual_seed(0)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10, 11], [12]]
    ids, mask = left_pad(prompts, pad_id=1)
    T = 9
    resp = torch.randint(2, 16, (3, T), generator=g)
    full_ids, full_mask = torch.cat([ids, resp], 1), torch.cat([mask, torch.ones(3, T, dtype=torch.long)], 1)
    P = ids.shape[1]
    with torch.no_grad():
        full = response_logprobs(model, full_ids, full_mask, P, T)
        for i, p in enumerate(prompts):
            alone_ids = torch.cat([torch.tensor([p]), resp[i:i + 1]], 1)
            alone = response_logprobs(model, alone_ids, torch.ones_like(alone_ids), len(p), T)
            torch.testing.assert_close(full[i:i + 1], alone, atol=1e-5, rtol=0)
        for C in (1, 4, 8):
            torch.testing.assert_close(response_logprobs(model, full_ids, full_mask, P, C), full[:, :C], atol=1e-6, rtol=0)


def test_verifiable_problems_are_correct_and_files_load(tmp_path, tiny_tokenizer):
    from datamodules.verifiable import VerifiableDataModule, generate_problems, load_problems

    for p in generate_problems("arithmetic", 50, seed=3, digits=3, operations=("+", "-", "*")):
        expr = p["question"].removeprefix("What is ").rstrip("?")
        assert str(eval(expr)) == p["answer"] == extract_answer(p["solution"])  # noqa: S307 - our own digits
    for p in generate_problems("word_problems", 20, seed=1):
        assert extract_answer(p["solution"]) == p["answer"] and int(p["answer"]) >= 0
    assert generate_problems("arithmetic", 5, seed=7) == generate_problems("arithmetic", 5, seed=7)
    f = tmp_path / "gsm8k.jsonl"
    f.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"step\n#### {i * 3}"}) for i in range(4)) + "\n")
    assert [p["answer"] for p in load_problems("gsm8k", str(f))] == ["0", "3", "6", "9"]
    m = tmp_path / "math.jsonl"
    m.write_text(json.dumps({"problem": "p", "solution": "so \\boxed{12}"}) + "\n")
    assert load_problems("math", str(m))[0]["answer"] == "12"
    dm = VerifiableDataModule(tiny_tokenizer, task="gsm8k", files=str(f), val_files=str(f), test_files=str(f), n_val=2)
    dm.setup()
    assert len(dm.train_set) == 4 and len(dm.val_set) == 2 and len(dm.test_set) == 4
    assert dm.train_set[1]["prompt"].startswith("Question: q1") and dm.train_set[1]["prompt_ids"]
    with pytest.raises(ValueError, match="data.files"):
        VerifiableDataModule(tiny_tokenizer, task="gsm8k").setup()
    with pytest.raises(ValueError, match="data.task"):
        VerifiableDataModule(tiny_tokenizer, task="mmlu")
