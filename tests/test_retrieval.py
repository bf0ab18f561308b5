"""The cross-segment key–value retrieval generator (lightning_modules.hici.retrieval) behind lightning_modules/hici/benchmark.py."""
import pytest
import torch

from lightning_modules.hici.retrieval import KVRetrievalDataset, kv_retrieval_sample, split_vocab

VOCAB = split_vocab(2048, n_keys=4, n_values=8)


def test_split_vocab_is_disjoint_and_exact():
    keys, values, filler = (set(VOCAB[k]) for k in ("keys", "values", "filler"))
    assert len(keys) == 4 and len(values) == 8
    assert not (keys & values or keys & filler or values & filler)
    assert keys | values | filler == set(range(260, 2048))
    with pytest.raises(ValueError, match="fewer keys"):
        split_vocab(270, n_keys=4, n_values=8)


@pytest.mark.parametrize("n_pairs", [1, 3])
def test_answer_sits_in_the_first_segment_and_the_question_in_the_last(n_pairs):
    seq_len, segments = 128, 4
    seg = seq_len // segments
    for seed in range(50):
        s = kv_retrieval_sample(seq_len, segments, seed, VOCAB["keys"], VOCAB["values"], VOCAB["filler"], n_pairs)
        ids = s["input_ids"].tolist()
        assert len(ids) == seq_len
        # the queried pair: key then value, inside segment 0; the question closes the last segment
        assert s["planted_at"] // seg == 0 and (s["planted_at"] + 1) // seg == 0
        assert ids[s["planted_at"]] == s["key"] and ids[s["planted_at"] + 1] == s["answer"]
        assert s["query_at"] // seg == segments - 1 and ids[-2] == s["key"] and ids[-1] == s["answer"]
        # key format: single-token keys and values that occur nowhere else (the last segment has no trace of the
        # value before the target, so segment-local attention cannot know it)
        where_keys = [i for i, t in enumerate(ids) if t in VOCAB["keys"]]
        where_values = [i for i, t in enumerate(ids) if t in VOCAB["values"]]
        assert len(where_keys) == n_pairs + 1 and len(where_values) == n_pairs + 1
        assert all(i < seg for i in where_keys[:-1] + where_values[:-1])
        assert len({ids[i] for i in where_keys[:-1]}) == n_pairs  # distinct keys: the query is unambiguous
        assert all(ids[i + 1] in VOCAB["values"] for i in where_keys[:-1])
        # the loss sees the answer token only
        assert (s["labels"] != -100).nonzero().flatten().tolist() == [seq_len - 1]
        assert s["labels"][-1] == s["answer"]


def test_determinism_by_seed_and_variety_across_seeds():
    ds = KVRetrievalDataset(64, 64, 4, VOCAB, n_pairs=2, seed=3)
    again = KVRetrievalDataset(64, 64, 4, VOCAB, n_pairs=2, seed=3)
    other = KVRetrievalDataset(64, 64, 4, VOCAB, n_pairs=2, seed=4)
    assert all(torch.equal(ds[i]["input_ids"], again[i]["input_ids"]) for i in range(64))
    assert not all(torch.equal(ds[i]["input_ids"], other[i]["input_ids"]) for i in range(64))
    answers = [ds[i]["answer"] for i in range(64)]
    assert set(answers) == set(VOCAB["values"])  # every value is drawn: chance is 1/len(values)


def test_bad_shapes_fail_with_the_fix():
    with pytest.raises(ValueError, match="equal segments"):
        kv_retrieval_sample(130, 4, 0, VOCAB["keys"], VOCAB["values"], VOCAB["filler"])
    with pytest.raises(ValueError, match="n_pairs"):
        kv_retrieval_sample(64, 4, 0, VOCAB["keys"], VOCAB["values"], VOCAB["filler"], n_pairs=5)
