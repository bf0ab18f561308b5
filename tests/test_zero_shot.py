"""The lm-eval-harness runner, offline, on the tiny pretrained model and a task over a local jsonl file.

The harness's multiple-choice accuracy is checked against our own log-likelihood scoring of the same
(context, " " + choice) pairs; the runner path (task=test, no datamodule) writes per-task accuracy to
metrics.json.
"""
from __future__ import annotations

import json
import math
import random

import lm_eval  # noqa: F401 - a test dependency (the test extra): missing, these tests fail rather than skip
import pytest
import torch

from lightning_modules.common.zero_shot import ZeroShotEvalModule, hub_offline, task_metrics

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def make_task(root, name="toy_mc", n=10, seed=0):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"question": f"The value of {a} + {b} is", "choices": [str(a + b), f"{a * b + 10} apples", "def"],
                     "label": rng.randint(0, 2)})
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / f"{name}.yaml").write_text(TASK_YAML.format(name=name, data=data))
    return tasks, rows


def our_loglik(model, tok, context: str, continuation: str) -> float:
    """Sum of log p(continuation | context), tokenized as the harness does (encode the whole, cut at the context)."""
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx):]
    ids = torch.tensor([whole])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    pos = torch.arange(len(ctx) - 1, len(whole) - 1)
    return float(logp[pos, torch.tensor(cont)].sum())


def test_task_metrics_flattens_the_results_table():
    results = {"a": {"alias": "a", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.25, "sample_len": 8},
               "b": {"acc,none": 1.0, "exact_match,strict-match": 0.75, "acc_stderr,none": "N/A"}}
    assert task_metrics(results) == {"zero_shot/a/acc": 0.5, "zero_shot/a/acc_norm": 0.25, "zero_shot/b/acc": 1.0,
                                     "zero_shot/b/exact_match_strict-match": 0.75, "zero_shot/avg_acc": 0.75}


def test_average_counts_a_group_once_by_its_aggregate():
    """A group (MMLU) reports its aggregate and every subtask: the suite's average is over the tasks asked for."""
    results = {"grp": {"acc,none": 0.4}, "grp_sub1": {"acc,none": 0.1}, "grp_sub2": {"acc,none": 0.7},
               "b": {"acc,none": 0.8}}
    assert task_metrics(results, ["grp", "b"])["zero_shot/avg_acc"] == pytest.approx(0.6)
    assert task_metrics(results)["zero_shot/avg_acc"] == pytest.approx(0.5)  # every row, as before, without names


def test_fewshot_per_task_plans_one_harness_call_per_shot_count():
    spec = {"family": "llama", "pretrained": "unused"}
    m = ZeroShotEvalModule(spec, tasks=["a", "mmlu", "b", "c"], num_fewshot=0, fewshot_per_task={"mmlu": 5, "c": 5})
    assert m.fewshot_plan() == [(0, ["a", "b"]), (5, ["mmlu", "c"])]
    assert ZeroShotEvalModule(spec, tasks=["a"], num_fewshot=None).fewshot_plan() == [(None, ["a"])]
    with pytest.raises(ValueError, match=r"fewshot_per_task names \['mmlu'\], which are not in model.tasks"):
        ZeroShotEvalModule(spec, tasks=["a"], fewshot_per_task={"mmlu": 5})


def test_hub_offline_sets_and_restores(monkeypatch):
    import datasets.config as dcfg

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    before = dcfg.HF_HUB_OFFLINE
    with hub_offline(True, "/tmp/somewhere"):
        assert dcfg.HF_HUB_OFFLINE is True and str(dcfg.HF_DATASETS_CACHE) == "/tmp/somewhere"
        assert __import__("os").environ["HF_DATASETS_OFFLINE"] == "1"
    assert dcfg.HF_HUB_OFFLINE == before and "HF_DATASETS_OFFLINE" not in __import__("os").environ


def test_harness_accuracy_matches_our_scoring(tmp_path, tiny_lm_dir):
    tasks, rows = make_task(tmp_path, n=6)
    module = ZeroShotEvalModule({"family": "llama", "pretrained": str(tiny_lm_dir), "dtype": "float32"},
                                tasks=["toy_mc"], include_path=str(tasks), include_defaults=False, batch_size=4)
    metrics = module.evaluate()
    model, tok = module.model, module.load_tokenizer()
    correct = correct_norm = 0
    samples = sorted(module.lm_eval_output["samples"]["toy_mc"], key=lambda s: s["doc_id"])
    for row, sample in zip(rows, samples):
        lls = [our_loglik(model, tok, row["question"], " " + c) for c in row["choices"]]
        harness = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in sample["resps"]]
        assert harness == pytest.approx(lls, abs=1e-3)
        correct += int(max(range(3), key=lls.__getitem__) == row["label"])
        # acc_norm: log-likelihood per character of the choice (the harness's length normalisation)
        correct_norm += int(max(range(3), key=lambda i: lls[i] / len(row["choices"][i])) == row["label"])
    assert metrics["zero_shot/toy_mc/acc"] == pytest.approx(correct / len(rows))
    assert metrics["zero_shot/avg_acc"] == metrics["zero_shot/toy_mc/acc"]
    assert metrics["zero_shot/toy_mc/acc_norm"] == pytest.approx(correct_norm / len(rows))
    assert module.results["zero_shot"]["toy_mc"]["sample_len"] == len(rows)
    json.dumps(module.results)  # plain data for metrics.json


def test_unknown_task_is_refused_before_evaluation(tmp_path):
    tasks, _ = make_task(tmp_path, n=6)
    module = ZeroShotEvalModule({"family": "llama", "pretrained": "unused"}, tasks=["toy_mc", "no_such_task"],
                                include_path=str(tasks), include_defaults=False)
    with pytest.raises(ValueError, match=r"\['no_such_task'\] are not in"):
        module.task_manager()
    with pytest.raises(FileNotFoundError, match="include_path"):
        ZeroShotEvalModule({"family": "llama"}, tasks=["x"], include_path=str(tmp_path / "nope")).task_manager()
    with pytest.raises(ValueError, match="model.tasks is empty"):
        ZeroShotEvalModule({"family": "llama"}, tasks=[])


def test_runner_writes_per_task_accuracy(tmp_path, tiny_lm_dir):
    """The paper-scale experiment's path (task=test, no datamodule) with the tiny model on CPU."""
    from tests.helpers import run_experiment

    tasks, _ = make_task(tmp_path, name="toy_a", n=6, seed=1)
    make_task(tmp_path, name="toy_b", n=6, seed=2)
    value, metrics = run_experiment("lm_eval_llama7b", tmp_path / "run", overrides=(
        "backbone=tiny_llama", f"backbone.pretrained={tiny_lm_dir}", "backbone.config.vocab_size=2048",
        "trainer=cpu", "model.tasks=[toy_a,toy_b]", f"model.include_path={tasks}", "model.include_defaults=false",
        "model.batch_size=4"))
    assert metrics["status"] == "ok"
    a, b = metrics["final"]["zero_shot/toy_a/acc"], metrics["final"]["zero_shot/toy_b/acc"]
    assert value == pytest.approx((a + b) / 2)
    assert math.isclose(metrics["results"]["zero_shot"]["toy_a"]["acc,none"], a, rel_tol=1e-6)  # logged as float32
