"""Prompts with verifiable answers for RL post-training (GSM8K format: the answer after ``####``).

Tasks (``data.task``):
- ``arithmetic``: multi-digit ``a + b`` / ``a - b`` / ``a * b`` from a seed; solution ``"a + b = c\\n#### c"``.
- ``word_problems``: short GSM8K-style word problems from templates and a seed, same solution format.
- ``gsm8k``: local GSM8K files (jsonl/parquet with ``question`` / ``answer``; the answer holds ``#### n``;
  MetaMathQA's ``query`` / ``response``, the answer after ``The answer is:``, with data.question_field / answer_field).
- ``math``: local MATH files (``problem`` / ``solution``; the answer is the last ``\\boxed{}``; MATH as released, a
  folder of one-problem .json files, is read as it is: ``data.files=<MATH>/train``), or a file with a
  bare gold answer (DeepScaleR, MATH-500: ``data.answer_field=answer``), read as stored
  (``datamodules.common.answers.gold_answer``; score such LaTeX answers with ``model.reward.compare=math``).

Three disjoint splits by a hash of the problem (``datamodules.common.splits``): a generated problem's key is its
computation (``"3 + 4"``, whatever the names in a word problem), a file record's is its question. No val or test
problem is ever trained on, nor warmed up on (``lightning_modules/common/rl/warmup.py`` draws from the train part).
Files: ``val_files`` / ``test_files`` give a split from its own files (GSM8K: ``test_files`` = the test file,
validation hashed out of the training file); without them val and test are hashed out of ``files``, never the
training records themselves. Checkpoints are selected on val; ``test_dataloader`` serves test, which nothing else reads.

Each item is ``{"prompt": str, "question": str, "answer": str, "solution": str, "prompt_ids": list[int], "id": str}``
(``prompt`` as the policy reads it, ``question`` the bare problem a reward model templates itself); a batch keeps
lists. ``id`` is a stable hash of the problem's key (per-problem state tables, e.g. Numca's, persist on it).
``dynamic_sampling_scale`` = k serves k · batch_size training prompts per batch; the RL module keeps the
batch_size whose group accuracy is nearest 0.5 (the Hista recipes' over-sampling, k = 2).
Prompts read ``"Question: ...\\nAnswer:"`` (the tiny models', whose warm-up teaches that format; a solution is the
completion it teaches). ``chat_template=True`` renders them as the released RL recipes do (Hista's TRL trainers,
RLKV's AReaL workflow): the tokenizer's chat template over ``[system: system_prompt, user: question]`` with the
generation prompt, tokenised without extra special tokens; paper-scale RL runs use it.
"""
from __future__ import annotations

import random

import lightning as L
from torch.utils.data import DataLoader, Dataset

from datamodules.common.answers import gold_answer
from datamodules.common.cache import stable_hash
from datamodules.common.sampling import StepStreamSampler
from datamodules.common.splits import SPLITS, check_fractions, split_of

TASKS = ("arithmetic", "word_problems", "gsm8k", "math")
GENERATED = ("arithmetic", "word_problems")
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
    return {"question": f"What is {a} {op} {b}?", "solution": f"{a} {op} {b} = {c}\n#### {c}", "answer": str(c),
            "key": f"{a} {op} {b}"}


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
    return {"question": q, "solution": f"{sol}\n#### {c}", "answer": str(c), "key": sol.split(" =")[0]}


def generate_problems(task: str, n: int, seed: int, digits: int = 2, operations=("+", "-"), split: str | None = None,
                      val_fraction: float = 0.0, test_fraction: float = 0.0) -> list[dict]:
    """``n`` problems drawn from a seed. With ``split``, only problems whose key hashes into that split; val and
    test problems are distinct, so a small problem space (``digits=1``) may give fewer than ``n``."""
    if task not in GENERATED:
        raise ValueError(f"data.task={task!r} is not generated; generated tasks: {', '.join(GENERATED)}")
    rng = random.Random(seed)

    def draw():
        return arithmetic_problem(rng, digits, operations) if task == "arithmetic" else word_problem(rng, digits)

    if split is None:
        return [draw() for _ in range(n)]
    check_fractions(val_fraction, test_fraction)
    out, seen = [], set()
    for _ in range(50 * n + 10_000):  # enough draws to exhaust a small space's share of a split
        if len(out) == n:
            break
        p = draw()
        if split_of(p["key"], val_fraction, test_fraction) != split or (split != "train" and p["key"] in seen):
            continue
        seen.add(p["key"])
        out.append(p)
    if not out:
        raise ValueError(f"no {task} problem with digits={digits} falls in the {split} split: raise data.{split}_fraction "
                         "or data.digits")
    return out


def load_problems(task: str, files, question_field: str | None = None, answer_field: str | None = None) -> list[dict]:
    """GSM8K / MATH records from local files (``datasets`` via ``load_local``): the gold answer extracted from a
    solution that marks it (``####``, ``\\boxed{}``), a bare answer field read as stored (``gold_answer``)."""
    from datamodules.common.loaders import load_local

    if not files:
        raise ValueError(f"data.task={task}: set data.files=<path or glob of your {task} .jsonl/.parquet files>")
    qf = question_field or ("question" if task == "gsm8k" else "problem")
    af = answer_field or ("answer" if task == "gsm8k" else "solution")
    ds = load_local(files, field=qf)
    if af not in ds.column_names:
        raise ValueError(f"{files}: no column {af!r} (have {ds.column_names}); set data.answer_field")
    out = []
    for q, sol in zip(ds[qf], ds[af]):
        ans = gold_answer(str(sol))
        if ans is not None:
            out.append({"question": q, "solution": sol, "answer": ans})
    return out


def render_prompt(tokenizer, question: str, chat_template: bool = False, system_prompt: str | None = None) -> str:
    """The prompt text of a question: ``PROMPT``, or the tokenizer's chat template (system + user, generation prompt)."""
    if not chat_template:
        return PROMPT.format(q=question)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"data.chat_template=true, but the tokenizer of {getattr(tokenizer, 'name_or_path', '?')} has no "
                         "chat template: use an instruct/chat model's tokenizer or set data.chat_template=false")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class Problems(Dataset):
    def __init__(self, problems: list[dict], tokenizer, max_prompt_tokens: int, chat_template: bool = False,
                 system_prompt: str | None = None):
        self.items = []
        for p in problems:
            prompt = render_prompt(tokenizer, p["question"], chat_template, system_prompt)
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
            self.items.append({"prompt": prompt, "question": p["question"], "answer": p["answer"],
                               "solution": p["solution"], "prompt_ids": ids,
                               "id": stable_hash(p.get("key", p["question"]))})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def collate(items: list[dict]) -> dict:
    return {k: [it[k] for it in items] for k in items[0]}


class VerifiableDataModule(L.LightningDataModule):
    def __init__(self, tokenizer, task: str = "arithmetic", files=None, val_files=None, test_files=None,
                 question_field: str | None = None, answer_field: str | None = None, digits: int = 2,
                 operations=("+", "-"), val_fraction: float = 0.2, test_fraction: float = 0.2, n_train: int = 20000,
                 n_val: int | None = 64, n_test: int | None = 64, batch_size: int = 8, eval_batch_size: int = 32,
                 max_prompt_tokens: int = 512, num_workers: int = 0, seed: int = 0, dynamic_sampling_scale: int = 1,
                 chat_template: bool = False, system_prompt: str | None = None):
        super().__init__()
        self.chat_template, self.system_prompt = chat_template, system_prompt
        if dynamic_sampling_scale < 1:
            raise ValueError(f"data.dynamic_sampling_scale={dynamic_sampling_scale}: must be an integer >= 1 (1 = off)")
        self.dynamic_sampling_scale = int(dynamic_sampling_scale)
        if task not in TASKS:
            raise ValueError(f"data.task={task!r}: choose one of {', '.join(TASKS)}")
        check_fractions(val_fraction, test_fraction)
        self.tokenizer, self.task = tokenizer, task
        self.files, self.val_files, self.test_files = files, val_files, test_files
        self.question_field, self.answer_field = question_field, answer_field
        self.digits, self.operations = digits, tuple(operations)
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.n = {"train": n_train, "val": n_val, "test": n_test}
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.max_prompt_tokens, self.num_workers, self.seed = max_prompt_tokens, num_workers, seed
        self.train_set = self.val_set = self.test_set = None

    def all_problems(self) -> dict[str, list[dict]]:
        """Train / val / test problems: disjoint by the hash of each problem's key."""
        if self.task in GENERATED:
            return {s: generate_problems(self.task, self.n[s], self.seed * 7919 + i, self.digits, self.operations,
                                         s, self.val_fraction, self.test_fraction) for i, s in enumerate(SPLITS)}
        own = {"val": self.val_files, "test": self.test_files}
        fractions = {s: 0.0 if own[s] else getattr(self, f"{s}_fraction") for s in own}
        out = {s: [] for s in SPLITS}
        for p in self.load(self.files):
            out[split_of(p["question"], fractions["val"], fractions["test"])].append(p)
        for s, files in own.items():
            if files:
                out[s] = self.load(files)
        cap = {**self.n, "train": None}  # every training record; n_val / n_test cap the evaluations
        return {s: ps if cap[s] is None else ps[: cap[s]] for s, ps in out.items()}

    def load(self, files) -> list[dict]:
        return load_problems(self.task, files, self.question_field, self.answer_field)

    def setup(self, stage: str | None = None):
        if self.train_set is None:
            problems = self.all_problems()
            for s in SPLITS:
                if not problems[s]:
                    raise ValueError(f"the {s} split holds no problem: raise data.{s}_fraction or give data.{s}_files")
            self.train_set, self.val_set, self.test_set = (
                Problems(problems[s], self.tokenizer, self.max_prompt_tokens, self.chat_template, self.system_prompt)
                for s in SPLITS)

    def train_dataloader(self):
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        steps = trainer.max_steps if trainer is not None and trainer.max_steps and trainer.max_steps > 0 else 1000
        # one batch of prompts gives >= 1 optimizer step, so max_steps batches always suffice
        size = self.batch_size * self.dynamic_sampling_scale
        sampler = StepStreamSampler(len(self.train_set), steps * size, seed=self.seed, rank=rank, world_size=world)
        return DataLoader(self.train_set, batch_size=size, sampler=sampler, collate_fn=collate,
                          num_workers=self.num_workers, drop_last=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.eval_batch_size, shuffle=False, collate_fn=collate,
                          num_workers=self.num_workers)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.eval_batch_size, shuffle=False, collate_fn=collate,
                          num_workers=self.num_workers)
