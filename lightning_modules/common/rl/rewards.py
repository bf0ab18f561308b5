"""Verifiable rewards: exact match of the extracted final answer, math equivalence, and an optional format term.

The answer format (GSM8K ``####``, MATH ``\\boxed{}``, number normalisation) belongs with the task data:
``datamodules.common.answers``. The comparison itself is the project's
``lightning_modules.common.evaluation.exact_match`` on the normalised strings. :func:`math_equivalence_reward` is
the released recipes' ``accuracy`` reward (Hista ``src/rl/utils/rewards.py``): symbolic equivalence by ``math-verify``.
"""
from __future__ import annotations

import re

from datamodules.common.answers import extract_answer, normalize_number
from lightning_modules.common.evaluation import exact_match

__all__ = ["exact_match_reward", "extract_answer", "format_reward", "math_equivalence_reward", "normalize_number"]


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


def math_equivalence_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's answer is mathematically equal to the gold one (``math-verify``), else 0.0.

    As the Hista release scores ``accuracy``: the gold answer is parsed as LaTeX (a bare answer is wrapped in ``$…$``,
    a GSM8K ``#### n`` solution gives n, a ``\\boxed{}`` one its box), the completion by ``math-verify``'s LaTeX
    extraction with ``\\boxed{}`` tried first and no anchor-less guess (an answer must be boxed or announced), then
    ``verify``; a parse or verification error scores 0. So ``\\frac{1}{2}``, ``0.5`` and ``\\dfrac12`` agree, where
    :func:`exact_match_reward` compares normalised strings. Without the ``math-verify`` package (tiny CPU setups) it
    is :func:`exact_match_reward`."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        return exact_match_reward(completion, gold)
    gold = gold.strip()
    if "####" in gold:
        gold = extract_answer(gold) or ""
    if "\\boxed" not in gold and "$" not in gold:
        gold = f"${gold}$"
    try:
        ref = parse(gold, extraction_mode="first_match", raise_on_error=True)
        norm = NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True, boxed="all", units=True)
        pred = parse(completion, extraction_config=[LatexExtractionConfig(normalization_config=norm, boxed_match_priority=0,
                                                                          try_extract_without_anchor=False)],
                     extraction_mode="first_match", raise_on_error=True)
        return float(verify(pred, ref, raise_on_error=True)) if pred and ref else 0.0
    except Exception:  # math-verify's timeouts and unparsable LaTeX: the release scores them 0
        return 0.0
