"""LongBench (v1) on local files, as the HiCI release evaluates its SFT models (English tasks).

Reads the release's layout: ``<data_dir>/<task>.jsonl`` records {input, context, answers, all_classes, ...} and the
benchmark's own ``dataset2prompt.json`` / ``dataset2maxlen.json`` (prompt template and generation budget per task)
from ``config_dir``. A prompt longer than ``max_length`` tokens keeps its first and last ``max_length / 2`` tokens;
tasks other than the few-shot/code ones are wrapped in the chat template; generation is greedy. Scores are
LongBench's per-task metrics (max over the reference answers, mean over samples, x100). Chinese tasks need
jieba-segmented metrics and are refused.
"""
from __future__ import annotations

import difflib
import json
import re
import string
from collections import Counter
from pathlib import Path

METRICS = {
    **dict.fromkeys(["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"], "qa_f1"),
    **dict.fromkeys(["gov_report", "qmsum", "multi_news", "samsum"], "rouge_l"),
    "trec": "classification", "passage_retrieval_en": "retrieval", "passage_count": "count",
    "lcc": "code_sim", "repobench-p": "code_sim",
}
CHINESE = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
FIRST_LINE = ("trec", "triviaqa", "samsum")      # scored on the first line of the prediction
NO_CHAT = ("trec", "triviaqa", "samsum", "lcc", "repobench-p")  # few-shot and code prompts stay raw


def normalize(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def qa_f1(pred: str, gold: str, **_) -> float:
    p, g = normalize(pred).split(), normalize(gold).split()
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def rouge_l(pred: str, gold: str, **_) -> float:
    """ROUGE-L F1 over lower-cased whitespace tokens (longest common subsequence)."""
    p, g = pred.lower().split(), gold.lower().split()
    if not p or not g:
        return 0.0
    prev = [0] * (len(g) + 1)
    for a in p:
        cur = [0]
        for j, b in enumerate(g):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(g)
    return 2 * precision * recall / (precision + recall)


def classification(pred: str, gold: str, all_classes=(), **_) -> float:
    """1 / (number of classes named) if the gold class is among them; a class that is only part of the gold name
    does not count."""
    named = [c for c in all_classes if c in pred and not (c in gold and c != gold)]
    return 1.0 / len(named) if gold in named else 0.0


def retrieval(pred: str, gold: str, **_) -> float:
    """Share of the numbers in the prediction that are the gold paragraph's number."""
    target = re.findall(r"Paragraph (\d+)", gold)[0]
    numbers = re.findall(r"\d+", pred)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def count(pred: str, gold: str, **_) -> float:
    numbers = re.findall(r"\d+", pred)
    return sum(n == str(gold) for n in numbers) / len(numbers) if numbers else 0.0


def code_sim(pred: str, gold: str, **_) -> float:
    """Edit similarity of the first line of code (not a comment or a fence) to the gold line."""
    line = next((l for l in pred.lstrip("\n").split("\n") if "`" not in l and "#" not in l and "//" not in l), "")
    return difflib.SequenceMatcher(None, line, gold).ratio()


SCORERS = {"qa_f1": qa_f1, "rouge_l": rouge_l, "classification": classification, "retrieval": retrieval,
           "count": count, "code_sim": code_sim}


def score(task: str, pred: str, answers, all_classes=()) -> float:
    """One sample's score in [0, 1]: the task's metric, best over the reference answers."""
    if task in FIRST_LINE:
        pred = pred.lstrip("\n").split("\n")[0]
    metric = SCORERS[METRICS[task]]
    return max(metric(pred, a, all_classes=all_classes or ()) for a in answers)


def check_tasks(tasks) -> None:
    for t in tasks:
        if t in CHINESE:
            raise ValueError(f"LongBench task {t!r} needs jieba-segmented Chinese metrics, not implemented here; "
                             "drop it from model.evaluation.longbench_tasks")
        if t not in METRICS:
            raise ValueError(f"unknown LongBench task {t!r}; choose from {', '.join(METRICS)}")


def load(data_dir, config_dir, task: str, max_samples: int | None = None) -> tuple[list[dict], str, int]:
    """The task's records, prompt template and generation budget, from the local LongBench files."""
    from datamodules.common.loaders import iter_jsonl

    path = Path(data_dir) / f"{task}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: put LongBench's data/{task}.jsonl under model.evaluation.longbench_dir")
    cfg = Path(config_dir)
    prompts = json.loads((cfg / "dataset2prompt.json").read_text())
    budgets = json.loads((cfg / "dataset2maxlen.json").read_text())
    records = list(iter_jsonl(path))[:max_samples]
    return records, prompts[task], int(budgets[task])


def truncate_middle(tokenizer, prompt: str, max_length: int) -> str:
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_length:
        return prompt
    half = max_length // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(ids[-half:], skip_special_tokens=True)


def build_prompt(tokenizer, task: str, template: str, record: dict, max_length: int, chat_template: str) -> str:
    prompt = truncate_middle(tokenizer, template.format(**record), max_length)
    return prompt if task in NO_CHAT else chat_template.format(prompt=prompt)
