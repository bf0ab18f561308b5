"""Verifiable rewards: exact match of the extracted final answer, and an optional format term.

The answer format (GSM8K ``####``, MATH ``\\boxed{}``, number normalisation) belongs with the task data:
``datamodules.common.answers``. The comparison itself is the project's
``lightning_modules.common.evaluation.exact_match`` on the normalised strings.
"""
from __future__ import annotations

import re

from datamodules.common.answers import extract_answer, normalize_number
from lightning_modules.common.evaluation import exact_match

__all__ = ["exact_match_reward", "extract_answer", "format_reward", "normalize_number"]


def exact_match_reward(completion: str, gold: str) -> float:
    """1.0 if the extracted answer equals the gold answer (itself extracted/normalised), else 0.0."""
    pred = extract_answer(completion)
    ref = extract_answer(gold) if ("####" in gold or "\\boxed" in gold) else normalize_number(gold)
    if pred is None or ref is None:
        return 0.0
    return exact_match(pred, ref)


def format_reward(completion: str) -> float:
    """1.0 when the completion states its answer after ``####`` (an optional shaping term)."""
    return 1.0 if re.search(r"####\s*-?[\d.,]+", completion) else 0.0
