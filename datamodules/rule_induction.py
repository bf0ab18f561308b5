"""The few-shot rule-induction suite of "Masks Can Be Distracting" (arXiv 2511.21338), generated from a seed.

16 tasks = 8 relevant word tasks (pick the country / capitalised word / verb / adjective / animal / colour / emotion
/ object among 3 options; the other two options come from two other categories) x 2 distractor number tasks (pick
the smallest / largest of 3 numbers in 1..``number_max``). A prompt holds ``n_relevant`` relevant examples as one
contiguous block and ``n_distractor`` distractor examples, then the query (a new relevant example):

    Options: (A) w1, (B) w2, (C) w3
    Answer:[X].

``answer: letter`` answers with the option's letter, ``answer: word`` with the word itself (one token either way).
``distance`` is how many distractor examples sit between the relevant block and the query (0: adjacent; null: a
seeded random place). Splits are disjoint by content: every example (its task and options) hashes into train / val
/ test (``datamodules.common.splits``), and a prompt of a split is built only from that split's examples, so the
tiny MDLM pretrained on this generator never sees a test example (nor a test query) anywhere.

``RuleInductionDataModule`` serves:
- ``train: pretrain``: whole prompts with answers (example counts drawn once per batch, up to maxima that may grow
  over ``pretrain_curriculum`` batches) mixed with the RL core's arithmetic (``arithmetic_share``), right-padded
  with EOS to the batch's longest (LLaDA attends to EOS padding);
  what tiny-mdlm is pretrained on with LLaDA's loss, a share of the prompts (``answer_only_share``) in its SFT form
  with only the answers maskable, which teaches the few-shot rule in a CPU budget.
- ``train: qa``: (question, answer) pairs for the mask-agnostic fine-tune: generated arithmetic (tiny), or local
  OpenOrca-style jsonl/parquet files (``question``/``response`` fields, the paper's data) at paper scale.
- val / test: queries for the studies (``prompt_ids`` ending in ``Answer:[``, ``answer_id``), one set per
  ``distances`` entry.
"""
from __future__ import annotations

import itertools
import random

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from datamodules.common.splits import check_fractions, split_of

CATEGORIES = {
    "country": "france spain italy japan china india brazil canada mexico egypt kenya peru".split(),
    "capitalised": "Apple River Stone Cloud Lamp Garden Mirror Copper Harbor Candle Meadow Falcon".split(),
    "verb": "run jump write swim build read sing climb throw speak carry cook".split(),
    "adjective": "tall bright soft heavy quick narrow smooth loud ancient empty gentle rough".split(),
    "animal": "dog cat horse tiger rabbit eagle whale snake mouse lion sheep frog".split(),
    "colour": "red blue green yellow purple orange black white brown pink grey violet".split(),
    "emotion": "joy anger fear sadness pride shame envy hope grief love guilt surprise".split(),
    "object": "table chair spoon bottle pencil hammer basket clock pillow ladder bucket kettle".split(),
}
DISTRACTORS = ("smallest", "largest")
TASKS = tuple(f"{c}/{d}" for c in CATEGORIES for d in DISTRACTORS)
LETTERS = ("A", "B", "C")
ANSWERS = ("letter", "word")
FORMAT_TOKENS = ["Options:", "(A)", "(B)", "(C)", ",", "\n", "Answer:", "[", "]", ".", *LETTERS]
ARITHMETIC_TOKENS = ["What", "is", "+", "-", "*", "?", "=", "#"]


def vocabulary(number_max: int = 1000) -> list[str]:
    """Every word the suite (and the arithmetic mixed into pretraining) writes."""
    words = [w for ws in CATEGORIES.values() for w in ws]
    return [*FORMAT_TOKENS, *words, *map(str, range(max(number_max, 200) + 1)), *ARITHMETIC_TOKENS]


def suite_tokenizer(number_max: int = 1000):
    from datamodules.common.tokenizer import word_tokenizer

    return word_tokenizer(vocabulary(number_max))


def rule_induction_tokenizer(pretrained: str | None = None, number_max: int = 1000, mask_token_id: int | None = None):
    """The run's tokenizer: a pretrained backbone's own (tiny-mdlm, LLaDA, ...), else the suite's word tokenizer.

    ``mask_token_id``: the backbone's ``diffusion.mask_token_id`` (null for a causal backbone), the one place the
    [MASK] id is set; a pretrained tokenizer gets that token declared as its mask token (LLaDA's hub tokenizer holds
    ``<|mdm_mask|>`` without declaring it), or is refused in one line when it declares another."""
    if pretrained:
        from datamodules.common.tokenizer import declare_mask_token, load_tokenizer

        tok = load_tokenizer(pretrained)
        return tok if mask_token_id is None else declare_mask_token(tok, mask_token_id)
    return suite_tokenizer(number_max)


def _example(rng: random.Random, kind: str, answer: str, number_max: int, words: int = 12) -> dict:
    """One example of a relevant category task (``kind`` a category) or a distractor (smallest/largest); each
    category's first ``words`` words are drawn."""
    if kind in DISTRACTORS:
        options = [str(n) for n in rng.sample(range(1, number_max + 1), 3)]
        target = (min if kind == "smallest" else max)(options, key=int)
    else:
        others = rng.sample([c for c in CATEGORIES if c != kind], 2)
        options = [rng.choice(CATEGORIES[kind][:words]), *(rng.choice(CATEGORIES[c][:words]) for c in others)]
        target = options[0]
        rng.shuffle(options)
    label = LETTERS[options.index(target)] if answer == "letter" else target
    return {"kind": kind, "options": options, "answer": label, "key": f"{kind}|{','.join(options)}"}


def render(ex: dict, with_answer: bool = True) -> str:
    opts = ", ".join(f"({letter}) {w}" for letter, w in zip(LETTERS, ex["options"]))
    return f"Options: {opts}\nAnswer:[" + (f"{ex['answer']}]." if with_answer else "")


def rule_induction_sample(rng: random.Random, task: str, n_relevant: int, n_distractor: int,
                          distance: int | None = None, answer: str = "letter", number_max: int = 1000,
                          split: str | None = None, val_fraction: float = 0.1, test_fraction: float = 0.1,
                          words_per_category: int = 12) -> dict:
    """One prompt of ``task`` ("<category>/<smallest|largest>"): ``{"context": str (examples, each ending in a
    newline), "query": str (ending in "Answer:["), "answer": str, "task", "distance"}``. With ``split``, every
    example is drawn from that split only."""
    if task not in TASKS:
        raise ValueError(f"rule-induction task {task!r}: choose one of {', '.join(TASKS)}")
    if answer not in ANSWERS:
        raise ValueError(f"data.answer={answer!r}: choose letter or word")
    if distance is not None and not 0 <= distance <= n_distractor:
        raise ValueError(f"data distance={distance} must lie in 0..n_distractor={n_distractor}")
    category, distractor = task.split("/")

    def draw(kind):
        for _ in range(10_000):
            ex = _example(rng, kind, answer, number_max, words_per_category)
            if split is None or split_of(ex["key"], val_fraction, test_fraction) == split:
                return ex
        raise RuntimeError(f"no {split} example of {kind} in 10000 draws: raise data.{split}_fraction")

    relevant = [draw(category) for _ in range(n_relevant)]
    distractors = [draw(distractor) for _ in range(n_distractor)]
    query = draw(category)
    distance = rng.randint(0, n_distractor) if distance is None else distance
    cut = n_distractor - distance
    examples = distractors[:cut] + relevant + distractors[cut:]
    return {"context": "".join(render(e) + "\n" for e in examples), "query": render(query, with_answer=False),
            "answer": query["answer"], "task": task, "distance": distance, "query_example": query,
            "keys": [e["key"] for e in examples + [query]]}


def arithmetic_text(rng: random.Random) -> str:
    from datamodules.verifiable import arithmetic_problem

    p = arithmetic_problem(rng, 2, ("+", "-"))
    return f"{p['question']}\n{p['solution']}"


def qa_pairs_from_files(files: str, question_field: str = "question", answer_field: str = "response",
                        system_field: str | None = "system_prompt") -> list[tuple[str, str]]:
    """(question, answer) pairs from local OpenOrca-style jsonl/parquet files (the system prompt, if any, first)."""
    from datamodules.common.loaders import load_local

    pairs = []
    for rec in load_local(files, field=question_field):
        q = str(rec[question_field])
        if system_field and rec.get(system_field):
            q = f"{rec[system_field]}\n{q}"
        pairs.append((q, str(rec[answer_field])))
    if not pairs:
        raise ValueError(f"data.files={files!r} holds no records: point it at OpenOrca-style jsonl/parquet")
    return pairs


class _Pretrain(IterableDataset):
    """An endless seeded stream of pretraining texts (suite prompts with answers, or arithmetic)."""

    def __init__(self, dm: "RuleInductionDataModule"):
        self.dm = dm

    def __iter__(self):
        dm, rng = self.dm, random.Random(f"{self.dm.seed}/pretrain")
        for i in itertools.count():
            # one pair of example counts per batch, so its prompts pad nothing (a mixed batch pads to its longest)
            if i % dm.batch_size == 0:
                grown = min(1.0, i // dm.batch_size / dm.pretrain_curriculum) if dm.pretrain_curriculum else 1.0
                n_relevant = rng.randint(1, 1 + round((dm.n_relevant - 1) * grown))
                n_distractor = rng.randint(0, round(dm.pretrain_max_distractor * grown))
            if rng.random() < dm.arithmetic_share:
                yield (dm.encode(arithmetic_text(rng)), None)
                continue
            s = rule_induction_sample(rng, rng.choice(TASKS), n_relevant, n_distractor, None, dm.answer,
                                      dm.number_max, "train", dm.val_fraction, dm.test_fraction,
                                      dm.words_per_category)
            kinds = [key.split("|")[0] for key in s["keys"]]  # one per example, the query last
            ids, answers = [], []
            *heads, tail = (s["context"] + s["query"] + s["answer"] + "].").split("Answer:[")
            for kind, piece in zip(kinds, heads):  # word-level pieces: encoding piece by piece is encoding the whole
                ids += dm.encode(piece + "Answer:[")
                if dm.maskable_answers == "all" or kind not in DISTRACTORS:
                    answers.append(len(ids))  # the answer token follows "Answer:["
            ids += dm.encode(tail)
            if len(ids) > dm.seq_len:
                raise ValueError(f"a pretraining prompt of {len(ids)} tokens exceeds data.seq_len={dm.seq_len}: "
                                 "lower data.n_relevant/n_distractor or raise data.seq_len")
            yield (ids, answers if rng.random() < dm.answer_only_share else None)


class _QAPairs(IterableDataset):
    """An endless seeded stream of (question ids, answer ids) pairs for the mask-agnostic fine-tune."""

    def __init__(self, dm: "RuleInductionDataModule", pairs: list[tuple[str, str]] | None):
        self.dm, self.pairs = dm, pairs

    def __iter__(self):
        dm, rng = self.dm, random.Random(f"{self.dm.seed}/qa")
        while True:
            if self.pairs is None:
                from datamodules.verifiable import arithmetic_problem

                p = arithmetic_problem(rng, 2, ("+", "-"))
                q, a = p["question"] + "\n", p["solution"]
            else:
                q, a = rng.choice(self.pairs)
            yield {"prompt_ids": dm.encode(q), "answer_ids": dm.encode(a)}


class _Queries(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class RuleInductionDataModule(L.LightningDataModule):
    """The rule-induction suite (see the module docstring).

    Args:
        tokenizer: a tokenizer with a mask token (tiny: ``suite_tokenizer``; paper scale: the model's own).
        train: ``pretrain`` (suite + arithmetic, LLaDA pretraining) or ``qa`` (question/answer pairs).
        qa_source: ``arithmetic`` (generated) or ``files`` (``files``: OpenOrca-style records) for ``train: qa``.
        n_relevant, n_distractor: examples per prompt (paper 10 + 40; tiny 5 + 10).
        answer: ``letter`` or ``word``.
        distances: relevant-block distances the test set is built at (null entries: random placement).
        n_test: queries per task and distance; n_val: per task (random distance).
        answer_only_share: share of pretraining prompts whose loss masks only the examples' answers (LLaDA's SFT
            form: everything else is the clean prompt); the rest mask every token (its pretraining form).
        maskable_answers: which answers those prompts may mask: ``all``, or ``relevant`` (the relevant examples'
            and the query's; the distractors' stay clean, so a tiny model spends no steps on number comparison it
            is never tested on).
        pretrain_max_distractor: the most distractor examples in a pretraining prompt (null: ``n_distractor``);
            fewer makes shorter, cheaper steps, while val/test queries keep ``n_distractor``.
        pretrain_curriculum: batches over which the pretraining example-count maxima grow linearly from 1 relevant
            + 0 distractors to ``n_relevant`` + ``pretrain_max_distractor`` (0: full maxima from the start). Short
            prompts first: the option-copying rule emerges there in fewer, cheaper steps.
        words_per_category: how many of each category's 12 words are drawn (fewer: an easier rule for a tiny model).
        seq_len: the context N of a fine-tune pair (question, answer and appended masks; the MA loss cuts a longer
            question from its start) and the longest pretraining sequence (prompts beyond it are refused).
    """

    def __init__(self, tokenizer, train: str = "pretrain", qa_source: str = "arithmetic", files: str | None = None,
                 n_relevant: int = 10, n_distractor: int = 40, answer: str = "letter", number_max: int = 1000,
                 distances=(None,), n_val: int = 4, n_test: int = 4, arithmetic_share: float = 0.2,
                 batch_size: int = 8, val_fraction: float = 0.1, test_fraction: float = 0.1, seed: int = 0,
                 question_field: str = "question", answer_field: str = "response", seq_len: int = 1024,
                 answer_only_share: float = 0.0, words_per_category: int = 12, maskable_answers: str = "all",
                 pretrain_max_distractor: int | None = None, pretrain_curriculum: int = 0):
        super().__init__()
        if train not in ("pretrain", "qa"):
            raise ValueError(f"data.train={train!r}: choose pretrain (the suite, LLaDA's loss) or qa (fine-tune pairs)")
        if qa_source not in ("arithmetic", "files") or (qa_source == "files" and not files):
            raise ValueError(f"data.qa_source={qa_source!r} (files={files!r}): choose arithmetic, or files with "
                             "data.files=<OpenOrca-style jsonl/parquet>")
        if answer not in ANSWERS:
            raise ValueError(f"data.answer={answer!r}: choose letter or word")
        check_fractions(val_fraction, test_fraction)
        if getattr(tokenizer, "mask_token_id", None) is None:
            raise ValueError("the tokenizer has no mask token: a masked diffusion LM needs one (the suite's word "
                             "tokenizer has [MASK]; for a hub model use its own tokenizer, e.g. LLaDA's)")
        self.tokenizer = tokenizer
        self.train, self.qa_source, self.files = train, qa_source, files
        self.n_relevant, self.n_distractor, self.answer, self.number_max = n_relevant, n_distractor, answer, number_max
        self.distances = list(distances) if distances is not None else [None]
        self.n_val, self.n_test, self.arithmetic_share = n_val, n_test, arithmetic_share
        self.batch_size, self.val_fraction, self.test_fraction, self.seed = batch_size, val_fraction, test_fraction, seed
        self.question_field, self.answer_field, self.seq_len = question_field, answer_field, seq_len
        self.answer_only_share = answer_only_share
        if maskable_answers not in ("all", "relevant"):
            raise ValueError(f"data.maskable_answers={maskable_answers!r}: choose all or relevant")
        self.maskable_answers = maskable_answers
        if pretrain_max_distractor is not None and not 0 <= pretrain_max_distractor <= n_distractor:
            raise ValueError(f"data.pretrain_max_distractor={pretrain_max_distractor}: 0..n_distractor={n_distractor} "
                             "(or null for n_distractor)")
        self.pretrain_max_distractor = n_distractor if pretrain_max_distractor is None else pretrain_max_distractor
        if pretrain_curriculum < 0:
            raise ValueError(f"data.pretrain_curriculum={pretrain_curriculum}: a number of batches >= 0 (0: none)")
        self.pretrain_curriculum = pretrain_curriculum
        if not 1 <= words_per_category <= 12:
            raise ValueError(f"data.words_per_category={words_per_category}: 1..12 (the suite's lists hold 12 words)")
        self.words_per_category = words_per_category

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def queries(self, split: str, n_per_task: int, distance: int | None) -> list[dict]:
        rng = random.Random(f"{self.seed}/{split}/{distance}")
        out = []
        for task in TASKS:
            for _ in range(n_per_task):
                s = rule_induction_sample(rng, task, self.n_relevant, self.n_distractor, distance, self.answer,
                                          self.number_max, split, self.val_fraction, self.test_fraction,
                                          self.words_per_category)
                answer_ids = self.encode(s["answer"])
                if len(answer_ids) != 1:
                    raise ValueError(f"answer {s['answer']!r} is {len(answer_ids)} tokens for this tokenizer: the "
                                     "study scores one token; use data.answer=letter")
                out.append({"prompt_ids": self.encode(s["context"] + s["query"]), "answer_id": answer_ids[0],
                            "option_ids": [self.encode(w)[0] for w in s["query_example"]["options"]],
                            "task": task, "distance": -1 if distance is None else distance})
        return out

    def train_dataloader(self):
        if self.train == "pretrain":
            return DataLoader(_Pretrain(self), batch_size=self.batch_size, collate_fn=self.pad)
        pairs = None
        if self.qa_source == "files":
            pairs = qa_pairs_from_files(self.files, self.question_field, self.answer_field)
        return DataLoader(_QAPairs(self, pairs), batch_size=self.batch_size, collate_fn=list)

    def pad(self, rows: list[tuple[list[int], list[int] | None]]) -> dict:
        """Right-pad with EOS to the longest sequence of the batch; ``prompt_mask`` keeps every token but the
        answers clean in answer-only rows (LLaDA's SFT form), nothing in the others (its pretraining form)."""
        n = max(len(ids) for ids, _ in rows)
        eos = self.tokenizer.eos_token_id
        prompt = torch.zeros(len(rows), n, dtype=torch.bool)
        for i, (_, answers) in enumerate(rows):
            if answers is not None:
                prompt[i] = True
                prompt[i, answers] = False
        return {"input_ids": torch.tensor([ids + [eos] * (n - len(ids)) for ids, _ in rows]), "prompt_mask": prompt}

    def val_dataloader(self):
        return DataLoader(_Queries(self.queries("val", self.n_val, None)), batch_size=1, collate_fn=lambda b: b[0])

    def test_dataloader(self):
        items = [q for d in self.distances for q in self.queries("test", self.n_test, d)]
        return DataLoader(_Queries(items), batch_size=1, collate_fn=lambda b: b[0])
