"""InstEmb's data: (instruction, input, gold output) triples, generated (tiny) or read from local files.

- ``objects`` (tiny): generated passages describing one object by colour, shape, place and size in one of several
  phrasings; the instructions ask for its colour, shape or place and the gold output is that word. Objects are split
  train / val / test by a hash of their content (``datamodules.common.splits``), so no evaluation object is warmed up
  on or trained on. The warm-up task ``instemb_objects`` (registered in ``datamodules.instruct``) teaches the tiny LM
  to answer in InstEmb's input format: ``template`` + EOS, then the gold output.
- ``files`` (paper scale): InBedder-style jsonl / parquet with ``instruction``, ``input``, ``output`` fields
  (abstractive QA); training only (evaluation is offline through mteb and InBedder's files).

Training batches are lists of triples ``{"instruction", "input", "output"}``; the module tokenises them.
Val / test items are objects ``{"input", "colour", "shape", "place"}``: the module embeds each under every
instruction and scores retrieval and clustering by the asked attribute.
"""
from __future__ import annotations

import random

import lightning as L
from torch.utils.data import DataLoader

from datamodules.common.miniature import register_layout
from datamodules.common.splits import check_fractions, split_of
from datamodules.instruct import register_generator

# InBedder's prompt (zhang-yu-wei/InBedder); InstEmb's own is not published, the spec infers this one
INBEDDER = "### Input:\n{input}\n\n### Instruction:\n{instruction}\n\n### Response:"
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "purple", "orange")
SHAPES = ("cube", "ball", "cone", "ring", "star", "box", "disk", "pyramid")
PLACES = ("kitchen", "garden", "garage", "bedroom", "office", "attic", "cellar", "hallway")
SIZES = ("small", "large", "tiny")
ATTRIBUTES = {"colour": "What colour is the object?", "shape": "What shape is the object?",
              "place": "Where is the object?"}
PHRASINGS = ("A {size} {colour} {shape} lies in the {place}.",
             "In the {place} there is a {size} {colour} {shape}.",
             "The {size} {shape} in the {place} is {colour}.",
             "Someone left a {colour} {shape} in the {place}; it is {size}.")
SOURCES = ("objects", "files")


def object_key(o: dict) -> str:
    return f"{o['colour']}|{o['shape']}|{o['place']}|{o['size']}"


def all_objects() -> list[dict]:
    return [{"colour": c, "shape": s, "place": p, "size": z} for c in COLOURS for s in SHAPES for p in PLACES for z in SIZES]


def objects(split: str | None, val_fraction: float, test_fraction: float) -> list[dict]:
    return [o for o in all_objects() if split is None or split_of(object_key(o), val_fraction, test_fraction) == split]


def describe(o: dict, rng: random.Random) -> dict:
    return {**o, "input": rng.choice(PHRASINGS).format(**o), "key": object_key(o)}


def prompt_text(instruction: str, text: str, template: str = INBEDDER) -> str:
    return template.format(instruction=instruction, input=text)


def triples(n: int, seed: int, split: str | None, val_fraction: float, test_fraction: float) -> list[dict]:
    """``n`` (instruction, input, output) triples over random objects of ``split``, attributes cycled."""
    rng = random.Random(seed)
    pool = objects(split, val_fraction, test_fraction)
    if not pool:
        raise ValueError(f"no object falls in the {split} split: raise data.{split}_fraction")
    names = list(ATTRIBUTES)
    out = []
    for i in range(n):
        o = describe(rng.choice(pool), rng)
        a = names[i % len(names)]
        out.append({"instruction": ATTRIBUTES[a], "input": o["input"], "output": " " + o[a], "attribute": a,
                    "key": o["key"]})
    return out


@register_generator("instemb_objects")
def warmup_pairs(n, seed, split=None, val_fraction=0.0, test_fraction=0.0, eos_text="<|endoftext|>",
                 template=INBEDDER):
    """The warm-up's pairs: prompt = template + EOS (InstEmb's input), response = the asked attribute."""
    return [{"prompt": prompt_text(t["instruction"], t["input"], template) + eos_text, "response": t["output"],
             "key": t["key"]} for t in triples(n, seed, split, val_fraction, test_fraction)]


class InstEmbDataModule(L.LightningDataModule):
    def __init__(self, tokenizer=None, source: str = "objects", n_train: int = 2000, n_val: int = 96,
                 n_test: int = 192, val_fraction: float = 0.2, test_fraction: float = 0.2, batch_size: int = 16,
                 seed: int = 0, files: str | list | None = None, fields: dict | None = None, num_workers: int = 0,
                 seq_len: int = 512):
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"data.source={source!r}: choose one of {', '.join(SOURCES)}")
        if source == "files" and not files:
            raise ValueError("data.source=files needs data.files=<jsonl/parquet glob> (InBedder's training set)")
        check_fractions(val_fraction, test_fraction)
        self.tokenizer, self.source, self.n_train, self.n_val, self.n_test = tokenizer, source, n_train, n_val, n_test
        self.val_fraction, self.test_fraction, self.batch_size, self.seed = val_fraction, test_fraction, batch_size, seed
        self.files, self.num_workers, self.seq_len = files, num_workers, seq_len  # the module cuts prompts to it
        self.fields = {"instruction": "instruction", "input": "input", "output": "output", **(fields or {})}
        self.train = None
        self.eval_items: dict[str, list[dict]] = {}

    def setup(self, stage: str | None = None):
        if self.train is not None:
            return
        vf, tf = self.val_fraction, self.test_fraction
        if self.source == "objects":
            self.train = triples(self.n_train, self.seed * 7919 + 3, "train", vf, tf)
        else:
            self.train = self._files()
        for i, s in enumerate(("val", "test")):
            rng = random.Random(self.seed * 31 + i)
            pool = objects(s, vf, tf)
            n = self.n_val if s == "val" else self.n_test
            if len(pool) < 2:
                raise ValueError(f"the {s} split holds {len(pool)} objects: raise data.{s}_fraction")
            self.eval_items[s] = [describe(o, rng) for o in rng.sample(pool, min(n, len(pool)))]

    def _files(self) -> list[dict]:
        from datamodules.instruct import _paths, check_fields
        from datamodules.common.loaders import load_local

        f = self.fields
        check_fields(self.files, list(f.values()), "set data.fields.{instruction,input,output}")
        ds = load_local([str(p) for p in _paths(self.files)], field=None)
        return [{"instruction": i, "input": x, "output": " " + o.lstrip()}
                for i, x, o in zip(ds[f["instruction"]], ds[f["input"]], ds[f["output"]])]

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, collate_fn=list,
                          num_workers=self.num_workers, drop_last=True)

    def _eval_loader(self, split: str):
        # one batch: the metrics rank every object against every other one
        items = self.eval_items[split]
        return DataLoader([items], batch_size=1, collate_fn=lambda b: b[0])

    def val_dataloader(self):
        return self._eval_loader("val")

    def test_dataloader(self):
        return self._eval_loader("test")


# --- the miniature for debug=dryrun (datamodules/common/miniature.py) -------------------------------------------------
@register_layout("instemb/inbedder_pretrain/*.jsonl")
def write_inbedder_pretrain(target, cfg) -> None:
    """InBedder's pretraining triples as its released jsonl has them (``instruction``, ``input``, ``output``): the
    tiny generator's triples over the training objects, split over two files."""
    from datamodules.common.miniature import _files, _split, write_jsonl

    rows = [{k: t[k] for k in ("instruction", "input", "output")} for t in triples(48, 0, "train", 0.2, 0.2)]
    for path, part in zip(_files(target), _split(rows, 2)):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, part)
