"""Three disjoint splits (train / val / test) by a hash of each item's content.

An item's split depends only on its key (a document's text, a problem, a source file and row) and on the two
fractions, never on order or on how many items there are: the same document is held out in every run, and
growing a corpus never moves a held-out document into training. ``u = sha1(key)`` read as a number in [0, 1):
``u < val_fraction`` is validation, the next ``test_fraction`` is test, the rest is train.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterable, TypeVar

SPLITS = ("train", "val", "test")
T = TypeVar("T")


def check_fractions(val_fraction: float, test_fraction: float) -> None:
    if not (0.0 <= val_fraction and 0.0 <= test_fraction and val_fraction + test_fraction < 1.0):
        raise ValueError(f"data.val_fraction={val_fraction} and data.test_fraction={test_fraction} must be >= 0 "
                         "and sum to less than 1 (the rest is the training split)")


def unit_hash(key: str) -> float:
    """A stable number in [0, 1) from a string."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") / 2**64


def split_of(key: str, val_fraction: float, test_fraction: float) -> str:
    u = unit_hash(key)
    return "val" if u < val_fraction else "test" if u < val_fraction + test_fraction else "train"


def split_items(items: Iterable[T], val_fraction: float, test_fraction: float,
                key: Callable[[T], str] = str) -> dict[str, list[T]]:
    """``{"train": [...], "val": [...], "test": [...]}``, each in the items' order."""
    check_fractions(val_fraction, test_fraction)
    out: dict[str, list[T]] = {s: [] for s in SPLITS}
    for it in items:
        out[split_of(key(it), val_fraction, test_fraction)].append(it)
    return out
