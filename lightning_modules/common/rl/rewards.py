"""Verifiable rewards: the completion's final answer against the gold one, and an optional format term.

The answer format (GSM8K ``####``, MATH ``\\boxed{}``, number normalisation) belongs with the task data:
``datamodules.common.answers``. Three comparisons (``ExactMatch.compare`` in ``scorers.py``):

- ``exact_match_reward``: the project's ``lightning_modules.common.evaluation.exact_match`` on the normalised
  strings; right where answers are integers (GSM8K, the generated tiny tasks), wrong for LaTeX (``0.5`` vs
  ``\\frac{1}{2}``, ``\\dfrac12`` vs ``\\frac{1}{2}``).
- ``math_equivalence_reward``: symbolic equivalence of the two answers by ``math-verify`` (Hugging Face's checker,
  the one open-r1's accuracy reward uses): for MATH / DeepScaleR's LaTeX answers.
- ``boxed_math_reward``: the same check as the Hista release scores ``accuracy`` (``src/rl/utils/rewards.py``):
  the completion's answer must be boxed or announced, no anchor-less guess.
"""
from __future__ import annotations

import re
import threading

from datamodules.common.answers import extract_answer, gold_answer, normalize_number
from lightning_modules.common.evaluation import exact_match

__all__ = ["boxed_math_reward", "exact_match_reward", "extract_answer", "format_reward", "math_equivalence_reward",
           "normalize_number"]


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


def boxed_math_reward(completion: str, gold: str) -> float:
    """1.0 if the completion's answer is mathematically equal to the gold one (``math-verify``), else 0.0.

    As the Hista release scores ``accuracy``: the gold answer is parsed as LaTeX (a bare answer is wrapped in ``$…$``,
    a GSM8K ``#### n`` solution gives n, a ``\\boxed{}`` one its box), the completion by ``math-verify``'s LaTeX
    extraction with ``\\boxed{}`` tried first and no anchor-less guess (an answer must be boxed or announced), then
    ``verify``; a parse or verification error scores 0. So ``\\frac{1}{2}``, ``0.5`` and ``\\dfrac12`` agree, where
    :func:`exact_match_reward` compares normalised strings. ``math-verify`` is a dependency (``ExactMatch`` checks
    it is installed before a run starts)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

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
