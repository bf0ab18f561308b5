"""Synthetic knowledge-intensive VQA with planted knowledge conflicts (real_vqa's tiny data; images the repo draws).

Seeded from ``seed`` alone:

- **Entities**: 48 = 4 shapes × 4 colours × 3 glyphs, each a PIL-drawn 32×32 image and a made-up name.
- **KB**: every entity has a value for each relation in :data:`RELATIONS`. A question is two-hop: image → entity
  (a node) → relation value (an edge, the **pivot**: its value comes from the evidence).
- **Evidence**: k = 3 passages about the entity, each stating the pivot relation and one other (non-pivot)
  relation. Kinds: ``clean`` (all agree); ``true`` (one passage alters the pivot value: a conflict); ``false`` (one
  passage alters the non-pivot value: no conflict, what keyword-mismatch flags wrongly); ``patch_shuffle`` (the
  image's 8×8 patches permuted and the passages about another entity; the reviewers' term, its sense unknown:
  labelled a conflict on the entity node).
- The gold answer is the KB value: two of three passages carry it when one lies, and the KB is also **taught
  without passages** (``knowledge`` items, seen relations only), so the truth is recoverable from the model.
- ``align`` items (image → entity name) train the projector.
- **Splits**: by a hash of each item's content (``datamodules.common.splits``); every item touching a
  ``held_out_relations`` relation (as pivot or as the other relation) is test-only and never reaches training.

``source: files`` replaces all of this with local jsonl + image files (E-VQA, InfoSeek, A-OKVQA, REAL-VQA; record
format in ``lightning_modules.real_vqa.data_files``) producing items with the same keys; ``inject: true`` builds REAL-VQA from them
by this injection (one passage's pivot value replaced: ``true``; a non-pivot span: ``false``).
"""
from __future__ import annotations

import random
from functools import lru_cache

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from datamodules.common.sampling import StepStreamSampler
from datamodules.common.splits import check_fractions, split_of

SHAPES = ("circle", "square", "triangle", "diamond")
COLOURS = {"red": (210, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 210), "yellow": (220, 190, 30)}
GLYPHS = ("A", "K", "X")
RELATIONS = {
    "country": ("Italy", "Spain", "Peru", "Japan", "Kenya", "Chile"),
    "river": ("Nile", "Volga", "Rhine", "Indus", "Amur", "Ebro"),
    "founder": ("Ada", "Boris", "Chen", "Dara", "Emil", "Farah"),
    "material": ("stone", "wood", "glass", "iron", "clay", "silk"),
    "language": ("Latin", "Greek", "Hindi", "Malay", "Welsh", "Tamil"),
    "era": ("bronze", "iron", "modern", "medieval", "classic", "ancient"),
}
KINDS = ("clean", "true", "false", "patch_shuffle")
SOURCES = ("synthetic", "files")
SYLLABLES = ("ka", "lo", "mi", "ru", "te", "no", "sa", "vi", "do", "pe", "zu", "ha")


def entities(seed: int = 0) -> list[dict]:
    """The 48 entities with their image attributes, names and KB values."""
    rng = random.Random(seed)
    names, out = set(), []
    for shape in SHAPES:
        for colour in COLOURS:
            for glyph in GLYPHS:
                while True:
                    name = "".join(rng.choice(SYLLABLES) for _ in range(2)).capitalize()
                    if name not in names:
                        names.add(name)
                        break
                kb = {r: rng.choice(vals) for r, vals in RELATIONS.items()}
                out.append({"name": name, "shape": shape, "colour": colour, "glyph": glyph, "kb": kb})
    return out


@lru_cache(maxsize=None)
def draw(shape: str, colour: str, glyph: str, size: int = 32) -> np.ndarray:
    """A (size, size, 3) uint8 image: a coloured shape on white with a black glyph."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (255, 255, 255))
    d = ImageDraw.Draw(img)
    m, s, c = 3, size - 4, COLOURS[colour]
    if shape == "circle":
        d.ellipse([m, m, s, s], fill=c)
    elif shape == "square":
        d.rectangle([m, m, s, s], fill=c)
    elif shape == "triangle":
        d.polygon([(size // 2, m), (s, s), (m, s)], fill=c)
    else:
        d.polygon([(size // 2, m), (s, size // 2), (size // 2, s), (m, size // 2)], fill=c)
    d.text((size // 2 - 3, size // 2 - 5), glyph, fill=(0, 0, 0))
    return np.asarray(img).copy()


def shuffle_patches(image: np.ndarray, patch: int, rng: random.Random) -> np.ndarray:
    """The image with its patch×patch tiles permuted (a permutation of the pixels: same multiset)."""
    h, w, ch = image.shape
    gh, gw = h // patch, w // patch
    tiles = image.reshape(gh, patch, gw, patch, ch).transpose(0, 2, 1, 3, 4).reshape(gh * gw, patch, patch, ch)
    order = list(range(gh * gw))
    while order == sorted(order):
        rng.shuffle(order)
    tiles = tiles[order].reshape(gh, gw, patch, patch, ch).transpose(0, 2, 1, 3, 4)
    return tiles.reshape(h, w, ch)


def to_pixels(image: np.ndarray) -> torch.Tensor:
    """(3, H, W) float in [-1, 1], the SigLIP normalisation."""
    return torch.from_numpy(image).permute(2, 0, 1).float() / 127.5 - 1.0


def passage(name: str, rel: str, value: str, other: str, other_value: str, order: int) -> str:
    a, b = f"its {rel} is {value}", f"its {other} is {other_value}"
    return f"{name}: {a}; {b}." if order == 0 else f"{name}: {b}; {a}."


def question(rel: str) -> str:
    return f"What is the {rel} of the thing in the image?"


def _other_value(rel: str, value: str, rng: random.Random) -> str:
    return rng.choice([v for v in RELATIONS[rel] if v != value])


def make_item(ents: list[dict], e: int, rel: str, other: str, kind: str, rng: random.Random, k: int = 3,
              patch: int = 8) -> dict:
    """One VQA item with its planted conflict, pivots and gold answer."""
    ent = ents[e]
    src = ents[(e + 1 + rng.randrange(len(ents) - 1)) % len(ents)] if kind == "patch_shuffle" else ent
    vals = [src["kb"][rel]] * k
    others = [src["kb"][other]] * k
    liar = rng.randrange(k)
    if kind == "true":
        vals[liar] = _other_value(rel, vals[liar], rng)
    elif kind == "false":
        others[liar] = _other_value(other, others[liar], rng)
    orders = [rng.randrange(2) for _ in range(k)]
    passages = [passage(src["name"], rel, v, other, o, order) for v, o, order in zip(vals, others, orders)]
    image = draw(ent["shape"], ent["colour"], ent["glyph"])
    if kind == "patch_shuffle":
        image = shuffle_patches(image, patch, rng)
    conflict = kind in ("true", "patch_shuffle")
    pivot = rel if kind != "patch_shuffle" else "entity"
    values = sorted(set(vals)) if kind == "true" else [ent["name"], src["name"]] if conflict else []
    key = f"{ent['name']}|{rel}|{other}|{kind}|{'|'.join(passages)}"
    return {"entity": ent["name"], "relation": rel, "other": other, "kind": kind, "passages": passages,
            "question": question(rel), "image": image, "answer": ent["kb"][rel], "conflict": conflict,
            "pivot": pivot, "values": values, "pivot_values": vals, "key": key, "task": "vqa"}


def generate_items(n: int, seed: int, split: str | None = None, val_fraction: float = 0.2, test_fraction: float = 0.2,
                   held_out_relations=("language", "era"), kinds=None, patch_shuffle_frac: float = 0.1,
                   k: int = 3, kb_seed: int = 0) -> list[dict]:
    """``n`` VQA items of ``split`` (None: any). Kind mix: ``patch_shuffle_frac`` patch-shuffled, the rest split
    evenly over clean / true / false (or ``kinds`` only). Training never sees a held-out relation; with
    ``split='test'`` half the items use one (pivot or other relation)."""
    check_fractions(val_fraction, test_fraction)
    ents, rng = entities(kb_seed), random.Random(seed)
    held = tuple(held_out_relations)
    seen = [r for r in RELATIONS if r not in held]
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 200 * n + 1000:
            raise ValueError(f"cannot draw {n} items of split {split!r}: raise data.{split}_fraction or lower n")
        use_held = split == "test" and held and rng.random() < 0.5
        rels = list(RELATIONS) if use_held else seen
        rel, other = rng.sample(rels, 2)
        if use_held and rel not in held and other not in held:
            continue
        if kinds:
            kind = rng.choice(list(kinds))
        else:
            kind = "patch_shuffle" if rng.random() < patch_shuffle_frac else rng.choice(KINDS[:3])
        item = make_item(ents, rng.randrange(len(ents)), rel, other, kind, rng, k)
        item["held_out"] = rel in held or other in held
        if item["held_out"] and split != "test":
            continue  # held-out relations only ever reach the test split
        if split is not None and not item["held_out"] and split_of(item["key"], val_fraction, test_fraction) != split:
            continue
        out.append(item)
    return out


def knowledge_items(seed: int = 0, held_out_relations=("language", "era"), kb_seed: int = 0,
                    fraction: float = 1.0) -> list[dict]:
    """Image → relation value without passages (the KB taught directly; seen relations only), and image → name."""
    ents, rng = entities(kb_seed), random.Random(seed)
    out = []
    for ent in ents:
        image = draw(ent["shape"], ent["colour"], ent["glyph"])
        out.append({"task": "align", "image": image, "question": "What is the thing in the image?", "passages": [],
                    "answer": ent["name"], "key": f"align|{ent['name']}"})
        for rel in RELATIONS:
            if rel in held_out_relations or rng.random() >= fraction:
                continue
            out.append({"task": "knowledge", "image": image, "question": question(rel), "passages": [],
                        "answer": ent["kb"][rel], "key": f"kb|{ent['name']}|{rel}"})
    return out


class KIVQADataModule(L.LightningDataModule):
    """Train: VQA items of the train split mixed with ``knowledge`` / ``align`` items; val / test: VQA items
    (test adds the held-out relations). Batches are lists of item dicts; the module tokenises them.
    ``source: files``: the items of ``<root>/<dataset>/{train,val,test}.jsonl`` for each of ``datasets`` instead
    (``n_*``, ``held_out_relations``, ``patch_shuffle_frac`` and the knowledge items are then unused; ``image_size``
    resizes the file images; ``inject`` plants ``true`` / ``false`` conflicts into annotated clean records at
    ``true_frac`` / ``false_frac``, building REAL-VQA: ``lightning_modules.real_vqa.data_files.inject_conflicts``; ``annotator``,
    a judge with the ``pivot`` rubric, first gives records without a triple one: ``annotate_pivots``;
    ``require_conflicts`` refuses a train split without any pivot conflict: the paper-scale default, since the method
    trains its discriminator on them)."""

    def __init__(self, tokenizer, n_train: int = 1200, n_val: int = 48, n_test: int = 96, k: int = 3,
                 held_out_relations=("language", "era"), patch_shuffle_frac: float = 0.1, knowledge_fraction: float = 1.0,
                 knowledge_repeat: int = 2, val_fraction: float = 0.15, test_fraction: float = 0.15,
                 batch_size: int = 16, eval_batch_size: int = 16, seq_len: int = 256, seed: int = 0, kb_seed: int = 0,
                 num_workers: int = 0, source: str = "synthetic", root: str | None = None, datasets=(),
                 image_size: int | None = None, inject: bool = False, true_frac: float = 1 / 3,
                 false_frac: float = 1 / 3, annotator=None, annotation_cache: str | None = None,
                 require_conflicts: bool = False):
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"data.source={source!r}: choose one of {', '.join(SOURCES)}")
        self.source, self.root, self.datasets, self.image_size = source, root, tuple(datasets or ()), image_size
        from lightning_modules.real_vqa.data_files import check_inject, load_splits

        check_inject(inject, true_frac, false_frac, source)
        if source == "files":  # bad paths and records fail before the model is built
            self.file_splits = load_splits(root, self.datasets, k, image_size, inject, true_frac, false_frac, seed,
                                           annotator, annotation_cache, require_conflicts)
        elif annotator is not None:
            raise ValueError("data.annotator annotates file records' pivots: set data.source=files, or "
                             "data.annotator=null")
        check_fractions(val_fraction, test_fraction)
        unknown = sorted(set(held_out_relations) - set(RELATIONS))
        if unknown:
            raise ValueError(f"data.held_out_relations {unknown} are not relations: choose from {', '.join(RELATIONS)}")
        if not 0 <= patch_shuffle_frac < 1:
            raise ValueError(f"data.patch_shuffle_frac={patch_shuffle_frac} must be in [0, 1)")
        self.tokenizer, self.n_train, self.n_val, self.n_test, self.k = tokenizer, n_train, n_val, n_test, k
        self.held_out_relations, self.patch_shuffle_frac = tuple(held_out_relations), patch_shuffle_frac
        self.knowledge_fraction, self.knowledge_repeat = knowledge_fraction, knowledge_repeat
        self.val_fraction, self.test_fraction = val_fraction, test_fraction
        self.batch_size, self.eval_batch_size, self.seq_len = batch_size, eval_batch_size, seq_len
        self.seed, self.kb_seed, self.num_workers = seed, kb_seed, num_workers
        self.train = None
        self.eval_items: dict[str, list[dict]] = {}

    def items(self, split: str, n: int, seed_offset: int = 0, **kw) -> list[dict]:
        return generate_items(n, self.seed * 1009 + seed_offset, split, self.val_fraction, self.test_fraction,
                              self.held_out_relations, patch_shuffle_frac=self.patch_shuffle_frac, k=self.k,
                              kb_seed=self.kb_seed, **kw)

    def setup(self, stage: str | None = None):
        if self.train is not None:
            return
        if self.source == "files":
            self.train, self.eval_items = self.file_splits["train"], {s: self.file_splits[s] for s in ("val", "test")}
            return
        vqa = self.items("train", self.n_train)
        kb = knowledge_items(self.seed, self.held_out_relations, self.kb_seed, self.knowledge_fraction)
        self.train = vqa + kb * self.knowledge_repeat
        self.eval_items = {"val": self.items("val", self.n_val, 1), "test": self.items("test", self.n_test, 2)}

    def train_dataloader(self):
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        steps = trainer.max_steps if trainer is not None and trainer.max_steps and trainer.max_steps > 0 else 1000
        sampler = StepStreamSampler(len(self.train), steps * self.batch_size, seed=self.seed, rank=rank, world_size=world)
        return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler, collate_fn=list,
                          num_workers=self.num_workers, drop_last=True)

    def _eval_loader(self, split: str):
        return DataLoader(self.eval_items[split], batch_size=self.eval_batch_size, shuffle=False, collate_fn=list,
                          num_workers=self.num_workers)

    def val_dataloader(self):
        return self._eval_loader("val")

    def test_dataloader(self):
        return self._eval_loader("test")
