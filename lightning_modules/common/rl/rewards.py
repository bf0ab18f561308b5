"""Verifiable rewards: the completion's final answer against the gold one, and an optional format term.

The answer format (GSM8K ``####``, MATH ``\\boxed{}``, number normalisation) belongs with the task data:
``datamodules.common.answers``. Two comparisons (``ExactMatch.compare`` in ``scorers.py``):

- ``exact_match_reward``: the project's ``lightning_modules.common.evaluation.exact_match`` on the normalised
  strings; right where answers are integers (GSM8K, the generated tiny tasks), wrong for LaTeX (``0.5`` vs
  ``\\frac{1}{2}``, ``\\dfrac12`` vs ``\\frac{1}{2}``).
- ``math_equivalence_reward``: symbolic equivalence of the two answers by ``math-verify`` (Hugging Face's checker,
  the one open-r1's accuracy reward uses): for MATH / DeepScaleR's LaTeX answers.
"""
from __future__ import annotations

import re
import threading

from datamodules.common.answers import extract_answer, gold_answer, normalize_number
from lightning_modules.common.evaluation import exact_match

__all__ = ["exact_match_reward", "extract_answer", "format_reward", "math_equivalence_reward", "normalize_number"]


def exact_match_reward(completion: str, gold: str) -> float:
    """1.0 if the extracted answer equals the gold answer (itself extracted/normalised), else 0.0."""
    pred = extract_answer(completion)
    ref = extract_answer(gold) if ("####" in gold or "\\boxed" in gold) else normalize_number(gold)
    if pred is None or ref is None:
        return 0.0
    return exact_match(pred, ref)


def math_equivalence_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer is mathematically equal to the gold one (``math-verify``), else 0.0.

    The gold (``gold_answer``) is parsed as one LaTeX expression; the completion's answer is its ``#### n`` where it
    has one, else what math-verify extracts from the whole text (the last ``\\boxed{}`` first)."""
    from math_verify import parse, verify

    ref = gold_answer(gold)
    if ref is None:
        return 0.0
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    if "####" in completion:
        pred = extract_answer(completion)
        completion = f"${pred}$" if pred is not None else ""
    want, got = parse(f"${ref}$", parsing_timeout=timeout), parse(completion, parsing_timeout=timeout)
    if not want or not got:
        return 0.0
    return float(verify(want, got, timeout_seconds=timeout))


def format_reward(completion: str) -> float:
    """1.0 when the completion states its answer after ``####`` (an optional shaping term)."""
    return 1.0 if re.search(r"####\s*-?[\d.,]+", completion) else 0.0
