"""The final answer of a GSM8K / MATH-style solution: the task data's answer format, read by the data (to
build gold answers) and by the rewards (to score completions).

``extract_answer``: the text after the last ``####`` if there is one, else after the last ``The answer is:``
(MetaMathQA's responses), else the last ``\\boxed{...}``, else the last number in the text; numbers are normalised
(thousands separators, ``$``, trailing ``.0`` and a final period dropped) so ``1,000.00`` and ``1000`` match.

``gold_answer``: a gold field as the data stores it. A solution that states its answer (GSM8K ``#### n``, MetaMathQA
``The answer is: x``, MATH ``\\boxed{}``) is extracted; a bare answer (DeepScaleR's and MATH-500's ``answer``:
``\\frac{1}{2}``, ``(1, 2)``, ``x^2+1``) is read as stored, never reduced to its last number.
"""
from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
STATED = "The answer is:"  # MetaMathQA's final line


def normalize_number(text: str) -> str:
    """``"$1,000.50"`` -> ``"1000.5"``, ``"-0"`` -> ``"0"``, ``"007"`` -> ``"7"``; non-numbers are only stripped."""
    s = text.strip().replace("$", "").replace(",", "").rstrip(".").strip()
    if not re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+", s):
        return s
    neg, s = s.startswith("-"), s.lstrip("-")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    whole, _, frac = s.partition(".")
    s = (whole.lstrip("0") or "0") + ("." + frac if frac else "")
    return "-" + s if neg and s != "0" else s


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced; None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a GSM8K/MATH-style solution, normalised; None when there is none."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        line = tail.splitlines()[0].strip() if tail else ""
        nums = _NUMBER.findall(line)
        if nums:
            return normalize_number(nums[0])
        return line or None
    if STATED in text:
        line = text.rsplit(STATED, 1)[1].strip().split("\n", 1)[0]
        return normalize_number(line) or None
    boxed = last_boxed(text)
    if boxed is not None:
        return normalize_number(boxed)
    nums = _NUMBER.findall(text)
    return normalize_number(nums[-1]) if nums else None


def gold_answer(text: str) -> str | None:
    """The gold answer of a stored field, as LaTeX text: the number after ``####`` (GSM8K), else what follows
    ``The answer is:`` (MetaMathQA), else the last ``\\boxed{}``'s content as written (MATH solutions), else the
    whole field as stored (a bare answer). A plain number is normalised (``1,000`` -> ``1000``); anything else is
    only stripped (``(1, 2)`` keeps its comma). None when empty."""
    if "####" in text:
        return extract_answer(text)
    if STATED in text:
        answer = text.rsplit(STATED, 1)[1].strip().split("\n", 1)[0].strip()
    else:
        boxed = last_boxed(text)
        answer = (boxed if boxed is not None else text).strip()
    number = normalize_number(answer)
    return (number if _NUMBER.fullmatch(number) else answer) or None
