"""Synthetic long-context probes generated from a seed: passkey retrieval and needle-in-a-haystack.

Passkey follows the protocol of Mohtashami & Jaggi (2023) used by LongLoRA/HiCI: a fixed filler sentence repeated
around one line "The pass key is N. Remember it. N is the pass key.", then "What is the pass key? The pass key is".
Lengths are in tokens of the given tokenizer; the key sits at a seeded depth.
"""
from __future__ import annotations

import random

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information there.\n"
_WORDS = ("apple river stone cloud lamp garden mirror violet copper harbor candle meadow falcon ember "
          "lantern orchard pebble summit thistle willow").split()


def filler_text(tokenizer, n_tokens: int, filler: str = FILLER) -> str:
    """Repeated filler of about ``n_tokens`` tokens (whole sentences, never more than asked)."""
    per = max(1, len(tokenizer(filler, add_special_tokens=False)["input_ids"]))
    return filler * max(0, n_tokens // per)


def _sentences(text: str) -> list[str]:
    """The sentences of a text split at ". ", without their final period; empty pieces dropped."""
    return [s.strip().rstrip(".") for s in text.split(". ") if s.strip().rstrip(".")]


def _join(sentences: list[str]) -> str:
    """Sentences back into text, each closed by one period ("" for none)."""
    return ". ".join(sentences) + "." if sentences else ""


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def passkey_sample(tokenizer, n_tokens: int, seed: int, depth: float | None = None, digits: int = 5) -> dict:
    """One passkey prompt of about ``n_tokens`` tokens; returns prompt, answer, depth and the true token count."""
    rng = random.Random(seed)
    key = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
    depth = rng.random() if depth is None else depth
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key? The pass key is"
    budget = n_tokens - _n_tokens(tokenizer, INTRO + needle + question)
    if budget < 0:
        raise ValueError(f"n_tokens={n_tokens} is too short for the passkey prompt; use at least {n_tokens - budget}")
    sentences = _sentences(filler_text(tokenizer, budget))
    cut = int(len(sentences) * depth)
    before, after = _join(sentences[:cut]), _join(sentences[cut:])
    prompt = INTRO + (before + " " if before else "") + needle + (after + " " if after else "") + question
    return {"prompt": prompt, "answer": key, "depth": depth, "n_tokens": _n_tokens(tokenizer, prompt)}


def needle_sample(tokenizer, n_tokens: int, seed: int, n_needles: int = 1, haystack: str | None = None) -> dict:
    """Needle-in-a-haystack: ``n_needles`` "The special magic number for <word> is: <7 digits>." lines at seeded
    depths in a haystack (filler, or text you pass), and a question about one of them."""
    rng = random.Random(seed)
    words = rng.sample(_WORDS, n_needles)
    values = [str(rng.randint(10 ** 6, 10 ** 7 - 1)) for _ in words]
    needles = [f"The special magic number for {w} is: {v}. " for w, v in zip(words, values)]
    target = rng.randrange(n_needles)
    question = f"What is the special magic number for {words[target]} mentioned in the text? Answer: The special magic number for {words[target]} is:"
    budget = n_tokens - _n_tokens(tokenizer, "".join(needles) + question)
    if budget < 0:
        raise ValueError(f"n_tokens={n_tokens} is too short for {n_needles} needle(s)")
    hay = filler_text(tokenizer, budget) if haystack is None else haystack
    sentences = _sentences(hay)
    for nd in needles:
        sentences.insert(rng.randint(0, len(sentences)), nd.rstrip(". "))
    prompt = _join(sentences) + " " + question
    return {"prompt": prompt, "answer": values[target], "key": words[target], "needles": dict(zip(words, values)),
            "n_tokens": _n_tokens(tokenizer, prompt)}


def multi_passkey_sample(tokenizer, n_tokens: int, seed: int, n_keys: int = 10, digits: int = 5) -> dict:
    """DuoAttention's distillation probe: ``n_keys`` numbered pass keys at seeded depths in filler, then the question
    and the keys in order as the answer (whose positions the distillation supervises)."""
    rng = random.Random(seed)
    keys = [str(rng.randint(10 ** (digits - 1), 10 ** digits - 1)) for _ in range(n_keys)]
    needles = [f"The pass key {i + 1} is {k}" for i, k in enumerate(keys)]
    question = " What are the pass keys in order? The pass keys are"
    answer = " " + ", ".join(keys) + "."
    budget = n_tokens - _n_tokens(tokenizer, INTRO + _join(needles) + question + answer)
    if budget < 0:
        raise ValueError(f"n_tokens={n_tokens} is too short for {n_keys} pass keys; use at least {n_tokens - budget}")
    sentences = _sentences(filler_text(tokenizer, budget))
    slots = sorted(rng.randint(0, len(sentences)) for _ in needles)
    for offset, (slot, needle) in enumerate(zip(slots, needles)):
        sentences.insert(slot + offset, needle)
    return {"prompt": INTRO + _join(sentences) + question, "answer": answer, "keys": keys}
