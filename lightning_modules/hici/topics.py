"""Topic retrieval (LongChat's LongEval "topics"), as the HiCI release scores it: rule-based.

Each local test-case file ``<n>_topics.jsonl`` holds records {prompt, topics}: a long conversation over n topics
ending in the question for the first one. A prediction is right when it contains the first topic
(case-insensitive), the release's rule; the GPT-judged variant is not implemented.
"""
from __future__ import annotations

import re
from pathlib import Path


def load(path, max_samples: int | None = None) -> list[dict]:
    from datamodules.common.loaders import iter_jsonl

    records = list(iter_jsonl(Path(path)))[:max_samples]
    for k, r in enumerate(records):
        if not isinstance(r.get("prompt"), str) or not r.get("topics"):
            raise ValueError(f"{path} record {k}: a topics test case needs 'prompt' and a non-empty 'topics' list")
    return records


def num_topics(path) -> int:
    m = re.match(r"(\d+)_topics", Path(path).name)
    if not m:
        raise ValueError(f"{path}: topic test cases are named <n>_topics.jsonl (LongEval's layout)")
    return int(m.group(1))


def correct(pred: str, topics) -> float:
    return float(topics[0].lower() in pred.lower())
