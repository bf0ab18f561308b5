"""Repetitive deterministic tasks of complexity n (error_law, arXiv 2601.14175) and their datamodule.

Eight generators, each answer computed in Python by the step-by-step procedure the model has to emulate
(schoolbook carries, a DP table, one map after another); tests check each against an independent solution.
n is the number of input items processed:

    copy, reversal, sorting        n digits; answer the digits copied / reversed / sorted
    addition                       two n-digit numbers; their sum
    multiplication                 an n-digit number times a ``mul_digits``-digit one; the product
    running_sum                    n digits; their sum mod ``modulus``
    lis                            n two-digit numbers; the length of the longest strictly increasing subsequence
    linear_maps                    x0 and n maps x -> a·x + b mod ``prime``; the image of x0 under their composition

``format``: ``plain`` writes the items as they are (``rev:31415=``); ``delimited`` cuts every operand into chunks of
``chunk`` items separated by ``|``, each chunk opened by a position marker (a, b, c, ...), and writes sequence
answers the same way (``rev:a3141|b5=`` -> ``a5141|b3``): the paper's error-reducing prompts, as the spec infers
them. Scoring strips markers and delimiters from the prediction and compares with the plain answer.
An instance's content depends on (seed, split, task, n, index) only, not on the format, so both formats of a
cell see the same problems. ``chat_prompt`` is the same problem in words, for API models.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

FORMATS = ("plain", "delimited")
OPTIONS = {"modulus": 10, "prime": 7, "mul_digits": 2}  # the task options' defaults
MARKERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Problem:
    fields: tuple[tuple[str, ...], ...]  # the operands, each a tuple of items
    answer: str                           # plain answer
    sequence: bool = False                # the answer is a sequence of items (delimited like the input)


def _digits(rng, n, lead_nonzero=False):
    d = [str(rng.randrange(10)) for _ in range(n)]
    if lead_nonzero and n > 1:
        d[0] = str(rng.randrange(1, 10))
    return d


def gen_copy(n, rng, **_):
    x = _digits(rng, n)
    return Problem((tuple(x),), "".join(x[i] for i in range(n)), True)


def gen_reversal(n, rng, **_):
    x = _digits(rng, n)
    return Problem((tuple(x),), "".join(x[n - 1 - i] for i in range(n)), True)


def gen_sorting(n, rng, **_):
    x = _digits(rng, n)
    counts = [0] * 10  # counting sort
    for d in x:
        counts[int(d)] += 1
    return Problem((tuple(x),), "".join(str(v) * c for v, c in enumerate(counts)), True)


def gen_addition(n, rng, **_):
    a, b = _digits(rng, n, True), _digits(rng, n, True)
    out, carry = [], 0
    for i in range(n - 1, -1, -1):  # schoolbook, right to left
        s = int(a[i]) + int(b[i]) + carry
        out.append(str(s % 10))
        carry = s // 10
    if carry:
        out.append(str(carry))
    return Problem((tuple(a), tuple(b)), "".join(reversed(out)))


def gen_multiplication(n, rng, mul_digits=2, **_):
    a, b = _digits(rng, n, True), _digits(rng, mul_digits, True)
    acc = [0] * (n + mul_digits)  # long multiplication: every digit pair into its place, then the carries
    for i, da in enumerate(reversed(a)):
        for j, db in enumerate(reversed(b)):
            acc[i + j] += int(da) * int(db)
    for i in range(len(acc) - 1):
        acc[i + 1] += acc[i] // 10
        acc[i] %= 10
    digits = "".join(map(str, reversed(acc))).lstrip("0")
    return Problem((tuple(a), tuple(b)), digits or "0")


def gen_running_sum(n, rng, modulus=10, **_):
    x = _digits(rng, n)
    s = 0
    for d in x:
        s = (s + int(d)) % modulus
    return Problem((tuple(x),), str(s))


def gen_lis(n, rng, **_):
    x = [rng.randrange(100) for _ in range(n)]
    best = [1] * n  # best[i]: the longest strictly increasing subsequence ending at i
    for i in range(n):
        for j in range(i):
            if x[j] < x[i]:
                best[i] = max(best[i], best[j] + 1)
    return Problem((tuple(f"{v:02d}" for v in x),), str(max(best)))


def gen_linear_maps(n, rng, prime=7, **_):
    x0 = rng.randrange(prime)
    maps = [(rng.randrange(1, prime), rng.randrange(prime)) for _ in range(n)]
    x = x0
    for a, b in maps:
        x = (a * x + b) % prime
    return Problem(((str(x0),), tuple(f"{a}{b}" for a, b in maps)), str(x))


@dataclass(frozen=True)
class Task:
    make: object
    tag: str        # the compact prompt's prefix
    joiners: tuple  # (between items, between operands)
    words: str      # the instruction for chat models


TASKS = {
    "copy": Task(gen_copy, "cp", ("", ""), "Copy the digit sequence exactly."),
    "reversal": Task(gen_reversal, "rev", ("", ""), "Write the digit sequence in reverse order."),
    "sorting": Task(gen_sorting, "srt", ("", ""), "Sort the digits in non-decreasing order."),
    "addition": Task(gen_addition, "add", ("", "+"), "Add the two numbers."),
    "multiplication": Task(gen_multiplication, "mul", ("", "*"), "Multiply the two numbers."),
    "running_sum": Task(gen_running_sum, "sum", ("", ""),
                        "Add up the digits, reducing modulo {modulus} after each step; give the final value."),
    "lis": Task(gen_lis, "lis", (",", ""),
                "Give the length of the longest strictly increasing subsequence of these two-digit numbers."),
    "linear_maps": Task(gen_linear_maps, "lin", (",", ">"),
                        "Start from the number before '>'. Each pair 'ab' after it is the map x -> (a*x + b) mod "
                        "{prime}; apply them from left to right and give the final value."),
}


def check_task(task: str) -> Task:
    if task not in TASKS:
        raise ValueError(f"unknown error_law task {task!r}: choose from {', '.join(TASKS)}")
    return TASKS[task]


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: choose plain or delimited")
    return fmt


def problem(task: str, n: int, rng: random.Random, **options) -> Problem:
    if n <= 0:
        raise ValueError(f"complexity n={n}: every n in the grid must be a positive integer")
    return check_task(task).make(n, rng, **options)


def _render(items, sep, fmt, chunk):
    if fmt == "plain":
        return sep.join(items)
    return "|".join(MARKERS[(i // chunk) % len(MARKERS)] + sep.join(items[i:i + chunk]) for i in range(0, len(items), chunk))


def render(task: str, prob: Problem, fmt: str, chunk: int = 4) -> tuple[str, str]:
    """(compact prompt, gold completion) of a problem in a format: ``rev:a3141|b5=`` and ``a5141|b3``."""
    t, fmt = check_task(task), check_format(fmt)
    sep, op = t.joiners
    body = op.join(_render(list(f), sep, fmt, chunk) for f in prob.fields)
    gold = _render(list(prob.answer), "", fmt, chunk) if prob.sequence else prob.answer
    return f"{t.tag}:{body}=", gold


def chat_prompt(task: str, prob: Problem, fmt: str, chunk: int = 4, **options) -> str:
    """The problem in words for a chat model, asking for the answer alone after 'Answer:'."""
    t = check_task(task)
    _, op = t.joiners
    body = render(task, prob, fmt, chunk)[0].split(":", 1)[1].rstrip("=")
    note = ""
    if fmt == "delimited":
        note = (f"The input is cut into chunks of {chunk} items separated by '|'; each chunk starts with a position "
                "letter (a, b, c, ...)." + (" Write the answer in the same chunked form." if prob.sequence else "") + "\n")
    return (f"{t.words.format(**{**OPTIONS, **options})}\n{note}Input: {body}\n"
            "Think as you need, then end your reply with one line 'Answer: <answer>'.")


def canonical(text: str, fmt: str) -> str:
    """A prediction as a plain answer: after the last 'Answer:' (chat replies), its first line, without markers
    and delimiters (delimited format) or spaces."""
    if "Answer:" in text:
        text = text.rsplit("Answer:", 1)[1]
    text = text.strip().split("\n")[0]
    if fmt == "delimited":
        text = re.sub(r"[a-z|]", "", text)
    return re.sub(r"\s+", "", text)


def instance(task: str, n: int, index: int, fmt: str, split: str = "test", seed: int = 0, chunk: int = 4,
             **options) -> dict:
    """One scored instance; the problem depends on (seed, split, task, n, index), not on the format."""
    prob = problem(task, n, random.Random(f"{seed}:{split}:{task}:{n}:{index}"), **options)
    prompt, gold = render(task, prob, fmt, chunk)
    return {"task": task, "format": fmt, "n": n, "index": index, "prompt": prompt, "gold": gold,
            "answer": prob.answer, "chat": chat_prompt(task, prob, fmt, chunk, **options)}


class _Training(Dataset):
    """Item i: a random (task, format, n ≤ n_max) instance seeded by i (deterministic, so runs resume)."""

    def __init__(self, dm, split, size):
        self.dm, self.split, self.size = dm, split, size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        dm = self.dm
        rng = random.Random(f"{dm.seed}:{self.split}:{i}")
        task, fmt = rng.choice(dm.tasks), rng.choice(dm.formats)
        n = rng.randint(dm.train_n_min, dm.train_n_max)
        return instance(task, n, i, fmt, self.split, dm.seed, dm.chunk, **dm.options)


class ErrorLawDataModule(L.LightningDataModule):
    """Training sequences ``prompt + gold + eos`` (loss on the completion only) for the tiny char-level model, a
    fixed validation set of the same kind, and the test grid: ``samples_per_n`` instances per (task, format, n).

    Args:
        tokenizer: the model's tokenizer (``char_tokenizer`` for the tiny model); None for an endpoint.
        tasks, formats: what is trained on and tested (every pair).
        n_grid: the tested complexities (positive integers).
        samples_per_n: instances per (task, format, n).
        train_n_min, train_n_max: training complexities, uniform.
        chunk: items per chunk in the delimited format.
        options: task options (``modulus`` of running_sum, ``prime`` of linear_maps, ``mul_digits``).
    """

    def __init__(self, tokenizer=None, tasks=("copy", "reversal"), formats=FORMATS, n_grid=(2, 4, 8),
                 samples_per_n=16, train_n_min=1, train_n_max=20, chunk=4, batch_size=32, eval_batch_size=64,
                 n_val=128, options=None, seed=0, num_workers=0):
        super().__init__()
        self.tasks = [t for t in tasks if check_task(t)]
        self.formats = [check_format(f) for f in formats]
        bad = [n for n in n_grid if int(n) != n or n <= 0]
        if bad:
            raise ValueError(f"data.n_grid has {bad}: every complexity n must be a positive integer")
        if not 1 <= train_n_min <= train_n_max:
            raise ValueError(f"data.train_n_min={train_n_min}, train_n_max={train_n_max}: need 1 <= min <= max")
        self.tokenizer, self.n_grid, self.samples_per_n = tokenizer, [int(n) for n in n_grid], samples_per_n
        self.train_n_min, self.train_n_max, self.chunk = train_n_min, train_n_max, chunk
        self.batch_size, self.eval_batch_size, self.n_val = batch_size, eval_batch_size, n_val
        self.options, self.seed, self.num_workers = dict(options or {}), seed, num_workers

    def test_instances(self) -> list[dict]:
        return [instance(t, n, i, f, "test", self.seed, self.chunk, **self.options)
                for t in self.tasks for f in self.formats for n in self.n_grid for i in range(self.samples_per_n)]

    def encode(self, items: list[dict]) -> dict:
        """Right-padded ``prompt + gold + eos`` with labels on ``gold + eos`` only."""
        tok = self.tokenizer
        seqs, labels = [], []
        for it in items:
            p = tok(it["prompt"], add_special_tokens=False)["input_ids"]
            g = tok(it["gold"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seqs.append(p + g)
            labels.append([-100] * len(p) + g)
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
        lab = torch.full((len(seqs), width), -100, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (s, l) in enumerate(zip(seqs, labels)):
            ids[i, :len(s)], lab[i, :len(l)], mask[i, :len(s)] = torch.tensor(s), torch.tensor(l), 1
        return {"input_ids": ids, "attention_mask": mask, "labels": lab}

    def _needs_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("training on error_law tasks needs a tokenizer: set data.tokenizer (char_tokenizer)")

    def train_dataloader(self):
        self._needs_tokenizer()
        return DataLoader(_Training(self, "train", 10 ** 9), batch_size=self.batch_size, collate_fn=self.encode,
                          num_workers=self.num_workers)

    def val_dataloader(self):
        self._needs_tokenizer()
        return DataLoader(_Training(self, "val", self.n_val), batch_size=self.eval_batch_size, collate_fn=self.encode,
                          num_workers=self.num_workers)

    def test_dataloader(self):
        # one (task, format, n) cell per batch run, so left padding stays small
        items = self.test_instances()
        return DataLoader(items, batch_size=self.eval_batch_size, collate_fn=list, num_workers=self.num_workers)
