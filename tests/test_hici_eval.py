"""HiCI's evaluation arms and data on tiny synthetic files: the PG-19/Proof-pile test stream (distinct from the
training data, document counts, length filter and cut), the shard-streamed training data, the release's perplexity
protocol, the passkey grid, LongBench's metrics and runner, topic retrieval, the SFT data and the SFT start."""
import json
import math

import numpy as np
import pytest
import torch

from tests.test_hici import TINY, tiny_model


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture()
def docs(tmp_path):
    """Training docs and test docs with disjoint vocabularies, the test docs of planted lengths."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": f"doc {i} alpha beta gamma " * 40} for i in range(30)])
    test_words = [8, 40, 3, 60, 50]  # words per test document
    test = write_jsonl(tmp_path / "test.jsonl", [{"text": " ".join(["zebra"] * n)} for n in test_words])
    return train, test, test_words


def test_eval_stream_counts_filters_and_cuts(tiny_tokenizer, docs):
    from lightning_modules.hici.data import eval_stream

    _, test, words = docs
    n_tok = [len(tiny_tokenizer(" ".join(["zebra"] * n), add_special_tokens=False)["input_ids"]) for n in words]
    eos = tiny_tokenizer.eos_token_id
    every = eval_stream(test, tiny_tokenizer)
    assert len(every) == sum(n_tok) + len(words) and (every == eos).sum() == len(words)
    # Proof-pile style: the first 2 documents of >= min tokens, each cut to max tokens
    lo = sorted(n_tok)[2]  # three documents qualify, in file order the 2nd, 4th, 5th
    cut = eval_stream(test, tiny_tokenizer, documents=2, min_tokens=lo, max_tokens=lo)
    qualifying = [n for n in n_tok if n >= lo][:2]
    assert len(cut) == 2 * (lo + 1) and len(qualifying) == 2
    with pytest.raises(ValueError, match="fewer than data.test_documents=4"):
        eval_stream(test, tiny_tokenizer, documents=4, min_tokens=lo)


def test_long_context_data_scores_the_test_files_not_the_training_files(tiny_tokenizer, docs):
    from lightning_modules.hici.data import LongContextDataModule

    train, test, _ = docs
    zebra = set(tiny_tokenizer("zebra zebra", add_special_tokens=False)["input_ids"])
    dm = LongContextDataModule(tiny_tokenizer, source="files", files=str(train), seq_len=64, test_files=str(test),
                               val_fraction=0.2)
    dm.setup()
    stream = set(dm.eval_tokens().tolist()) - {tiny_tokenizer.eos_token_id}
    assert stream == zebra
    assert not zebra & set(np.asarray(dm.train_set.tokens).tolist())
    held = LongContextDataModule(tiny_tokenizer, source="files", files=str(train), seq_len=64, val_fraction=0.2)
    assert not zebra & set(held.eval_tokens().tolist())  # without test_files: the held-out training split
    with pytest.raises(ValueError, match="test_documents"):
        LongContextDataModule(tiny_tokenizer, test_documents=0)


def test_shard_data_streams_windows_from_memmaps_and_scores_the_test_files(tiny_tokenizer, docs, tmp_path):
    from datamodules.common.shards import TokenShards
    from lightning_modules.hici.data import LongContextShardDataModule

    train, test, _ = docs
    dm = LongContextShardDataModule(tiny_tokenizer, files=str(train), shard_dir=str(tmp_path / "shards"), seq_len=32,
                                    val_fraction=0.1, test_fraction=0.1, test_files=str(test), test_documents=2,
                                    progress=False)
    dm.setup()
    assert isinstance(dm.train_set, TokenShards) and isinstance(dm.train_set.shard(0), np.memmap)
    assert dm.eval_tokens().numel() > 0 and (dm.eval_tokens() == tiny_tokenizer.eos_token_id).sum() == 2
    no_test = LongContextShardDataModule(tiny_tokenizer, files=str(train), shard_dir=str(tmp_path / "shards"),
                                         seq_len=32, val_fraction=0.1, test_fraction=0.1, progress=False)
    assert len(no_test.eval_tokens()) == no_test.test_set.tokens  # the test shards joined


def test_release_perplexity_scores_every_window_fully_and_shards_evenly():
    from lightning_modules.hici.module import release_perplexity

    model = tiny_model("llama")
    tokens = torch.randint(0, 97, (100,), generator=torch.Generator().manual_seed(3))
    length, stride = 32, 16
    nll, n = 0.0, 0
    for s in range(0, 100 - length, stride):  # the release: range(0, len - L, stride), every target of the window
        logp = torch.log_softmax(model(input_ids=tokens[None, s:s + length]).logits[0, :-1].float(), -1)
        nll -= logp.gather(-1, tokens[s + 1:s + length, None]).sum().item()
        n += length - 1
    assert release_perplexity(model, tokens, length, stride) == (pytest.approx(nll, rel=1e-10), n)
    calls = []
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    parts = []
    for rank in range(3):
        calls.clear()
        parts.append((release_perplexity(model, tokens, length, stride, (rank, 3)), len(calls)))
    hook.remove()
    assert len({c for _, c in parts}) == 1
    assert sum(p[1] for p, _ in parts) == n and sum(p[0] for p, _ in parts) == pytest.approx(nll, rel=1e-10)


def test_passkey_grid_is_the_release_interval_up_to_the_max():
    from lightning_modules.hici.module import EVAL_DEFAULTS, passkey_grid

    grid = passkey_grid({**EVAL_DEFAULTS, "passkey_lengths": [100], "passkey_interval": 1024, "passkey_max_length": 57344})
    assert grid[0] == 100 and grid[1:] == [1024 * k for k in range(1, 57)] and grid[-1] == 57344


def test_longbench_metrics_against_hand_computed_values():
    from lightning_modules.hici import longbench as lb

    # F1: normalized tokens "cat sat" vs "cat sat on mat": precision 1, recall 1/2
    assert lb.qa_f1("The cat sat.", "a cat sat on the mat") == pytest.approx(2 * 1 * 0.5 / 1.5)
    # ROUGE-L: LCS of "a b c d" and "a c d e" is 3 -> P = R = 3/4
    assert lb.rouge_l("a b c d", "A C D E") == pytest.approx(0.75)
    assert lb.classification("Answer: Location or Number", "Location", ["Location", "Number", "Person"]) == 0.5
    assert lb.classification("Answer: Person", "Location", ["Location", "Person"]) == 0.0
    assert lb.retrieval("Paragraph 3, or maybe 7", "Paragraph 3") == 0.5
    assert lb.count("There are 4 unique paragraphs, not 5 or 4", "4") == pytest.approx(2 / 3)
    assert lb.code_sim("```\n# comment\nx = foo(1)\n", "x = foo(1)") == 1.0
    assert lb.score("trec", "\nLocation\nNumber", ["Location"], ["Location", "Number"]) == 1.0  # first line only
    assert lb.score("hotpotqa", "Paris", ["London", "paris"]) == 1.0  # best over the references
    with pytest.raises(ValueError, match="jieba"):
        lb.check_tasks(["dureader"])


def test_longbench_prompt_keeps_both_ends_and_chats_only_non_fewshot_tasks(tiny_tokenizer):
    from lightning_modules.hici import longbench as lb

    rec = {"context": " ".join(f"w{i}" for i in range(300)), "input": "q?"}
    p = lb.build_prompt(tiny_tokenizer, "hotpotqa", "{context} Q: {input}", rec, 40, "[INST]{prompt}[/INST]")
    assert p.startswith("[INST]w0") and p.endswith("Q: q?[/INST]")
    assert len(tiny_tokenizer(p[6:-7], add_special_tokens=False)["input_ids"]) <= 42
    assert not lb.build_prompt(tiny_tokenizer, "trec", "{context}", {"context": "x"}, 40, "[INST]{prompt}[/INST]").startswith("[INST]")


def test_topics_rule_and_layout(tmp_path):
    from lightning_modules.hici import topics

    assert topics.correct("the psychology of creativity. ", ["The psychology of creativity", "Art"]) == 1.0
    assert topics.correct("art", ["The psychology of creativity", "Art"]) == 0.0
    assert topics.num_topics(tmp_path / "15_topics.jsonl") == 15
    bad = write_jsonl(tmp_path / "5_topics.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match="topics"):
        topics.load(bad)


def test_generation_benchmarks_score_a_planted_answer(tiny_tokenizer, tmp_path, monkeypatch):
    """The runner end to end on tiny files, the model's generation replaced by a planted one: a sample whose answer
    is generated scores 100 (LongBench) / 1 (topics), one whose is not 0."""
    from lightning_modules.common import evaluation
    from lightning_modules.hici.module import HiCILongContextLM

    data, cfg = tmp_path / "data", tmp_path / "config"
    data.mkdir(), cfg.mkdir()
    write_jsonl(data / "hotpotqa.jsonl", [{"context": "c1", "input": "who", "answers": ["Ada"], "all_classes": None},
                                          {"context": "c2", "input": "who", "answers": ["Bob"], "all_classes": None}])
    (cfg / "dataset2prompt.json").write_text(json.dumps({"hotpotqa": "{context} Q: {input}"}))
    (cfg / "dataset2maxlen.json").write_text(json.dumps({"hotpotqa": 4}))
    write_jsonl(tmp_path / "5_topics.jsonl", [{"prompt": "talk", "topics": ["Ada"]}])
    answers = {"[INST]c1 Q: who[/INST]": "Ada", "[INST]c2 Q: who[/INST]": "Carl", "[INST]talk[/INST]": "ada."}
    monkeypatch.setattr(evaluation, "greedy_generate", lambda m, t, prompts, n, **kw: [answers[prompts[0]]])
    module = HiCILongContextLM({"family": "llama"}, evaluation={"longbench_dir": str(data), "longbench_config_dir": str(cfg),
                               "longbench_tasks": ["hotpotqa"], "topics_files": str(tmp_path / "*_topics.jsonl")})
    out = module.generation_benchmarks(tiny_tokenizer, 0, 1, lambda *v: list(v))
    assert out == {"longbench/hotpotqa": 50.0, "longbench/avg": 50.0, "topics@5": 1.0}


def test_sft_data_masks_the_prompt_and_pads_to_the_multiple(tiny_tokenizer, tmp_path):
    from lightning_modules.hici.data import LongAlpacaDataModule, pad_collate

    recs = [{"instruction": f"summarize doc {i}", "output": f"summary {i}"} for i in range(40)]
    (tmp_path / "la.json").write_text(json.dumps(recs))
    dm = LongAlpacaDataModule(tiny_tokenizer, files=str(tmp_path / "la.json"), template="Q: {instruction} A:",
                              seq_len=64, pad_multiple=16, val_fraction=0.2, test_fraction=0.2, batch_size=2)
    dm.setup()
    assert len(dm.train_set) + len(dm.val_set) + len(dm.test_set) == 40 and len(dm.val_set) > 0 and len(dm.test_set) > 0
    instructions = [{r["instruction"] for r in part.records} for part in (dm.train_set, dm.val_set, dm.test_set)]
    assert not (instructions[0] & instructions[1] or instructions[0] & instructions[2] or instructions[1] & instructions[2])
    item = dm.train_set[0]
    r = dm.train_set.records[0]
    n_prompt = len(tiny_tokenizer(f"Q: {r['instruction']} A:", add_special_tokens=False)["input_ids"])
    assert (item["labels"][:n_prompt] == -100).all() and (item["labels"][n_prompt:] >= 0).all()
    assert item["input_ids"][-1] == tiny_tokenizer.eos_token_id  # the answer ends in EOS
    batch = pad_collate([dm.train_set[0], dm.train_set[1]], pad_id=0, multiple=16)
    assert batch["input_ids"].shape[1] % 16 == 0
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    with pytest.raises(ValueError, match="instruction"):
        LongAlpacaDataModule(tiny_tokenizer, files="x", template="no field")


def test_sft_records_are_tokenized_as_the_release_does():
    """fine-tune_hici_sft.py formats an instruction as ``[INST]{instruction}[/INST]`` and tokenizes it with the
    tokenizer's own special tokens (Llama-2: BOS first); the answer follows with EOS; BOS and prompt carry no loss."""
    from transformers import AutoTokenizer

    from datamodules.common.family_tokenizers import family_tokenizer_dir, flavour_of
    from lightning_modules.hici.data import InstructionPairs

    tok = AutoTokenizer.from_pretrained(family_tokenizer_dir(*flavour_of("meta-llama/Llama-2-7b-hf")))
    pairs = InstructionPairs([{"instruction": "Summarize the book.", "output": "A long tale."}], tok,
                             "[INST]{instruction}[/INST]", 512)
    plain = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = [tok.bos_token_id] + plain("[INST]Summarize the book.[/INST]")
    item = pairs[0]
    assert item["input_ids"].tolist() == prompt + plain("A long tale.") + [tok.eos_token_id]
    assert (item["labels"][:len(prompt)] == -100).all() and (item["labels"][len(prompt):] >= 0).all()


def test_an_sft_batch_whose_answers_are_cut_off_trains_nothing_instead_of_nan(tiny_tokenizer):
    """A record whose prompt fills seq_len keeps no answer token (truncated at the end, as the release does): with
    batch size 1 the micro-batch has no target and the token mean is 0/0. It must give loss 0 and zero gradients
    (NaN stopped hici_llama7b_sft's dry run at step 0), while a batch with targets keeps transformers' loss."""
    from lightning_modules.hici.data import InstructionPairs, pad_collate
    from lightning_modules.hici.module import HiCILongContextLM

    recs = [{"instruction": "long " * 80, "output": "cut"}, {"instruction": "q", "output": "a"}]
    pairs = InstructionPairs(recs, tiny_tokenizer, "[INST]{instruction}[/INST]", 32)
    empty, full = (pad_collate([pairs[i]], pad_id=0, multiple=16) for i in (0, 1))
    assert (empty["labels"] == -100).all() and (full["labels"] != -100).any()
    spec = {"family": "llama", "config": dict(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64)}
    module = HiCILongContextLM(spec, hici=TINY, attention="full")
    module.configure_model()
    loss = module.compute_loss(empty)
    loss.backward()
    assert loss.item() == 0.0 and all(torch.isfinite(p.grad).all() and not p.grad.any()
                                      for p in module.model.parameters() if p.grad is not None)
    ref = module.model(input_ids=full["input_ids"], attention_mask=full["attention_mask"], labels=full["labels"]).loss
    assert torch.isfinite(ref) and module.compute_loss(full).item() == pytest.approx(ref.item())


def test_init_from_loads_a_trained_modules_weights(tmp_path):
    from lightning_modules.hici.module import HiCILongContextLM

    spec = {"family": "llama", "config": dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)}
    torch.manual_seed(0)
    a = HiCILongContextLM(spec, hici=TINY)
    a.configure_model()
    with torch.no_grad():
        for p in a.model.parameters():
            p.add_(torch.randn_like(p))
    torch.save({"state_dict": a.state_dict()}, tmp_path / "hici.ckpt")
    torch.manual_seed(1)
    b = HiCILongContextLM(spec, hici=TINY, init_from=str(tmp_path / "hici.ckpt"))
    b.configure_model()
    for (k, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), k
    with pytest.raises(ValueError, match="single-file"):
        HiCILongContextLM(spec, init_from=str(tmp_path))


def test_sft_stage_starts_from_the_hici_run_and_scores_longbench_and_topics(tmp_path, tiny_lm_dir):
    """The SFT arm end to end on tiny files: fit hici_tiny, then the SFT stage on LongAlpaca-style records from its
    Lightning checkpoint (model.init_from), whose test loop runs LongBench and topic retrieval from local jsonl."""
    from tests.helpers import run_experiment
    from tests.test_hici import SMOKE

    run_experiment("hici_tiny", tmp_path / "stage1", overrides=SMOKE)
    ckpt = tmp_path / "stage1" / "checkpoints" / "last.ckpt"
    recs = [{"instruction": f"Repeat the number {i}.", "output": f"{i}"} for i in range(60)]
    (tmp_path / "la.json").write_text(json.dumps(recs))
    lb, cfg = tmp_path / "lb", tmp_path / "cfg"
    lb.mkdir(), cfg.mkdir()
    write_jsonl(lb / "passage_count.jsonl", [{"context": "a b a", "input": "", "answers": ["2"], "all_classes": None}] * 2)
    (cfg / "dataset2prompt.json").write_text(json.dumps({"passage_count": "{context} How many? {input}"}))
    (cfg / "dataset2maxlen.json").write_text(json.dumps({"passage_count": 4}))
    write_jsonl(tmp_path / "5_topics.jsonl", [{"prompt": "We talked about cats.", "topics": ["cats"]}])
    value, metrics = run_experiment("hici_tiny", tmp_path / "sft", overrides=[
        *SMOKE, "data=long_alpaca", f"data.files={tmp_path / 'la.json'}", "data.pad_multiple=16", "data.val_fraction=0.1", "data.test_fraction=0.1",
        f"model.init_from={ckpt}", "model.evaluation.ppl_lengths=[]", "model.evaluation.passkey_samples=0",
        f"model.evaluation.longbench_dir={lb}", f"model.evaluation.longbench_config_dir={cfg}",
        "model.evaluation.longbench_tasks=[passage_count]", f"model.evaluation.topics_files={tmp_path}/*_topics.jsonl"])
    res = metrics["results"]
    assert metrics["status"] == "ok" and math.isfinite(value)
    assert 0 <= res["longbench/passage_count"] <= 100 and res["longbench/avg"] == res["longbench/passage_count"]
    assert res["topics@5"] in (0.0, 1.0)
    with pytest.raises(FileNotFoundError, match="init_from"):  # no stage-1 weights: refused before training
        run_experiment("hici_tiny", tmp_path / "none", overrides=[*SMOKE, f"model.init_from={tmp_path / 'no.ckpt'}"])


def test_13b_runs_carry_the_release_widths_and_build_on_meta():
    """13B: 40 bottleneck heads (README table), bottleneck/expander 640 = hidden/8 and compressor 160 = hidden/32
    (the 7B's 512 and 128 scaled), in every 13B experiment; the modules build (40 heads divide 640)."""
    from omegaconf import OmegaConf

    from lightning_modules.common.backbone import build_backbone, count_parameters
    from lightning_modules.hici.module import attach_hici
    from tests.helpers import compose
    from tests.test_hici import spec_params_per_layer

    for name in ("hici_llama13b", "hici_llama13b_16k", "hici_llama13b_topics"):
        cfg = compose(name)
        h = OmegaConf.to_container(cfg.model.hici, resolve=True)
        assert (cfg.backbone.config.hidden_size, h["heads"], h["bottleneck_dim"], h["expand_dim"], h["compress_dim"]) == (
            5120, 40, 640, 640, 160), name
    model = build_backbone(OmegaConf.to_container(cfg.backbone, resolve=True), meta=True)
    base = count_parameters(model)
    attach_hici(model, h)
    local, glob = spec_params_per_layer(5120, db=640, c=160, d=640)
    assert count_parameters(model) - base == 40 * (local + glob)
    assert model.model.layers[0].self_attn.local_constructor.dh == 16
