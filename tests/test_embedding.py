"""The shared embedding module's instemb additions: pooling names, adapters, and metrics against references."""
import math

import pytest
import torch

from lightning_modules.common import embedding as E


def test_last_token_same_under_left_and_right_padding():
    torch.manual_seed(0)
    h = torch.randn(2, 5, 4)
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    h_left = h.clone()
    h_left[0, 2:] = h[0, :3]  # the same row, shifted to the right end
    assert torch.equal(E.pool_tokens(h, right, "last_token"), E.pool_tokens(h_left, left, "last_token"))
    assert torch.allclose(E.pool_tokens(h, right, "mean"), E.pool_tokens(h_left, left, "mean"))


def test_ndcg_and_mrr_by_hand():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.1], [0.1, 0.2, 0.3, 0.4]])
    rel = torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0]])
    dcg = 1 / math.log2(3) + 1 / math.log2(5)
    ideal = 1 + 1 / math.log2(3)
    got = E.ndcg_at_k(scores, rel, k=10)
    assert got[0].item() == pytest.approx(dcg / ideal) and got[1].item() == 0.0
    assert E.ndcg_at_k(scores, rel, k=1)[0].item() == 0.0
    assert E.mrr(scores, rel).tolist() == [0.5, 0.0]
    assert E.ranks(scores).tolist() == [[1, 2, 3, 4], [4, 3, 2, 1]]


def test_p_mrr_by_hand():
    # query 1: a document rose 4 -> 2 (-0.5), another fell 1 -> 4 (+0.75); query 2: unchanged (0)
    got = E.p_mrr([[4, 1], [3]], [[2, 4], [3]])
    assert got == pytest.approx(((2 / 4 - 1) + (1 - 1 / 4)) / 2 / 2)
    with pytest.raises(ValueError, match="no changed"):
        E.p_mrr([[]], [[]])


def test_v_measure_and_spearman_against_references():
    from scipy.stats import rankdata
    from sklearn.cluster import KMeans
    from sklearn.metrics import v_measure_score

    torch.manual_seed(0)
    labels = [0] * 10 + [1] * 10 + [2] * 10
    centres = torch.tensor([[5.0, 0], [0, 5.0], [-5.0, -5.0]])
    emb = centres[labels] + 0.1 * torch.randn(30, 2)
    assert E.kmeans_v_measure(emb, labels) == pytest.approx(1.0)  # planted, well separated
    noisy = torch.randn(30, 2)
    pred = KMeans(3, n_init=10, random_state=0).fit_predict(noisy.double().numpy())
    assert E.kmeans_v_measure(noisy, labels) == pytest.approx(v_measure_score(labels, pred))
    a, b = [1.0, 2.0, 2.0, 5.0, 3.0], [2.0, 1.0, 4.0, 9.0, 3.0]
    ra, rb = torch.tensor(rankdata(a)), torch.tensor(rankdata(b))
    by_hand = torch.corrcoef(torch.stack([ra, rb]))[0, 1].item()  # Pearson of average ranks
    assert E.spearman(a, b) == pytest.approx(by_hand)


def test_minilm_matches_sentence_transformers():
    enc = E.minilm_encoder(batch_size=2)
    texts = ["refuse the request", "what is 2 + 3 and why", "a red cube"]
    got = enc.encode(texts)
    t = enc.tokenizer(texts[:1], return_tensors="pt")
    with torch.no_grad():
        h = enc.model(**t).last_hidden_state.mean(1)
    assert torch.allclose(got[:1], torch.nn.functional.normalize(h, dim=-1), atol=1e-5)
    assert isinstance(enc, E.TextEncoder) and got.shape == (3, 384)
    try:  # the reference implementation, when installed (it is in the venv; not a [test] dependency)
        import sentence_transformers as st
    except ModuleNotFoundError:
        return
    ref = st.SentenceTransformer(E.resolve_encoder("minilm"), device="cpu").encode(texts, convert_to_tensor=True)
    assert torch.allclose(got, ref.cpu(), atol=1e-5)


def test_decode_then_encode_by_hand(tiny_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                         eos_token_id=tiny_tokenizer.eos_token_id)).eval()
    enc = E.DecodeThenEncode(model, tiny_tokenizer, max_new_tokens=3, prompt_format="{instruction} {text}")
    texts = ["a red cube", "the kitchen has a much longer description here"]
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    got = enc.encode(texts, "Colour?")
    assert got.shape == (2, 32) and 1 <= len(calls) <= 4  # a prefill, then one forward per generated token
    for i, t in enumerate(texts):  # one at a time, no padding: greedy tokens, then the mean of their states
        ids = torch.tensor([tiny_tokenizer("Colour? " + t, add_special_tokens=False)["input_ids"]])
        gen = []
        for _ in range(3):
            nxt = model(torch.cat([ids, torch.tensor([gen], dtype=torch.long)], 1)).logits[0, -1].argmax().item()
            gen.append(nxt)
            if nxt == tiny_tokenizer.eos_token_id:
                break
        full = torch.cat([ids, torch.tensor([gen])], 1)
        with torch.no_grad():
            h = model(full, output_hidden_states=True).hidden_states[-1][0]
        fed = [ids.shape[1] + j for j, g in enumerate(gen) if g != tiny_tokenizer.eos_token_id]  # EOS ends it
        expect = h[fed].mean(0) if fed else h[ids.shape[1] - 1]
        assert torch.allclose(got[i], expect, atol=1e-4), i
