"""A RULER-style synthetic long-context suite, generated locally from a seed (RULER itself is synthetic).

Tasks (names as in RULER, Hsieh et al. 2024; our re-implementation of its templates):

- ``niah_single``: one "One of the special magic numbers for <word> is: <7 digits>." line in repeated noise.
- ``niah_multikey_2``: the haystack is made of such needle lines with other keys; find the value of one key
  (the paper's "2-key NIAH" [INF]: RULER's niah_multikey_2).
- ``niah_multikey_3``: the same with UUID keys and UUID values (the paper's "3-key NIAH" [INF]: niah_multikey_3).
- ``niah_multivalue``: four values for one key in noise; all four must be recalled.
- ``niah_multiquery``: four keys in noise, all four asked at once.
- ``vt``: variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) in noise; name every variable.
- ``cwe``: common-words extraction: a numbered word list where 10 words appear often; name those 10.

Every sample is ``{task, context, question, answer_prefix, outputs, max_new_tokens, length}``: only ``context`` is
compressed; ``question`` + ``answer_prefix`` are appended after compression (kvpress's RULER protocol). Lengths are
in tokens of the run's tokenizer, the whole prompt never longer than asked. Scoring is RULER's string match: all
references for these tasks, any reference for QA tasks (``qa_*``).

``source: files`` reads real RULER data instead, in the layout of kvpress's ``simonjegou/ruler`` dataset (a local
copy of it, e.g. ``huggingface-cli download simonjegou/ruler --repo-type dataset --local-dir <dir>``): one
sub-directory per context length (``<dir>/4096/``, ``<dir>/8192/``, ...) of parquet or jsonl records with fields
``context``, ``question``, ``answer_prefix``, ``answer`` (or ``outputs``), ``task``, ``max_new_tokens``, and RULER's
13 task names (``RULER_TASKS``). ``lengths`` picks the sub-directories, ``tasks`` the tasks, ``samples_per_task``
the first records of each task x length.
"""
from __future__ import annotations

import random
import re
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from datamodules.synthetic import FILLER

TASKS = ("niah_single", "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe")
# the 13 tasks of RULER (Hsieh et al., 2024) as named in its data and in kvpress's dataset: the paper's average
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
               "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
# RULER's tokens_to_generate
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120}


@lru_cache(maxsize=1)
def word_list() -> tuple[str, ...]:
    """Distinct lowercase English words (4-10 letters) from the Python reference manual: stable, no download."""
    from pydoc_data.topics import topics

    words = set()
    for text in topics.values():
        words.update(w for w in re.findall(r"\b[a-z]{4,10}\b", text))
    return tuple(sorted(words))


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _fit(tokenizer, n_tokens: int, build, hi: int) -> Any:
    """The largest ``k`` in [0, hi] whose ``build(k)`` prompt fits ``n_tokens``; build returns (sample, prompt)."""
    lo, best = 0, None
    sample, prompt = build(0)
    if _n_tokens(tokenizer, prompt) > n_tokens:
        raise ValueError(f"data.lengths: {n_tokens} tokens is too short for this task's prompt "
                         f"({_n_tokens(tokenizer, prompt)} tokens without any haystack); use longer lengths")
    best = sample
    while lo < hi:
        mid = (lo + hi + 1) // 2
        sample, prompt = build(mid)
        if _n_tokens(tokenizer, prompt) <= n_tokens:
            lo, best = mid, sample
        else:
            hi = mid - 1
    return best


def _key(rng: random.Random) -> str:
    words = word_list()
    return f"{rng.choice(words)}-{rng.choice(words)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(10 ** 6, 10 ** 7 - 1))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _niah(task: str, tokenizer, n_tokens: int, rng: random.Random) -> dict:
    kind = "uuids" if task == "niah_multikey_3" else "numbers"
    new_key, new_value = (_uuid, _uuid) if task == "niah_multikey_3" else (_key, _number)
    n_keys = 4 if task == "niah_multiquery" else 1
    n_values = 4 if task == "niah_multivalue" else 1
    keys = [new_key(rng) for _ in range(n_keys)]
    values = [[new_value(rng) for _ in range(n_values)] for _ in keys]
    needles = [f"One of the special magic {kind} for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
    needle_hay = task in ("niah_multikey_2", "niah_multikey_3")
    hay = []
    while len(hay) * 8 <= n_tokens:  # every unit is more than 8 tokens: enough units to fill any budget
        if needle_hay:  # distractor needles with other keys
            k = new_key(rng)
            while k in keys:
                k = new_key(rng)
            hay.append(f"One of the special magic {kind} for {k} is: {new_value(rng)}.")
        else:
            hay.append(FILLER.strip())
    depths = [rng.random() for _ in needles]
    query = ", ".join(keys)
    question = f"What are all the special magic {kind} for {query} mentioned in the provided text?"
    answer_prefix = f" The special magic {kind} for {query} mentioned in the provided text are"
    intro = (f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
             f"I will quiz you about the {kind} afterwards.\n")

    def build(k: int):
        units = list(hay[:k])
        for needle, d in zip(needles, depths):
            units.insert(int(d * len(units)), needle)
        context = intro + " ".join(units) + "\n"
        sample = {"context": context, "question": question, "answer_prefix": answer_prefix,
                  "outputs": [v for vs in values for v in vs], "max_new_tokens": MAX_NEW_TOKENS["niah"]}
        return sample, context + question + answer_prefix

    return _fit(tokenizer, n_tokens, build, len(hay))


def _vt(tokenizer, n_tokens: int, rng: random.Random, hops: int = 4) -> dict:
    names = []
    while len(names) < hops + 1:
        n = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if n not in names:
            names.append(n)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    depths = sorted(rng.random() for _ in chain)
    question = f"Question: Find all variables that are assigned the value {value} in the text above."
    answer_prefix = (f" Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} "
                     f"variables are assigned the value {value}, they are:")
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"

    def build(k: int):
        units = [FILLER.strip()] * k
        for offset, (line, d) in enumerate(zip(chain, depths)):
            units.insert(int(d * k) + offset, line)  # depths sorted: the chain stays in order
        context = intro + " ".join(units) + "\n"
        sample = {"context": context, "question": question, "answer_prefix": answer_prefix, "outputs": names,
                  "max_new_tokens": MAX_NEW_TOKENS["vt"]}
        return sample, context + question + answer_prefix

    return _fit(tokenizer, n_tokens, build, n_tokens // 8 + 1)


def _cwe(tokenizer, n_tokens: int, rng: random.Random, n_common: int = 10, freq_common: int = 30,
         freq_rare: int = 3) -> dict:
    words = list(word_list())
    rng.shuffle(words)
    common, rare = words[:n_common], words[n_common:]
    question = f"Question: What are the {n_common} most common words in the above list?"
    answer_prefix = f" Answer: The top {n_common} words that appear most often in the list are:"
    intro = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n"

    def build_with(freq_c: int, freq_r: int):
        def build(k: int):
            items = common * freq_c + rare[:k] * freq_r
            order = random.Random(k * 1000 + freq_c).sample(items, len(items))
            context = intro + " ".join(f"{i + 1}. {w}" for i, w in enumerate(order)) + "\n"
            sample = {"context": context, "question": question, "answer_prefix": answer_prefix, "outputs": common,
                      "max_new_tokens": MAX_NEW_TOKENS["cwe"], "n_rare": k}
            return sample, context + question + answer_prefix
        return build

    # short contexts cannot hold 10 words x 30: lower the frequencies (common words always the more frequent)
    # until at least as many rare words as common ones fit
    for freq_c in range(freq_common, 1, -1):
        try:
            sample = _fit(tokenizer, n_tokens, build_with(freq_c, min(freq_rare, freq_c - 1)), min(len(rare), n_tokens // 2))
        except ValueError:
            continue
        if sample.pop("n_rare") >= n_common:
            return sample
    raise ValueError(f"data.lengths: {n_tokens} tokens is too short for cwe ({n_common} words twice, {n_common} once); "
                     "use longer lengths or leave cwe out of data.tasks")


def ruler_sample(task: str, tokenizer, n_tokens: int, seed: int) -> dict:
    """One sample of ``task`` with at most ``n_tokens`` prompt tokens, deterministic in (task, n_tokens, seed)."""
    rng = random.Random(f"{task}-{n_tokens}-{seed}")
    if task.startswith("niah"):
        sample = _niah(task, tokenizer, n_tokens, rng)
    elif task == "vt":
        sample = _vt(tokenizer, n_tokens, rng)
    elif task == "cwe":
        sample = _cwe(tokenizer, n_tokens, rng)
    else:
        raise ValueError(f"data.tasks: unknown task {task!r}; choose from {', '.join(TASKS)}")
    return {"task": task, "length": n_tokens, **sample}


def load_ruler_files(root, lengths: Sequence[int], tasks: Sequence[str] | None = None,
                     samples_per_task: int | None = None) -> list[dict]:
    """Real RULER data from a local copy in kvpress's layout: ``<root>/<length>/*.parquet`` (or jsonl), one record per
    context/question. The first ``samples_per_task`` records of each task x length, sample-major like the generator."""
    from datamodules.common.loaders import load_local

    root = Path(root).expanduser()
    found = sorted(p.name for p in root.glob("*") if p.is_dir() and p.name.isdigit())
    cells: dict[tuple[int, str], list[dict]] = {}
    for n in lengths:
        folder = root / str(n)
        if not folder.is_dir():
            raise ValueError(f"data.files={str(root)!r} has no {n}/ directory (context lengths there: {found or 'none'}); "
                             "RULER in kvpress's layout has one sub-directory per length: fix data.lengths or data.files")
        kinds = [k for k in ("parquet", "jsonl", "json") if any(folder.glob(f"*.{k}"))]
        if not kinds:
            raise ValueError(f"data.files: {folder} holds no .parquet / .jsonl files")
        ds = load_local(str(folder / f"*.{kinds[0]}"), field=None)
        missing = {"context", "question", "task"} - set(ds.column_names)
        if missing or not ({"answer", "outputs"} & set(ds.column_names)):
            raise ValueError(f"data.files: RULER records need fields context, question, task and answer (or outputs); "
                             f"missing {sorted(missing) or ['answer']} in columns {ds.column_names} of {folder}")
        for rec in ds:
            if tasks and rec["task"] not in tasks:
                continue
            cell = cells.setdefault((n, rec["task"]), [])
            if samples_per_task and len(cell) >= samples_per_task:
                continue
            refs = rec.get("answer", rec.get("outputs"))
            cell.append({"task": rec["task"], "length": n, "context": rec["context"], "question": rec["question"],
                         "answer_prefix": rec.get("answer_prefix") or "",
                         "outputs": [str(r) for r in refs] if isinstance(refs, (list, tuple)) else [str(refs)],
                         "max_new_tokens": rec.get("max_new_tokens") or 128})
        absent = [t for t in (tasks or ()) if (n, t) not in cells]
        if absent:
            raise ValueError(f"data.tasks: {absent} not in {folder}; leave them out of data.tasks")
    order = sorted(cells, key=lambda c: (lengths.index(c[0]), RULER_TASKS.index(c[1]) if c[1] in RULER_TASKS else 99, c[1]))
    depth = max((len(v) for v in cells.values()), default=0)
    return [cells[c][i] for i in range(depth) for c in order if i < len(cells[c])]


def encode(sample: dict, tokenizer, chat_template: bool = False) -> dict:
    """Token ids: ``context_ids`` (compressed), ``question_ids`` (question + answer prefix, appended after
    compression) and ``gold_ids`` (the first reference, for a teacher-forced answer NLL)."""
    context, question = sample["context"], sample["question"] + sample["answer_prefix"]
    if chat_template and getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template([{"role": "user", "content": sample["context"] + sample["question"]}],
                                             tokenize=False, add_generation_prompt=True)
        cut = full.rindex(sample["question"])
        context, question = full[:cut], full[cut:] + sample["answer_prefix"]
        bos = []
    else:
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    return {**sample, "context_ids": torch.tensor(bos + ids(context)), "question_ids": torch.tensor(ids(question)),
            "gold_ids": torch.tensor(ids(" " + sample["outputs"][0]))}


def _first(batch: list[dict]) -> dict:
    if len(batch) != 1:
        raise ValueError("the RULER suite runs one context at a time: set data.batch_size=1")
    return batch[0]


class RulerDataModule(L.LightningDataModule):
    """The suite as a test set: ``samples_per_task`` contexts for each task x length (one question each).

    Args:
        tokenizer: the run's tokenizer (the model's own at paper scale).
        tasks: which tasks; ``None`` = every task of the source (the 7 generated ones, or RULER's 13 from files).
        lengths: context lengths in tokens (generated at that length, or the files' ``<length>/`` directories).
        samples_per_task: per task x length (files: the first ones; ``None`` = all of them).
        source: ``synthetic`` (generated from ``seed``) or ``files`` (real RULER data under ``files``).
        chat_template: wrap context + question in the tokenizer's chat template (instruct models), split so the
            question is still appended after compression.
    """

    def __init__(self, tokenizer, tasks: Sequence[str] | None = None, lengths: Sequence[int] = (4096,),
                 samples_per_task: int | None = 10, seed: int = 0, source: str = "synthetic", files: Any = None,
                 chat_template: bool = False, batch_size: int = 1, num_workers: int = 0):
        super().__init__()
        if source not in ("synthetic", "files"):
            raise ValueError(f"data.source={source!r}: choose synthetic or files")
        if source == "files" and not files:
            raise ValueError("data.source=files needs data.files=<directory of RULER data, one sub-directory per length>")
        known = RULER_TASKS if source == "files" else TASKS
        tasks = list(tasks) if tasks else list(known)
        unknown = [t for t in tasks if t not in known]
        if unknown:
            raise ValueError(f"data.tasks: unknown {unknown} for data.source={source}; choose from {', '.join(known)}")
        if source == "synthetic" and not samples_per_task:
            raise ValueError("data.samples_per_task: the generator needs a number of samples per task x length")
        self.tokenizer = tokenizer
        self.tasks, self.lengths = tasks, [int(n) for n in lengths]
        self.samples_per_task, self.seed = samples_per_task, seed
        self.source, self.files, self.chat_template = source, files, chat_template
        self.batch_size, self.num_workers = batch_size, num_workers
        self.samples: list[dict] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.samples is not None:
            return
        if self.source == "files":
            raw = load_ruler_files(self.files, self.lengths, self.tasks, self.samples_per_task)
        else:
            # sample-major order: the first batches cover every task and length (debug limits stay informative)
            raw = [ruler_sample(t, self.tokenizer, n, self.seed + i)
                   for i in range(self.samples_per_task) for n in self.lengths for t in self.tasks]
        self.samples = [encode(s, self.tokenizer, self.chat_template) for s in raw]

    def test_dataloader(self):
        self.setup()
        return DataLoader(self.samples, batch_size=self.batch_size, shuffle=False, collate_fn=_first,
                          num_workers=self.num_workers)


# --- the dry run's miniature of kvpress's RULER layout (datamodules/common/miniature.py) ---------------------------
from datamodules.common.miniature import register_layout, write_jsonl  # noqa: E402


@register_layout("ruler")
def write_ruler_miniature(target: Path, cfg) -> None:
    """``<target>/<length>/test.jsonl`` for each of ``data.lengths``: two records per RULER task with kvpress's fields
    (``context``, ``question``, ``answer_prefix``, ``answer`` as a list, ``task``, ``max_new_tokens``); the context is
    filler of about ``length`` tokens with the needle line at a seeded depth."""
    rng = random.Random(0)
    budget = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
    for n in cfg.data.lengths:
        records = []
        for i in range(2):
            for task in RULER_TASKS:
                key, value = _key(rng), _number(rng)
                units = [FILLER.strip()] * max(1, int(n) // 24)
                units.insert(rng.randrange(len(units) + 1), f"One of the special magic numbers for {key} is: {value}.")
                records.append({"context": " ".join(units), "task": task, "answer": [value],
                                "question": f" What is the special magic number for {key} mentioned in the provided text?",
                                "answer_prefix": f" The special magic number for {key} mentioned in the provided text is",
                                "max_new_tokens": budget[task.split("_")[0]]})
        (target / str(n)).mkdir(parents=True, exist_ok=True)
        write_jsonl(target / str(n) / "test.jsonl", records)
