"""The shared evaluator and the synthetic long-context probes, against formulas, references and planted truth."""
from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from datamodules.synthetic import filler_text, needle_sample, passkey_sample
from lightning_modules.common.evaluation import (exact_match, greedy_generate, kl_bits_per_token, perplexity,
                                                 string_match_all, string_match_part)


class FixedLM(torch.nn.Module):
    """A 'model' whose next-token distribution is the same at every position: log-probs ``logp``."""

    def __init__(self, probs):
        super().__init__()
        self.logp = torch.nn.Parameter(torch.tensor(probs, dtype=torch.float64).log().float(), requires_grad=False)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        b, t = input_ids.shape
        return SimpleNamespace(logits=self.logp.expand(b, t, -1).clone())


@pytest.fixture(scope="module")
def tiny(tiny_lm_dir):
    from transformers import AutoModelForCausalLM

    from datamodules.common.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir)).eval()
    return model, load_tokenizer(pretrained=str(tiny_lm_dir))


# --- perplexity ------------------------------------------------------------------------------------
def test_perplexity_of_a_fixed_distribution_is_its_cross_entropy():
    probs = [0.5, 0.25, 0.125, 0.125]
    ids = torch.tensor([0, 1, 2, 3, 0, 0, 1, 3, 2, 0, 1])
    res = perplexity(FixedLM(probs), ids, seq_len=4, stride=2)
    targets = ids[1:]  # sliding: every token after the first scored once
    want = -sum(math.log(probs[t]) for t in targets.tolist()) / len(targets)
    assert res["tokens"] == len(targets)
    assert res["loss"] == pytest.approx(want, rel=1e-6) and res["ppl"] == pytest.approx(math.exp(want), rel=1e-6)
    uniform = perplexity(FixedLM([0.125] * 8), torch.arange(40) % 8, seq_len=16)
    assert uniform["ppl"] == pytest.approx(8.0, rel=1e-6)


def reference_nll(model, ids: torch.Tensor, seq_len: int, stride: int) -> tuple[float, int]:
    """The strided protocol of the transformers perplexity guide, one unpadded window at a time."""
    n, prev_end, nll, count = len(ids), 0, 0.0, 0
    for begin in range(0, n, stride):
        end = min(begin + seq_len, n)
        trg = end - prev_end
        x = ids[begin:end].unsqueeze(0)
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].double(), -1)
        tgt = x[0, 1:]
        per = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        keep = per[-trg:] if trg < len(per) else per  # the window's first token has no context in it
        nll += keep.sum().item()
        count += len(keep)
        prev_end = end
        if end == n:
            break
    return nll, count


@pytest.mark.parametrize("seq_len,stride", [(32, 8), (32, 31)])
def test_sliding_perplexity_matches_the_reference_protocol(tiny, seq_len, stride):
    model, tok = tiny
    ids = torch.tensor(tok(filler_text(tok, 100) + "Language models predict the next token.")["input_ids"][:100])
    nll, count = reference_nll(model, ids, seq_len, stride)
    res = perplexity(model, ids, seq_len=seq_len, stride=stride, batch_size=3)  # padded batches of windows
    assert res["tokens"] == count == len(ids) - 1
    assert res["loss"] == pytest.approx(nll / count, rel=1e-4)


def test_non_overlapping_perplexity_is_the_mean_of_window_losses(tiny):
    model, tok = tiny
    ids = torch.tensor(tok(filler_text(tok, 200))["input_ids"][:3 * 48])  # three full windows
    res = perplexity(model, ids, seq_len=48, batch_size=2)
    losses = [model(input_ids=w.unsqueeze(0), labels=w.unsqueeze(0)).loss.item() for w in ids.view(3, 48)]
    assert res["tokens"] == 3 * 47
    assert res["loss"] == pytest.approx(sum(losses) / 3, rel=1e-4)
    # more context never hurts a trained model on its own filler much: sliding is at most non-overlapping + slack
    assert perplexity(model, ids, seq_len=48, stride=8)["loss"] <= res["loss"] + 0.05


def test_perplexity_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stride"):
        perplexity(FixedLM([0.5, 0.5]), torch.zeros(10, dtype=torch.long), seq_len=4, stride=5)
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(FixedLM([0.5, 0.5]), torch.zeros(1, dtype=torch.long), seq_len=4)


# --- KL ----------------------------------------------------------------------------------------------
def test_kl_bits_matches_the_closed_form_and_is_asymmetric():
    q, p = [0.5, 0.5], [0.25, 0.75]
    ids = torch.zeros(2, 5, dtype=torch.long)
    want = sum(qi * math.log2(qi / pi) for qi, pi in zip(q, p))  # KL(ref=q ‖ model=p) = 0.2075 bits
    assert kl_bits_per_token(FixedLM(p), FixedLM(q), ids) == pytest.approx(want, rel=1e-5)
    reverse = sum(pi * math.log2(pi / qi) for qi, pi in zip(q, p))
    assert kl_bits_per_token(FixedLM(q), FixedLM(p), ids) == pytest.approx(reverse, rel=1e-5)
    assert want != pytest.approx(reverse, rel=1e-3)


def test_kl_is_zero_to_itself_and_masks_positions(tiny):
    model, tok = tiny
    ids = torch.tensor([tok("The sky is blue. The grass is green.")["input_ids"]])
    assert kl_bits_per_token(model, model, ids) == pytest.approx(0.0, abs=1e-6)
    noisy = type(model)(model.config).eval()
    noisy.load_state_dict(model.state_dict())
    with torch.no_grad():
        noisy.lm_head.weight.add_(0.05 * torch.randn_like(noisy.lm_head.weight))
    full = kl_bits_per_token(noisy, model, ids)
    assert full > 0
    # masking positions averages over the rest only: a manual per-position computation agrees
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    lp = torch.log_softmax(noisy(input_ids=ids, attention_mask=mask).logits.double(), -1)
    lq = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.double(), -1)
    per = (lq.exp() * (lq - lp)).sum(-1)[0, 3:] / math.log(2)
    assert kl_bits_per_token(noisy, model, ids, attention_mask=mask) == pytest.approx(per.mean().item(), rel=1e-4)


# --- generation ---------------------------------------------------------------------------------------
def manual_greedy(model, tok, prompt: str, n: int) -> str:
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return tok.decode(out, skip_special_tokens=True)


def test_greedy_generate_matches_a_manual_argmax_loop_with_left_padding(tiny):
    model, tok = tiny
    prompts = ["The sky is", "Return the number of items in a container. The", "x"]
    original = tok.padding_side
    tok.padding_side = "right"  # generation needs left padding: the function must switch and switch back
    try:
        got = greedy_generate(model, tok, prompts, max_new_tokens=8)  # prompts of different lengths: left-padded
        assert tok.padding_side == "right"  # restored
    finally:
        tok.padding_side = original
    assert got == [manual_greedy(model, tok, p, 8) for p in prompts]


# --- string scoring -------------------------------------------------------------------------------
def test_string_scoring_as_ruler_does():
    assert exact_match("  Paris. ", "paris") == 1.0
    assert exact_match("The answer: 42", "42") == 0.0
    assert exact_match("3.14", "3.14.") == 1.0 and exact_match("3.14", "314") == 0.0
    refs = ["1234567", "7654321", "1111111"]
    assert string_match_all("numbers 1234567 and 1111111", refs) == pytest.approx(2 / 3)
    assert string_match_part("numbers 1234567 and 1111111", refs) == 1.0
    assert string_match_part("none here", refs) == 0.0
    assert string_match_all("ABC", ["abc"]) == 1.0  # case-insensitive
    with pytest.raises(ValueError):
        string_match_all("x", [])


# --- synthetic probes -------------------------------------------------------------------------------
@pytest.mark.parametrize("n_tokens", [200, 600])
def test_passkey_is_seeded_sized_and_planted_at_depth(tiny, n_tokens):
    _, tok = tiny
    s = passkey_sample(tok, n_tokens, seed=7)
    assert s == passkey_sample(tok, n_tokens, seed=7)
    assert s["answer"] != passkey_sample(tok, n_tokens, seed=8)["answer"]
    assert re.fullmatch(r"\d{5}", s["answer"])
    assert s["prompt"].count(s["answer"]) == 2 and s["prompt"].endswith("The pass key is")
    assert s["n_tokens"] == len(tok(s["prompt"], add_special_tokens=False)["input_ids"])
    per = len(tok(filler_text(tok, 10_000)[:200], add_special_tokens=False)["input_ids"])
    assert n_tokens - per - 8 <= s["n_tokens"] <= n_tokens + 8  # about the asked length
    for depth in (0.0, 0.5, 1.0):
        d = passkey_sample(tok, n_tokens, seed=7, depth=depth)
        p = d["prompt"]
        body = p[p.index("\n") + 1:p.index("What is the pass key?")]  # the haystack after the intro line
        needle = f"The pass key is {d['answer']}. Remember it. {d['answer']} is the pass key."
        where = body.index(needle) / (len(body) - len(needle))  # share of the filler before the needle
        assert abs(where - depth) < 0.1, (depth, where)
        assert ". ." not in p and ".." not in p and "  " not in p


def test_needles_are_seeded_and_all_planted(tiny):
    _, tok = tiny
    for seed in range(20):
        s = needle_sample(tok, 300, seed=seed, n_needles=3)
        assert s == needle_sample(tok, 300, seed=seed, n_needles=3)
        assert len(s["needles"]) == 3 and s["needles"][s["key"]] == s["answer"]
        for word, value in s["needles"].items():
            assert f"The special magic number for {word} is: {value}." in s["prompt"]
        assert s["prompt"].endswith(f"The special magic number for {s['key']} is:")
        assert ". ." not in s["prompt"] and "  " not in s["prompt"]
        assert s["n_tokens"] <= 300 + 8
    haystack = "Alpha beta gamma. Delta epsilon. Zeta eta theta. "
    s = needle_sample(tok, 300, seed=1, haystack=haystack * 3)
    assert "Delta epsilon" in s["prompt"] and s["answer"] in s["prompt"]
    with pytest.raises(ValueError, match="too short"):
        needle_sample(tok, 10, seed=0, n_needles=3)
    with pytest.raises(ValueError, match="too short"):
        passkey_sample(tok, 10, seed=0)
