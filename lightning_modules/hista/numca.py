"""Numca: state values from the numbers a response has written so far (spec 3.2).

- Numbers are digit runs (``\\d+``: no signs, "3.14" gives 3 and 14); the last one is the answer and is dropped.
- A state is the *set* of distinct numbers seen so far (root ∅), so {3, 5} = {5, 3}.
- :class:`NumcaTable` keeps, per problem id and across steps, (count, reward sum) of every state a rollout passed
  through; V(s) = sum / count, 0 for a state never seen.
- :func:`numca_token_advantages`: each position where a new number appears closes a segment with
  δ = V(after) − V(before); the tail gets R − V(last); then GAE over the segments (``segment_gae``). Positions
  closer than ``merge_gap`` merge, an earlier one onto the later one (scanning from the right); the numbers at one
  merged position are one transition.
"""
from __future__ import annotations

import re
from collections import defaultdict

import torch

from lightning_modules.common.rl.advantages import segment_gae

NUMBER = re.compile(r"\d+")


def parse_numbers(text: str) -> list[tuple[str, int]]:
    """(number, character position of its first digit) for every digit run but the last (the answer)."""
    return [(m.group(), m.start()) for m in NUMBER.finditer(text)][:-1]


def states(numbers) -> list[frozenset]:
    """The distinct states a number sequence passes through: ∅, then one after each *new* number."""
    out, seen = [frozenset()], frozenset()
    for n in numbers:
        if n not in seen:
            seen = seen | {n}
            out.append(seen)
    return out


class NumcaTable:
    """Per-problem (count, reward sum) over number-set states, kept across training steps."""

    def __init__(self):
        self.table: dict[str, dict[frozenset, list[float]]] = defaultdict(dict)

    def update(self, problem_id: str, numbers, reward: float) -> None:
        t = self.table[problem_id]
        for s in states(numbers):
            c = t.setdefault(s, [0, 0.0])
            c[0] += 1
            c[1] += float(reward)

    def value(self, problem_id: str, state) -> float:
        c = self.table.get(problem_id, {}).get(frozenset(state))
        return c[1] / c[0] if c else 0.0

    def __len__(self) -> int:
        return len(self.table)


def merge_positions(positions: list[int], gap: int) -> list[int]:
    """Positions (ascending) closer than ``gap`` to the next kept one snap onto it, scanning from the right."""
    out = list(positions)
    for i in range(len(out) - 2, -1, -1):
        if out[i + 1] - out[i] < gap:
            out[i] = out[i + 1]
    return out


def chars_to_tokens(chars: list[int], token_ends: list[int]) -> list[int]:
    """Token position of each character: the first token whose end offset passes it, +1 (the boundary after it)."""
    ends = torch.as_tensor(token_ends, dtype=torch.long)
    return [int(torch.searchsorted(ends, c, right=True)) + 1 for c in chars]


def numca_chain(table: NumcaTable, problem_id: str, numbers: list[tuple[str, int]], reward: float, end: int,
                gap: int, positions: list[int] | None = None) -> tuple[list[float], list[int]]:
    """Values [V(∅), V(s_1), …, V(s_k), R] and boundaries [0, p_1, …, p_k, end] for :func:`segment_gae`.

    ``positions`` (default: the numbers' character positions) are in the advantage's unit (tokens in training,
    characters in SVEB); each is capped at ``end``."""
    pos = [min(p, end) for p in (positions if positions is not None else [c for _, c in numbers])]
    pos = merge_positions(pos, gap)
    values, bounds, seen = [table.value(problem_id, frozenset())], [0], frozenset()
    for i, (n, _) in enumerate(numbers):
        if n in seen:
            continue
        seen = seen | {n}
        if len(bounds) > 1 and bounds[-1] == pos[i]:  # same merged position: one transition, to the latest state
            values[-1] = table.value(problem_id, seen)
        else:
            values.append(table.value(problem_id, seen))
            bounds.append(pos[i])
    return values + [float(reward)], bounds + [end]


def numca_token_advantages(table: NumcaTable, problem_id: str, numbers, reward: float, end: int, T: int,
                           gap: int = 50, lam: float = 1.0, positions: list[int] | None = None) -> torch.Tensor:
    """Segment advantages on each of T positions (0 from ``end`` on): GAE over the Numca value chain."""
    values, bounds = numca_chain(table, problem_id, numbers, reward, end, gap, positions)
    return segment_gae(values, bounds, T, lam)


def state_at(numbers: list[tuple[str, int]], char: int) -> frozenset:
    """The state a cut at character ``char`` has reached: the numbers that end before it (SVEB)."""
    return frozenset(states([n for n, c in numbers if c + len(n) <= char])[-1])


SVEB_PROTOCOLS = ("release", "exact")


def cut_value(table: NumcaTable, problem_id: str, numbers: list[tuple[str, int]], reward: float, length: int,
              cut: int, gap: int = 50, protocol: str = "release") -> float:
    """Numca's SVEB estimate at character ``cut`` of a response of ``length`` characters (its ``numbers`` without the
    answer, ``reward`` binarised).

    ``release`` (the Hista release's ``sveb/numca``): per-character λ = 0 advantages with positions merged within
    ``gap`` characters, then V(∅) plus each segment's δ at the character before which the advantage changes, for
    characters before the cut. So a number merged onto a later position past the cut is not counted, and a δ equal to
    the next segment's is added once only. ``exact``: V of the state the cut has reached (the numbers that end
    before it), what the λ = 0 sum is meant to be."""
    if protocol not in SVEB_PROTOCOLS:
        raise ValueError(f"model.sveb_protocol={protocol!r}: choose release or exact")
    if protocol == "exact":
        return table.value(problem_id, state_at(numbers, cut))
    adv = numca_token_advantages(table, problem_id, numbers, reward, length, length, gap, 0.0).tolist()
    value = table.value(problem_id, frozenset())
    for i in range(min(cut, len(adv))):
        if i + 1 >= len(adv):
            return value + adv[-1]
        if abs(adv[i] - adv[i + 1]) > 1e-6:
            value += adv[i]
    return value
