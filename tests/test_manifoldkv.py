"""ManifoldKV: the RULER-style suite (planted answers, lengths, real-file loading) and the tiny experiment end to end."""
import json
import math
import re
from collections import Counter

import pytest

from datamodules.ruler import TASKS, RulerDataModule, encode, load_ruler_files, ruler_sample


@pytest.fixture(scope="module")
def tok(tiny_lm_dir):
    from datamodules.common.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_lm_dir))


def n_tokens(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("task", TASKS)
def test_ruler_sample_plants_its_answer_within_the_length(tok, task):
    s = ruler_sample(task, tok, 400, seed=3)
    assert s == ruler_sample(task, tok, 400, seed=3)  # deterministic in the seed
    assert s != ruler_sample(task, tok, 400, seed=4)
    total = n_tokens(tok, s["context"] + s["question"] + s["answer_prefix"])
    assert 300 < total <= 400
    for ref in s["outputs"]:
        assert ref in s["context"] and ref not in s["question"] + s["answer_prefix"]
    if task == "niah_multikey_2" or task == "niah_multikey_3":
        key = re.search(r"for (\S+) mentioned", s["question"]).group(1)
        assert s["context"].count(f"for {key} is:") == 1  # many distractor needles, one with the asked key
        assert s["context"].count("One of the special magic") >= 2  # the rest of the haystack is distractor needles
        assert "The grass is green" not in s["context"]
    if task == "niah_multivalue" or task == "niah_multiquery":
        assert len(s["outputs"]) == 4
    if task == "vt":
        chain = re.findall(r"VAR (\w+) = ", s["context"])
        assert chain == s["outputs"] and len(chain) == 5  # in assignment order
    if task == "cwe":
        counts = Counter(re.findall(r"\d+\. (\w+)", s["context"]))
        top = {w for w, _ in counts.most_common(10)}
        assert top == set(s["outputs"]) and min(counts[w] for w in top) > max(
            c for w, c in counts.items() if w not in top)


def test_ruler_lengths_scale_and_short_lengths_fail_clearly(tok):
    short = ruler_sample("niah_single", tok, 300, 0)
    long = ruler_sample("niah_single", tok, 900, 0)
    assert n_tokens(tok, long["context"]) > 2.5 * n_tokens(tok, short["context"])
    with pytest.raises(ValueError, match="too short"):
        ruler_sample("niah_multiquery", tok, 40, 0)
    with pytest.raises(ValueError, match="unknown task"):
        ruler_sample("qa_1", tok, 400, 0)


def test_encode_appends_question_and_answer_prefix_after_the_context(tok):
    s = ruler_sample("niah_single", tok, 300, 0)
    e = encode(s, tok)
    assert tok.decode(e["question_ids"]) == s["question"] + s["answer_prefix"]
    assert tok.decode(e["gold_ids"]).strip() == s["outputs"][0]
    assert e["context_ids"].numel() + e["question_ids"].numel() <= 302


def test_chat_template_keeps_the_question_after_the_compressed_context(tok):
    import copy

    chat = copy.deepcopy(tok)
    chat.chat_template = ("{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}"
                          "{% if add_generation_prompt %}<assistant>{% endif %}")
    s = ruler_sample("niah_single", tok, 300, 0)
    e = encode(s, chat, chat_template=True)
    context, question = chat.decode(e["context_ids"]), chat.decode(e["question_ids"])
    assert context.startswith("<user>") and s["question"] not in context and s["outputs"][0] in context
    assert question == s["question"] + "</user><assistant>" + s["answer_prefix"]


def test_real_ruler_files_load_and_bad_files_name_the_fix(tmp_path, tok):
    rec = {"context": "The code is 123.", "question": " What is the code?", "answer_prefix": " The code is",
           "answer": ["123"], "task": "qa_1", "max_new_tokens": 8}
    path = tmp_path / "ruler.jsonl"
    path.write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "answer": ["9"], "task": "vt"}) + "\n")
    rows = load_ruler_files(str(path))
    assert [r["outputs"] for r in rows] == [["123"], ["9"]] and rows[0]["task"] == "qa_1"
    dm = RulerDataModule(tok, tasks=["vt"], source="files", files=str(path))
    dm.setup()
    assert len(dm.samples) == 1 and dm.samples[0]["task"] == "vt"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input": "x", "outputs": ["1"]}) + "\n")
    with pytest.raises(ValueError, match="context, question, task"):
        load_ruler_files(str(bad))
    with pytest.raises(ValueError, match="data.files"):
        RulerDataModule(tok, source="files")


def test_eval_module_scores_planted_answers_with_string_match(tiny_lm_dir, tok):
    """An oracle backbone wrapper that emits the gold answer must score 100; the tiny model itself scores ~0."""
    from lightning_modules.manifoldkv.module import KVPressEvalModule

    module = KVPressEvalModule(backbone={"family": "llama", "pretrained": str(tiny_lm_dir)},
                               press={"name": "manifoldkv", "compression_ratio": 0.5}, max_new_tokens=2)
    module.configure_model()
    dm = RulerDataModule(tok, tasks=["niah_single", "vt"], lengths=[256], samples_per_task=1)
    dm.setup()
    module._tokenizer = lambda: tok
    module.log = lambda name, value, **kw: logged.__setitem__(name, float(value))
    logged = {}
    import lightning_modules.manifoldkv.module as mod

    real = mod.prefill_and_answer

    def oracle(model, press, context_ids, questions, **kw):
        out = real(model, press, context_ids, questions, **kw)
        out.answers = [tok(" " + ", ".join(current["outputs"]), add_special_tokens=False)["input_ids"]]
        return out

    module.on_test_epoch_start()
    mod.prefill_and_answer = oracle
    try:
        for current in dm.samples:
            module.test_step(current, 0)
    finally:
        mod.prefill_and_answer = real
    module.on_test_epoch_end()
    assert logged["test/accuracy"] == 100.0
    assert logged["test/kv_kept_fraction"] == pytest.approx(0.5, abs=0.01)
    assert set(module.results["retained_fraction_per_head"]) == {"0", "1", "2", "3"}


def test_manifoldkv_tiny_smoke(tmp_path):
    from tests.helpers import run_experiment

    value, metrics = run_experiment("manifoldkv_tiny", tmp_path)
    assert metrics["status"] == "ok"
    final = metrics["final"]
    assert 0.0 <= value <= 100.0 and math.isfinite(final["test/answer_nll"])
    assert final["test/kv_kept_fraction"] == pytest.approx(0.5, abs=0.01)  # ratio 0.5 -> int(L/2) per head
    assert final["test/prefill_ms"] > 0 and final["test/decode_ms_per_token"] > 0
    results = metrics["results"]
    assert results["press"]["name"] == "manifoldkv" and len(results["accuracy_per_task"]) == 2  # smoke: 2 batches
    assert all(abs(f - 0.5) < 0.01 for head in results["retained_fraction_per_head"].values() for f in head)
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # an evaluation writes no checkpoint


def test_paper_scale_experiments_compose_with_the_papers_settings():
    from tests.helpers import compose

    for name, pretrained in (("manifoldkv_llama31_8b", "meta-llama/Llama-3.1-8B-Instruct"),
                             ("manifoldkv_qwen3_8b", "Qwen/Qwen3-8B")):
        cfg = compose(name)
        assert cfg.backbone.pretrained == pretrained and cfg.task == "test"
        assert list(cfg.data.lengths) == [4096, 8192, 16384]
        assert cfg.model.press.name == "manifoldkv" and cfg.model.press.compression_ratio == 0.2
        assert cfg.model.press.wrapper == "adakv" and cfg.model.press.alpha_safeguard == 0.2


@pytest.mark.parametrize("sweep,experiment,n_jobs", [("manifoldkv_ruler", "manifoldkv_llama31_8b", 60),
                                                     ("manifoldkv_multikey", "manifoldkv_qwen3_8b", 4),
                                                     ("manifoldkv_64k", "manifoldkv_llama31_8b", 8),
                                                     ("manifoldkv_distance", "manifoldkv_llama31_8b", 4),
                                                     ("manifoldkv_tiny_grid", "manifoldkv_tiny", 24)])
def test_sweeps_parse_and_every_job_composes_to_a_valid_press(sweep, experiment, n_jobs):
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from lightning_modules.common.kv_press import build_press
    from tests.helpers import compose

    cfg = compose(experiment, [f"+sweep={sweep}"])
    params = cfg.hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    choices = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    jobs = list(itertools.product(*choices))
    assert len(jobs) == n_jobs
    for job in (jobs[0], jobs[-1]):
        job_cfg = compose(experiment, [f"+sweep={sweep}", *job])
        press = dict(job_cfg.model.press)
        build_press(**press)
        assert all(int(n) > 0 for n in job_cfg.data.lengths)


def test_directional_collision_manifoldkv_keeps_more_needles_than_keydiff():
    """The multi-key effect in miniature (benchmarks/kvcache.py): needles sharing the centroid direction with
    different magnitudes; at 50% compression L2 keeps more of them and more of their queries' attention mass."""
    from benchmarks.kvcache import main

    out = main(["--trials", "3", "--n-keys", "1024", "--ratios", "0.5", "--time-keys", "4096", "--heads", "1"])
    (m_needles, m_mass), (k_needles, k_mass) = out["table"][(0.5, "ManifoldKV")], out["table"][(0.5, "KeyDiff")]
    assert m_needles >= k_needles + 0.5 and m_mass > k_mass + 0.3
