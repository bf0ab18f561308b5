"""datamodules/instruct.py: generators, local pairs with file:line errors, prompt-masked batches, the cycling loader;
and the warm-up on any registered task."""
import json

import pytest

from datamodules.common.splits import split_of
from datamodules.instruct import (apply_template, cycling_loader, generate, get_generator, load_pairs,
                                  register_generator, sft_batch)


def test_sft_batch_masks_prompt_and_padding(tiny_tokenizer):
    tok = tiny_tokenizer
    pairs = [{"prompt": "Question: 2 + 3?\nAnswer:", "response": " 5"},
             {"prompt": "Hi", "response": " a much longer answer here"}]
    b = sft_batch(tok, pairs)
    for i, p in enumerate(pairs):
        prompt = tok(p["prompt"], add_special_tokens=False)["input_ids"]
        answer = tok(p["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = len(prompt) + len(answer)
        assert b["input_ids"][i, :n].tolist() == prompt + answer
        assert b["labels"][i, :n].tolist() == [-100] * len(prompt) + answer
        assert (b["labels"][i, n:] == -100).all() and b["attention_mask"][i].sum() == n
    cut = sft_batch(tok, pairs, max_length=4)
    assert cut["input_ids"].shape[1] == 4


def test_load_pairs_and_missing_field(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "Do x", "input": "on y", "safe": "No."}) + "\n"
                    + json.dumps({"prompt": "Do z", "input": "", "safe": "Never."}) + "\n")
    pairs = load_pairs(good, "prompt", "safe", "input", template="question")
    assert [p["instruction"] for p in pairs] == ["Do x on y", "Do z"]
    assert pairs[0]["prompt"] == apply_template("question", "Do x on y") and pairs[1]["response"] == "Never."
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "safe": "b"}) + "\n\n" + json.dumps({"prompt": "c"}) + "\n")
    with pytest.raises(ValueError, match=rf"{bad}:3: record has no field 'safe'"):
        load_pairs(bad, "prompt", "safe")
    with pytest.raises(ValueError, match="template"):
        apply_template("no placeholder", "x")


def test_a_merged_gsm8k_metamathqa_file_reads_through_spards_fields(tmp_path):
    """SPARD's training file is GSM8K + MetaMathQA: GSM8K's question / answer and MetaMathQA's query / response
    (issue 37: it was read as question / answer only). The paper config's field alternatives read both layouts,
    and a record with neither fails with file:line naming the alternatives."""
    from tests.helpers import compose

    files = compose("spard_qwen25_7b_gsm8k").data.files
    fields = (list(files.prompt_field), list(files.response_field))
    merged = tmp_path / "train.jsonl"
    merged.write_text(json.dumps({"question": "2 + 3?", "answer": "2 + 3 = 5\n#### 5"}) + "\n"
                      + json.dumps({"query": "3 x 6?", "response": "3 x 6 = 18\nThe answer is: 18",
                                    "type": "GSM_Rephrased", "original_question": "3 x 6?"}) + "\n")
    pairs = load_pairs(merged, *fields)
    assert [(p["instruction"], p["response"]) for p in pairs] == [("2 + 3?", "2 + 3 = 5\n#### 5"),
                                                                   ("3 x 6?", "3 x 6 = 18\nThe answer is: 18")]
    metamath = tmp_path / "metamath" / "MetaMathQA-395K.json"  # released as one JSON array, read from its folder
    metamath.parent.mkdir()
    metamath.write_text(json.dumps([{"query": "1 + 1?", "response": "The answer is: 2", "type": "GSM_AnsAug",
                                     "original_question": "1 + 1?"}]))
    assert [p["response"] for p in load_pairs(metamath.parent, *fields)] == ["The answer is: 2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"query": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "c", "answer": "d"}) + "\n")
    with pytest.raises(ValueError, match=rf"{bad}:2: record has no field 'question' / 'query'"):
        load_pairs(bad, *fields)


def test_cycling_loader_covers_subset_each_pass():
    items = list(range(100))
    it = cycling_loader(items, 3, indices=[5, 7, 9, 11, 13, 15], seed=1)
    first, second = [next(it) for _ in range(2)], [next(it) for _ in range(2)]
    assert sorted(sum(first, [])) == [5, 7, 9, 11, 13, 15] == sorted(sum(second, []))
    small = cycling_loader(items, 4, indices=[1, 2], seed=0)
    assert sorted(next(small)) == [1, 2] and sorted(next(small)) == [1, 2]
    with pytest.raises(ValueError, match="empty subset"):
        next(cycling_loader(items, 2, indices=[]))


def test_generators_registry_and_splits():
    pairs = generate("arithmetic", 50, 0, "train", 0.2, 0.2, digits=1)
    assert all(p["prompt"].startswith("Question: ") and p["response"].startswith(" ") for p in pairs)
    assert all(split_of(p["key"], 0.2, 0.2) == "train" for p in pairs)

    @register_generator("echo_test")
    def echo(n, seed, split=None, val_fraction=0.0, test_fraction=0.0, word="x"):
        return [{"prompt": word, "response": f" {word}{i}"} for i in range(n)]

    assert generate("echo_test", 2, 0, word="y") == [{"prompt": "y", "response": " y0"}, {"prompt": "y", "response": " y1"}]
    assert get_generator("vault")  # provided by lightning_modules.spard.data, imported on first use
    with pytest.raises(ValueError, match="no instruction generator 'nope'"):
        get_generator("nope")


def test_warmup_takes_any_registered_task():
    from lightning_modules.common.rl.warmup import warmup_key, warmup_problems

    cfg = {"task": "spard_aligned", "steps": 4, "batch_size": 8, "seed": 0, "refuse_fraction": 0.5,
           "val_fraction": 0.2, "test_fraction": 0.2}
    pairs = warmup_problems(cfg)
    assert len(pairs) == 32 and {p.get("style") is not None for p in pairs} == {True, False}
    assert all(split_of(p["key"], 0.2, 0.2) == "train" for p in pairs)
    spec = {"family": "llama", "pretrained": "/x"}
    assert warmup_key(spec, cfg) != warmup_key(spec, {**cfg, "refuse_fraction": 0.4})
