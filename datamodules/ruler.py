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

``source: files`` loads real RULER data instead (jsonl/parquet in kvpress's ``simonjegou/ruler`` layout: fields
``context``, ``question``, ``answer_prefix``, ``answer`` (or ``outputs``), ``task``, ``max_new_tokens``).
"""
from __future__ import annotations

import random
import re
import uuid
from functools import lru_cache
from typing import Any, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader

from datamodules.synthetic import FILLER

TASKS = ("niah_single", "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe")
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


def load_ruler_files(files, max_samples: int | None = None) -> list[dict]:
    """Real RULER data from local files in kvpress's layout (one record per context/question)."""
    from datamodules.common.loaders import load_local

    ds = load_local(files, field=None)
    need = {"context", "question", "task"}
    missing = need - set(ds.column_names)
    if missing or not ({"answer", "outputs"} & set(ds.column_names)):
        raise ValueError(f"data.files: RULER records need fields context, question, task and answer (or outputs); "
                         f"missing {sorted(missing) or ['answer']} in columns {ds.column_names}")
    out = []
    for rec in ds:
        refs = rec.get("answer", rec.get("outputs"))
        out.append({"task": rec["task"], "length": rec.get("length", 0) or 0, "context": rec["context"],
                    "question": rec["question"], "answer_prefix": rec.get("answer_prefix") or "",
                    "outputs": [str(r) for r in refs] if isinstance(refs, (list, tuple)) else [str(refs)],
                    "max_new_tokens": rec.get("max_new_tokens") or 128})
        if max_samples and len(out) >= max_samples:
            break
    return out


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
        tasks, lengths: which tasks and context lengths (tokens).
        source: ``synthetic`` (generated from ``seed``) or ``files`` (real RULER data at ``files``).
        chat_template: wrap context + question in the tokenizer's chat template (instruct models), split so the
            question is still appended after compression.
    """

    def __init__(self, tokenizer, tasks: Sequence[str] = TASKS, lengths: Sequence[int] = (4096,),
                 samples_per_task: int = 10, seed: int = 0, source: str = "synthetic", files: Any = None,
                 chat_template: bool = False, batch_size: int = 1, num_workers: int = 0):
        super().__init__()
        if source not in ("synthetic", "files"):
            raise ValueError(f"data.source={source!r}: choose synthetic or files")
        if source == "files" and not files:
            raise ValueError("data.source=files needs data.files=<path or glob of RULER jsonl/parquet>")
        unknown = [t for t in tasks if t not in TASKS]
        if source == "synthetic" and unknown:
            raise ValueError(f"data.tasks: unknown {unknown}; choose from {', '.join(TASKS)}")
        self.tokenizer = tokenizer
        self.tasks, self.lengths = list(tasks), [int(n) for n in lengths]
        self.samples_per_task, self.seed = samples_per_task, seed
        self.source, self.files, self.chat_template = source, files, chat_template
        self.batch_size, self.num_workers = batch_size, num_workers
        self.samples: list[dict] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.samples is not None:
            return
        if self.source == "files":
            raw = [s for s in load_ruler_files(self.files) if not self.tasks or s["task"] in self.tasks]
        else:
            # sample-major order: the first batches cover every task and length (debug limits stay informative)
            raw = [ruler_sample(t, self.tokenizer, n, self.seed + i)
                   for i in range(self.samples_per_task) for n in self.lengths for t in self.tasks]
        self.samples = [encode(s, self.tokenizer, self.chat_template) for s in raw]

    def test_dataloader(self):
        self.setup()
        return DataLoader(self.samples, batch_size=self.batch_size, shuffle=False, collate_fn=_first,
                          num_workers=self.num_workers)
