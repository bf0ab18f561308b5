"""ManifoldKV: the scorer's semantics against planted ground truth (lightning_modules/manifoldkv/press.py), the
RULER-style suite (planted answers, lengths, real-file loading), the evaluation module, the configs and sweeps, and
the tiny experiment end to end."""
import json
import re
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from lightning_modules.manifoldkv.data import RULER_TASKS, TASKS, RulerDataModule, encode, load_ruler_files, ruler_sample
from lightning_modules.common.kv_press import AdaKV, Block, KeyDiff, KNorm, StreamingLLM
from lightning_modules.manifoldkv.press import ManifoldKV, WindowedManifoldKV
from tests.helpers import ROOT
from tests.test_kv_press import L_CTX, ids, model, prefill, score_of  # noqa: F401  (the shared random tiny Llama)


# --- the scorer ---------------------------------------------------------------------------------------------
def test_manifoldkv_ranks_exactly_opposite_to_knorm_on_plus_minus_pairs():
    g = torch.Generator().manual_seed(0)
    half = torch.randn(1, 2, 16, 8, generator=g) * torch.linspace(0.5, 3, 16).view(1, 1, 16, 1)
    keys = torch.cat([half, -half], dim=2)  # centroid exactly 0 in every head
    m, k = score_of(ManifoldKV(0.5), keys), score_of(KNorm(0.5), keys)
    torch.testing.assert_close(m, keys.norm(dim=-1))
    torch.testing.assert_close(m, -k)
    keep_m = set(m[0, 0].topk(16).indices.tolist())
    keep_k = set(k[0, 0].topk(16).indices.tolist())
    assert keep_m.isdisjoint(keep_k) and len(keep_m | keep_k) == 32  # complementary halves


def test_radial_outlier_kept_by_manifoldkv_and_evicted_by_keydiff():
    g = torch.Generator().manual_seed(0)
    d, n = 16, 64
    mu = torch.randn(d, generator=g)
    mu = mu / mu.norm() * 2
    perp = torch.randn(d, generator=g)
    perp = perp - (perp @ mu) / (mu @ mu) * mu
    cluster = mu + 0.05 * torch.randn(n, d, generator=g)
    radial, angular = 10 * mu, mu + perp / perp.norm()
    keys = torch.cat([cluster, radial[None], angular[None]]).view(1, 1, n + 2, d)
    m, kd = score_of(ManifoldKV(0.5), keys)[0, 0], score_of(KeyDiff(0.5), keys)[0, 0]
    assert set(m.topk(2).indices.tolist()) == {n, n + 1}  # both outliers on top for L2
    assert int(kd.argmin()) == n                           # cosine sees 10*mu as the most typical key
    assert int(kd.argmax()) == n + 1                       # but it does see the angular one
    n_kept = int((n + 2) * 0.5)
    assert n in m.topk(n_kept).indices.tolist() and n not in kd.topk(n_kept).indices.tolist()


def test_windowed_manifoldkv_finds_each_topic_outlier_and_reduces_to_global():
    g = torch.Generator().manual_seed(0)
    d, half = 16, 32
    axis = torch.zeros(d)
    axis[0] = 1.0
    mu_a, mu_b = -5 * axis, 5 * axis
    a = mu_a + torch.randn(half, d, generator=g) * torch.tensor([0.1] + [0.05] * (d - 1))
    b = mu_b + torch.randn(half, d, generator=g) * torch.tensor([0.1] + [0.05] * (d - 1))
    off = torch.zeros(d)
    off[3] = 1.0
    a[7], b[20] = mu_a + off, mu_b - off  # one mild outlier per topic, off the topic axis
    keys = torch.cat([a, b]).view(1, 1, 2 * half, d)
    outliers = {7, half + 20}
    glob = score_of(ManifoldKV(0.5), keys)[0, 0]
    win = score_of(ManifoldKV(0.5, window_size=half), keys)[0, 0]
    assert set(win.topk(2).indices.tolist()) == outliers
    assert set(glob.topk(2).indices.tolist()) != outliers  # the diluted global centroid misranks them
    for w in (2 * half, 10 * half):
        assert torch.equal(score_of(ManifoldKV(0.5, window_size=w), keys), score_of(ManifoldKV(0.5), keys))
    assert WindowedManifoldKV(0.5).window_size == 4096  # the paper's window
    assert torch.equal(score_of(WindowedManifoldKV(0.5, window_size=half), keys)[0, 0], win)
    # a trailing partial window gets its own centroid
    part = score_of(ManifoldKV(0.5, window_size=40), keys)[0, 0]
    tail = keys[0, 0, 40:]
    torch.testing.assert_close(part[40:], (tail - tail.mean(0)).norm(dim=-1))


def test_adakv_budget_per_layer_and_masked_count():
    g = torch.Generator().manual_seed(0)
    H, L, ratio, alpha = 4, 50, 0.6, 0.2
    spread = torch.tensor([4.0, 1.0, 0.5, 0.1]).view(1, H, 1, 1)
    keys = torch.randn(1, H, L, 8, generator=g) * spread
    module = SimpleNamespace(layer_idx=0)
    press = AdaKV(press=ManifoldKV(ratio), alpha_safeguard=alpha)
    k2, v2 = press.compress(module, None, keys, keys, {})
    assert k2 is keys  # nothing physically removed
    n_kept = int(L * (1 - ratio))
    evicted = module.press_evicted
    assert int(evicted.sum()) == H * (L - n_kept)            # masked count = layer budget
    kept = L - evicted.sum(-1)[0]
    assert int(kept.sum()) == H * n_kept and (kept >= int(n_kept * alpha)).all()
    assert kept[0] > n_kept > kept[3]                         # the spread-out head gets more budget
    top = ManifoldKV(ratio).score(module, None, keys, keys, {})[0, 3].topk(int(n_kept * alpha)).indices
    assert not evicted[0, 3, top].any()                       # the safeguard tokens of every head survive


def test_pre_rope_variant_scores_the_unrotated_keys(model, ids):
    """pre_rope=True undoes the rotation exactly: on cached (rotated) keys it equals ManifoldKV on the raw k_proj keys."""
    context, _ = ids
    attn = model.model.layers[1].self_attn
    captured = {}
    h = attn.register_forward_hook(lambda m, a, kw, o: captured.update(kw=kw), with_kwargs=True)
    cache = prefill(model, context, KNorm(0.0))
    h.remove()
    kw = captured["kw"]
    raw = attn.k_proj(kw["hidden_states"]).view(1, L_CTX, 2, 16).transpose(1, 2)
    rotated = cache.layers[1].keys
    assert not torch.allclose(rotated, raw, atol=1e-3)
    pre = ManifoldKV(0.5, pre_rope=True).score(attn, kw["hidden_states"], rotated, rotated, kw)
    torch.testing.assert_close(pre, ManifoldKV(0.5).score(attn, None, raw, raw, {}), atol=1e-4, rtol=1e-4)
    # inside Block every scored key is unrotated with its own position
    blocked = prefill(model, context, Block(press=ManifoldKV(0.5, pre_rope=True), block_size=64))
    plain = prefill(model, context, ManifoldKV(0.5, pre_rope=True))
    assert torch.equal(blocked.layers[1].keys, plain.layers[1].keys)
    prefill(model, context, Block(press=ManifoldKV(0.5, pre_rope=True), block_size=8))  # partial blocks run


def test_distance_ablation_variants_match_their_formulas():
    keys = torch.randn(2, 3, 30, 8, generator=torch.Generator().manual_seed(5))
    diff = keys - keys.mean(dim=-2, keepdim=True)
    torch.testing.assert_close(score_of(ManifoldKV(0.5, distance="l1"), keys), diff.abs().sum(-1))
    torch.testing.assert_close(score_of(ManifoldKV(0.5, distance="linf"), keys), diff.abs().max(-1).values)
    mu = keys.mean(dim=-2, keepdim=True)
    cos = (keys * mu).sum(-1) / (keys.norm(dim=-1) * mu.norm(dim=-1))
    torch.testing.assert_close(score_of(ManifoldKV(0.5, distance="cosine"), keys), -cos)
    with pytest.raises(ValueError, match="choose l2"):
        ManifoldKV(0.5, distance="l3")
    with pytest.raises(ValueError, match="positive int"):
        ManifoldKV(0.5, window_size=0)


# --- the RULER-style suite ---------------------------------------------------------------------------


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


def write_ruler_copy(root, lengths=(4096, 8192), per_task=3, tasks=RULER_TASKS):
    """A local copy in kvpress's simonjegou/ruler layout: <root>/<length>/ holding one file of every task's records."""
    for n in lengths:
        (root / str(n)).mkdir(parents=True)
        records = [{"context": f"ctx {n} {t} {i}: the code is {n + i}.", "question": f" What is the code ({t})?",
                    "answer_prefix": " The code is", "answer": [str(n + i)], "task": t, "max_new_tokens": 32}
                   for t in tasks for i in range(per_task)]
        if n == 4096:
            (root / "4096" / "test-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        else:
            import pandas as pd

            pd.DataFrame(records).to_parquet(root / str(n) / "test-00000-of-00001.parquet")


def test_real_ruler_files_read_all_13_tasks_at_the_asked_lengths(tmp_path, tok):
    write_ruler_copy(tmp_path)
    dm = RulerDataModule(tok, source="files", files=str(tmp_path), lengths=[4096], samples_per_task=2)
    dm.setup()
    assert len(dm.samples) == 13 * 2 and {s["length"] for s in dm.samples} == {4096}
    assert [s["task"] for s in dm.samples[:13]] == list(RULER_TASKS)  # sample-major: the first batches see every task
    first = dm.samples[0]
    assert first["outputs"] == ["4096"] and first["context"].startswith("ctx 4096 niah_single_1 0")
    assert tok.decode(first["question_ids"]) == first["question"] + first["answer_prefix"]
    dm = RulerDataModule(tok, source="files", files=str(tmp_path), lengths=[8192, 4096], tasks=["qa_1", "vt"],
                         samples_per_task=None)
    dm.setup()
    assert [(s["length"], s["task"]) for s in dm.samples[:4]] == [(8192, "vt"), (8192, "qa_1"), (4096, "vt"), (4096, "qa_1")]
    assert len(dm.samples) == 2 * 2 * 3 and dm.samples[1]["outputs"] == ["8192"]


def test_real_ruler_files_name_the_fix(tmp_path, tok):
    write_ruler_copy(tmp_path, lengths=(4096,), tasks=("vt",))
    with pytest.raises(ValueError, match=r"no 16384/ directory \(context lengths there: \['4096'\]\)"):
        load_ruler_files(tmp_path, [16384])
    with pytest.raises(ValueError, match=r"\['qa_1'\] not in"):
        load_ruler_files(tmp_path, [4096], tasks=["vt", "qa_1"])
    with pytest.raises(ValueError, match="unknown \\['niah_single'\\] for data.source=files"):
        RulerDataModule(tok, source="files", files=str(tmp_path), tasks=["niah_single"])
    with pytest.raises(ValueError, match="unknown \\['qa_1'\\] for data.source=synthetic"):
        RulerDataModule(tok, tasks=["qa_1"])
    with pytest.raises(ValueError, match="data.files"):
        RulerDataModule(tok, source="files")
    bad = tmp_path / "bad" / "4096"
    bad.mkdir(parents=True)
    (bad / "x.jsonl").write_text(json.dumps({"input": "x", "outputs": ["1"]}) + "\n")
    with pytest.raises(ValueError, match="context, question, task"):
        load_ruler_files(tmp_path / "bad", [4096])


def test_eval_module_scores_planted_answers_with_string_match(tiny_lm_dir, tok):
    """An oracle backbone wrapper that emits the gold answer must score 100; the tiny model itself scores ~0."""
    from lightning_modules.manifoldkv.module import KVPressEvalModule

    module = KVPressEvalModule(backbone={"family": "llama", "pretrained": str(tiny_lm_dir)}, press=ManifoldKV(0.5),
                               max_new_tokens=2)
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
    lengths = [s["context_ids"].numel() for s in dm.samples]
    assert logged["test/kv_kept_fraction"] == pytest.approx(sum(int(n * 0.5) / n for n in lengths) / len(lengths))
    assert set(module.results["retained_fraction_per_head"]) == {"0", "1", "2", "3"}
    assert module.results["press"] == {"_target_": "lightning_modules.manifoldkv.press.ManifoldKV",
                                       "compression_ratio": 0.5, "window_size": None, "pre_rope": False,
                                       "distance": "l2"}


def test_uncompressed_answer_nll_equals_one_forward_over_context_question_and_answer(tiny_lm_dir, tok):
    """Ratio 0: the module's teacher-forced answer NLL (context prefilled, question and answer appended on the cache)
    equals the NLL of the answer tokens in one plain forward over the concatenated ids; ratio 0.5 changes it."""
    from lightning_modules.manifoldkv.module import KVPressEvalModule

    sample = encode(ruler_sample("niah_single", tok, 256, 0), tok)
    nll = {}
    for ratio in (0.0, 0.5):
        module = KVPressEvalModule(backbone={"family": "llama", "pretrained": str(tiny_lm_dir)},
                                   press=ManifoldKV(ratio), max_new_tokens=2)
        module.configure_model()
        module._tokenizer = lambda: tok
        module.on_test_epoch_start()
        module.test_step(sample, 0)
        nll[ratio] = module.rows[0]["answer_nll"]
    ids = torch.cat([sample["context_ids"], sample["question_ids"], sample["gold_ids"]])[None]
    with torch.no_grad():
        logp = module.model(input_ids=ids).logits[0].float().log_softmax(-1)
    n_gold = sample["gold_ids"].numel()
    reference = -logp[-n_gold - 1:-1].gather(-1, sample["gold_ids"].view(-1, 1)).mean().item()
    assert nll[0.0] == pytest.approx(reference, abs=1e-4)
    assert abs(nll[0.5] - reference) > 1e-3


def test_module_errors_name_the_fix(tiny_lm_dir):
    from lightning_modules.manifoldkv.module import KVPressEvalModule

    backbone = {"family": "llama", "pretrained": str(tiny_lm_dir)}
    with pytest.raises(ValueError, match="model/press=<name>"):
        KVPressEvalModule(backbone=backbone, press={"compression_ratio": 0.2})  # model/press=null left the ratio
    with pytest.raises(ValueError, match="model/press_wrapper=null"):
        KVPressEvalModule(backbone=backbone, press=None, press_wrapper=AdaKV)


def test_manifoldkv_tiny_smoke(tmp_path):
    from lightning_modules.common.evaluation import string_match_all
    from tests.helpers import run_experiment

    value, metrics = run_experiment("manifoldkv_tiny", tmp_path)
    assert metrics["status"] == "ok"
    final, results = metrics["final"], metrics["results"]
    assert results["press"]["_target_"] == "lightning_modules.manifoldkv.press.ManifoldKV"
    assert results["press"]["compression_ratio"] == 0.5  # plain ManifoldKV: no wrapper in the tiny experiment
    # smoke: 2 batches, the first two cells of the sample-major order; each score recomputed from its prediction
    predictions = results["predictions"]
    assert [(p["task"], p["length"]) for p in predictions] == [("niah_single", 384), ("niah_multikey_2", 384)]
    per_cell = {f"{p['task']}/{p['length']}": 100.0 * string_match_all(p["prediction"], p["outputs"])
                for p in predictions}
    assert results["accuracy_per_task"] == per_cell
    assert value == final["test/accuracy"] == pytest.approx(sum(per_cell.values()) / len(per_cell))
    # ratio 0.5 keeps int(L / 2) of each context's L tokens in every head of every layer
    kept = sum(int(p["context_tokens"] * 0.5) / p["context_tokens"] for p in predictions) / len(predictions)
    assert final["test/kv_kept_fraction"] == pytest.approx(kept)
    assert results["retained_fraction_per_head"] == {str(layer): [pytest.approx(kept)] * 2 for layer in range(4)}
    assert final["test/prefill_ms"] > 0 and final["test/decode_ms_per_token"] > 0
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()  # an evaluation writes no checkpoint


PAPER_SCALE = {"manifoldkv_llama31_8b": "meta-llama/Llama-3.1-8B-Instruct", "manifoldkv_qwen3_8b": "Qwen/Qwen3-8B",
               "manifoldkv_ministral_8b": "mistralai/Ministral-8B-Instruct-2410",
               "manifoldkv_gemma3_12b": "google/gemma-3-12b-it"}  # the spec's four architectures


@pytest.mark.parametrize("name", sorted(PAPER_SCALE))
def test_paper_scale_experiments_compose_with_the_papers_settings(name):
    from tests.helpers import compose

    cfg = compose(name)
    assert cfg.backbone.pretrained == PAPER_SCALE[name] and cfg.task == "test"
    assert list(cfg.data.lengths) == [4096, 8192, 16384] and cfg.data.chat_template
    assert cfg.data.source == "files" and cfg.data.tasks is None  # real RULER, all 13 tasks (the headline average)
    # ManifoldKV + Ada-KV at 20%, as in the paper's headline numbers
    assert job_press(cfg) == AdaKV(press=ManifoldKV(0.2), alpha_safeguard=0.2)
    assert cfg.trainer.precision == "bf16-true" and cfg.optimized_mode == "max"


def job_press(cfg):
    """The press the module builds from a composed config (model.press, wrapped by model.press_wrapper)."""
    from hydra.utils import instantiate

    press = instantiate(cfg.model.press)
    wrapper = cfg.model.get("press_wrapper")
    return instantiate(wrapper)(press=press) if wrapper is not None else press


# per sweep: the experiment it extends, its job count, and what every job's press must be
SWEEPS = {
    "manifoldkv_ruler": ("manifoldkv_llama31_8b", 48, lambda p: isinstance(p, AdaKV)),
    "manifoldkv_ruler_streaming": ("manifoldkv_llama31_8b", 12, lambda p: type(p) is StreamingLLM),
    "manifoldkv_multikey": ("manifoldkv_qwen3_8b", 4,
                            lambda p: isinstance(p, AdaKV) and p.compression_ratio in (0.4, 0.5)),
    "manifoldkv_64k": ("manifoldkv_llama31_8b", 6, lambda p: isinstance(p, AdaKV) and p.compression_ratio == 0.25),
    "manifoldkv_distance": ("manifoldkv_llama31_8b", 4, lambda p: type(p) is ManifoldKV),
    "manifoldkv_tiny_grid": ("manifoldkv_tiny", 24, lambda p: p.compression_ratio in (0.0, 0.25, 0.5, 0.75)),
}


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_sweeps_parse_and_every_job_composes_to_a_valid_press(sweep):
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from tests.helpers import compose

    experiment, n_jobs, expected = SWEEPS[sweep]
    cfg = compose(experiment, [f"+sweep={sweep}"])
    params = cfg.hydra.sweeper.params
    parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()])
    choices = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    jobs = list(itertools.product(*choices))
    assert len(jobs) == n_jobs
    for job in (jobs[0], jobs[-1]):
        job_cfg = compose(experiment, [f"+sweep={sweep}", *job])
        assert expected(job_press(job_cfg)), f"{sweep} {job}: {job_press(job_cfg)}"
        assert all(int(n) > 0 for n in job_cfg.data.lengths)


def test_a_press_is_a_group_choice_and_the_old_keys_fail_with_one_line():
    from tests.helpers import compose

    cfg = compose("manifoldkv_tiny", ["model/press=windowed_manifoldkv", "model/press_wrapper=block",
                                      "model.press_wrapper.block_size=32"])
    assert job_press(cfg) == Block(press=WindowedManifoldKV(0.5), block_size=32)  # the experiment's ratio applies
    assert job_press(compose("manifoldkv_tiny", ["model/press=keydiff"])) == KeyDiff(0.5)
    for old, new in (("model.press.name=keydiff", "model/press="), ("model.press.wrapper=adakv", "model/press_wrapper="),
                     ("+model.press.alpha_safeguard=0.3", "model.press_wrapper.alpha_safeguard")):
        out = subprocess.run([sys.executable, "run.py", "experiment=manifoldkv_tiny", old], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode != 0 and new in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_directional_collision_manifoldkv_keeps_more_needles_than_keydiff():
    """The multi-key effect in miniature (lightning_modules/manifoldkv/benchmark.py): needles sharing the centroid direction with
    different magnitudes; at 50% compression L2 keeps more of them and more of their queries' attention mass."""
    from lightning_modules.manifoldkv.benchmark import main

    out = main(["--trials", "3", "--n-keys", "1024", "--ratios", "0.5", "--time-keys", "4096", "--heads", "1"])
    (m_needles, m_mass), (k_needles, k_mass) = out["table"][(0.5, "ManifoldKV")], out["table"][(0.5, "KeyDiff")]
    assert m_needles >= k_needles + 0.5 and m_mass > k_mass + 0.3
