"""Prompts with verifiable answers for RL post-training (GSM8K format: the answer after ``####``).

Tasks (``data.task``):
- ``arithmetic``: multi-digit ``a + b`` / ``a - b`` / ``a * b`` from a seed; solution ``"a + b = c\\n#### c"``.
- ``word_problems``: short GSM8K-style word problems from templates and a seed, same solution format.
- ``gsm8k``: local GSM8K files (jsonl/parquet with ``question`` / ``answer``; the answer holds ``#### n``).
- ``math``: local MATH files (``problem`` / ``solution``; the answer is the last ``\\boxed{}``).

Each item is ``{"prompt": str, "answer": str, "solution": str, "prompt_ids": list[int]}``; a batch keeps lists.
Prompts read ``"Question: ...\\nAnswer:"``; a solution is the completion the supervised warm-up teaches.
"""
from __future__ import annotations

import random

import lightning as L
from torch.utils.data import DataLoader, Dataset

from datamodules.common.sampling import StepStreamSampler

TASKS = ("arithmetic", "word_problems", "gsm8k", "math")
PROMPT = "Question: {q}\nAnswer:"

_NAMES = ["Tom", "Ana", "Li", "Sam", "Mia", "Ravi", "Zoe", "Omar"]
_ITEMS = ["apples", "books", "coins", "pens", "cards", "stones"]


def arithmetic_problem(rng: random.Random, digits: int = 2, operations=("+", "-")) -> dict:
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10 ** digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    op = rng.choice(list(operations))
    if op == "-" and b > a:
        a, b = b, a
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"question": f"What is {a} {op} {b}?", "solution": f"{a} {op} {b} = {c}\n#### {c}", "answer": str(c)}


def word_problem(rng: random.Random, digits: int = 2) -> dict:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    hi = 10 ** digits - 1
    a, b = rng.randint(2, hi), rng.randint(1, hi)
    if rng.random() < 0.5:
        q = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
        sol, c = f"{a} + {b} = {a + b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        q = f"{name} has {a} {item} and gives away {b} of them. How many {item} are left?"
        sol, c = f"{a} - {b} = {a - b}", a - b
    return {"question": q, "solution": f"{sol}\n#### {c}", "answer": str(c)}


def generate_problems(task: str, n: int, seed: int, digits: int = 2, operations=("+", "-")) -> list[dict]:
    rng = random.Random(seed)
    if task == "arithmetic":
        return [arithmetic_problem(rng, digits, operations) for _ in range(n)]
    if task == "word_problems":
        return [word_problem(rng, digits) for _ in range(n)]
    raise ValueError(f"data.task={task!r} is not generated; generated tasks: arithmetic, word_problems")


def load_problems(task: str, files, question_field: str | None = None, answer_field: str | None = None) -> list[dict]:
    """GSM8K / MATH records from local files (``datasets`` via ``load_local``), answers extracted as for rewards."""
    from datamodules.common.loaders import load_local
    from lightning_modules.common.rl.rewards import extract_answer

    if not files:
        raise ValueError(f"data.task={task}: set data.files=<path or glob of your {task} .jsonl/.parquet files>")
    qf = question_field or ("question" if task == "gsm8k" else "problem")
    af = answer_field or ("answer" if task == "gsm8k" else "solution")
    ds = load_local(files, field=qf)
    if af not in ds.column_names:
        raise ValueError(f"{files}: no column {af!r} (have {ds.column_names}); set data.answer_field")
    out = []
    for q, sol in zip(ds[qf], ds[af]):
        ans = extract_answer(sol)
        if ans is not None:
            out.append({"question": q, "solution": sol, "answer": ans})
    return out


class Problems(Dataset):
    def __init__(self, problems: list[dict], tokenizer, max_prompt_tokens: int):
        self.items = []
        for p in problems:
            prompt = PROMPT.format(q=p["question"])
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
            self.items.append({"prompt": prompt, "answer": p["answer"], "solution": p["solution"], "prompt_ids": ids})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(items: list[dict]) -> dict:
    return {k: [it[k] for it in items] for k in items[0]}


class VerifiableDataModule(L.LightningDataModule):
    def __init__(self, tokenizer, task: str = "arithmetic", files=None, val_files=None, question_field: str | None = None,
                 answer_field: str | None = None, digits: int = 2, operations=("+", "-"), n_train: int = 20000,
                 n_val: int = 64, batch_size: int = 8, eval_batch_size: int = 32, max_prompt_tokens: int = 512,
                 num_workers: int = 0, seed: int = 0):
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"data.task={task!r}: choose one of {', '.join(TASKS)}")
        self.tokenizer, self.task, self.files, self.val_files = tokenizer, task, files, val_files
        self.question_field, self.answer_field = question_field, answer_field
        self.digits, self.operations = digits, tuple(operations)
        self.n_train, self.n_val = n_train, n_val
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.max_prompt_tokens, self.num_workers, self.seed = max_prompt_tokens, num_workers, seed
        self.train_set = self.val_set = None

    def problems(self, split: str) -> list[dict]:
        if self.task in ("arithmetic", "word_problems"):
            n = self.n_train if split == "train" else self.n_val
            return generate_problems(self.task, n, self.seed * 7919 + (0 if split == "train" else 1), self.digits, self.operations)
        files = self.files if split == "train" else (self.val_files or self.files)
        probs = load_problems(self.task, files, self.question_field, self.answer_field)
        return probs if split == "train" or self.val_files else probs[: self.n_val]

    def setup(self, stage: str | None = None):
        if self.train_set is None:
            self.train_set = Problems(self.problems("train"), self.tokenizer, self.max_prompt_tokens)
            self.val_set = Problems(self.problems("val"), self.tokenizer, self.max_prompt_tokens)

    def train_dataloader(self):
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        steps = trainer.max_steps if trainer is not None and trainer.max_steps and trainer.max_steps > 0 else 1000
        # one batch of prompts gives >= 1 optimizer step, so max_steps batches always suffice
        sampler = StepStreamSampler(len(self.train_set), steps * self.batch_size, seed=self.seed, rank=rank, world_size=world)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=self.num_workers, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.eval_batch_size, shuffle=False, collate_fn=collate,
                          num_workers=self.num_workers)

    def test_dataloader(self):
        return self.val_dataloader()
