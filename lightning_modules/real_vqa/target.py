"""The RPA-SFT target format, its parser, the prompt, and the keyword-mismatch discriminator baseline.

Target ([INF], ../shared/papers/real_vqa.md §8.2): ``<pivots>…</pivots><conflict>yes|no; pivot=<id>;
values=…</conflict><answer>…</answer>``, in three segments so the loss weights each (λ_p, λ_c, λ_a).
``sft.target``: ``rpa`` (all three) | ``conflict_only`` (conflict + answer: detection without pivot extraction, the
"alignment" ablation) | ``answer_only`` (plain SFT).
"""
from __future__ import annotations

import re

TARGETS = ("rpa", "conflict_only", "answer_only")
SEGMENTS = ("pivots", "conflict", "answer")
ANSWER_OPEN = "<answer>"


def prompt_text(item: dict, image_tokens: str, passages: list[str] | None = None) -> str:
    """The model's prompt: image placeholders, numbered passages (``passages`` overrides the item's), question."""
    ps = item["passages"] if passages is None else passages
    evidence = "".join(f"[{i + 1}] {p}\n" for i, p in enumerate(ps))
    return f"{image_tokens}\n{evidence}Question: {item['question']}\nAnswer:"


def conflict_text(conflict: bool, pivot: str = "", values=()) -> str:
    return f"yes; pivot={pivot}; values={'|'.join(values)}" if conflict else "no"


def target_segments(item: dict, target: str) -> list[tuple[str, str]]:
    """[(segment, text)] of an item's target; knowledge / align items (no passages) have the answer only."""
    if target not in TARGETS:
        raise ValueError(f"sft.target={target!r}: choose one of {', '.join(TARGETS)}")
    answer = [("answer", f"{ANSWER_OPEN}{item['answer']}</answer>")]
    if item.get("task", "vqa") != "vqa" or target == "answer_only":
        return answer
    conflict = [("conflict", f"<conflict>{conflict_text(item['conflict'], item['pivot'], item['values'])}</conflict>")]
    if target == "conflict_only":
        return conflict + answer
    pivots = [("pivots", f"<pivots>{item['entity']}; {item['relation']}</pivots>")]
    return pivots + conflict + answer


def format_target(item: dict, target: str) -> str:
    return "".join(text for _, text in target_segments(item, target))


_CONFLICT = re.compile(r"<conflict>\s*(yes|no)\s*(?:;\s*pivot=([^;<]*))?\s*(?:;\s*values=([^<]*))?</conflict>")
_PIVOTS = re.compile(r"<pivots>([^<]*)</pivots>")
_ANSWER = re.compile(r"<answer>([^<]*)(?:</answer>|$)")


def parse_output(text: str) -> dict:
    """The fields of a generated target. A missing or malformed conflict block parses as "no conflict" with
    ``malformed: True`` (so an unparseable discriminator never triggers RPGD, and the count is reported)."""
    m = _CONFLICT.search(text)
    out = {"conflict": False, "pivot": None, "values": [], "malformed": m is None, "pivots": None, "answer": None}
    if m:
        out["conflict"] = m.group(1) == "yes"
        out["pivot"] = (m.group(2) or "").strip() or None
        out["values"] = [v.strip() for v in (m.group(3) or "").split("|") if v.strip()]
    p = _PIVOTS.search(text)
    if p:
        out["pivots"] = p.group(1).strip()
    a = _ANSWER.search(text)
    if a:
        out["answer"] = a.group(1).strip()
    return out


_WORD = re.compile(r"[A-Za-z]+")


def keyword_mismatch(passages: list[str]) -> bool:
    """Figure 1's baseline: a conflict iff the passages' keyword sets differ at all (any differing entity or value)."""
    sets = [frozenset(_WORD.findall(p)) for p in passages]
    return len(set(sets)) > 1


def mask_spans(passages: list[str], values) -> list[str]:
    """``rpgd.contrast: mask_pivot_spans``: every occurrence of each conflicting pivot value replaced by ``___``."""
    out = []
    for p in passages:
        for v in sorted(values, key=len, reverse=True):
            if v:
                p = re.sub(rf"\b{re.escape(v)}\b", "___", p)
        out.append(p)
    return out


def consistent_passages(passages: list[str], values) -> list[str]:
    """``rpgd.contrast: pivot_consistent``: the passages carrying the majority pivot value among ``values`` (those
    with the minority values dropped); all passages when no value is found."""
    counts = {v: sum(bool(re.search(rf"\b{re.escape(v)}\b", p)) for p in passages) for v in values if v}
    if not counts or max(counts.values()) == 0:
        return list(passages)
    best = max(counts, key=lambda v: (counts[v], v))
    others = [v for v in counts if v != best]
    return [p for p in passages if not any(re.search(rf"\b{re.escape(v)}\b", p) for v in others)] or list(passages)
