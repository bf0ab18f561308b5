"""File-backed knowledge-intensive VQA (E-VQA, InfoSeek, A-OKVQA, REAL-VQA) for ``KIVQADataModule(source='files')``.

Layout: ``<root>/<dataset>/{train,val,test}.jsonl`` (``root`` is ``data.root``, by default
``${local.data_root}/real_vqa``); a split file may be absent (a test-only benchmark has no ``train.jsonl``). One JSON
record per line:

- ``image`` (required): the image path, relative to the jsonl's folder (or absolute); read as RGB, resized to
  ``image_size`` × ``image_size`` when that is set (TinyVLM takes a fixed size; a hub VLM's processor resizes itself).
- ``question`` (required): the question text.
- ``answer`` (required): the gold answer; ``aliases`` (optional list): other answers scored correct.
- ``passages`` (required list of strings): the retrieved passages, best first; the first ``k`` are kept.
- ``id`` (optional): a stable item key (default: a hash of image, question and passages).
- Pivot annotations (optional, all or none; REAL-VQA-style items): ``entity`` (the image's entity, a node),
  ``relation`` (the pivot relation, an edge), ``conflict`` (bool: the passages disagree on a pivot); when
  ``conflict`` is true also ``pivot`` (the conflicting pivot's id) and ``values`` (the disagreeing values).
  Optional with them: ``kind`` (``clean`` | ``true`` | ``false`` | ``patch_shuffle``; default ``true`` if
  ``conflict`` else ``clean``) and ``held_out`` (bool: a relation kept out of training, scored as such).

Annotated records become items with the synthetic KI-VQA's keys (``task: vqa``), so RPA-SFT trains their full
pivot / conflict / answer target and the test loop scores the discriminator. Plain records (no pivot annotations)
get ``task: answer`` (an answer-only target) and ``conflict: None`` (the test loop scores their answer only); their
``kind`` is the dataset name, so the test logs ``acc_<dataset>`` per benchmark.
Conflict injection on file items (building REAL-VQA from annotated records) is not done here: the synthetic
injection (``kivqa.make_item``) writes its passages from its own KB templates, so it does not apply to retrieved
text; REAL-VQA records must carry their conflict labels and already-altered passages.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

REQUIRED = {"image": str, "question": str, "answer": str, "passages": list}
PIVOT_FIELDS = ("entity", "relation", "conflict")
KINDS = ("clean", "true", "false", "patch_shuffle")
SPLITS = ("train", "val", "test")


def parse_record(line: str, where: str, dataset: str, k: int) -> dict:
    """One jsonl line as an item without its image (``image_path`` instead); ``where`` is ``file:line``."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a record must be a JSON object")
    for name, typ in REQUIRED.items():
        if name not in rec:
            raise ValueError(f"{where}: missing field {name!r}")
        if not isinstance(rec[name], typ):
            raise ValueError(f"{where}: field {name!r} must be a {typ.__name__}")
    passages = rec["passages"][:k]
    aliases = rec.get("aliases", [])
    for name, vals in (("passages", passages), ("aliases", aliases)):
        if not isinstance(vals, list) or not all(isinstance(p, str) for p in vals):
            raise ValueError(f"{where}: field {name!r} must be a list of strings")
    key = rec.get("id") or hashlib.sha1(
        json.dumps([dataset, rec["image"], rec["question"], passages]).encode()).hexdigest()
    item = {"image_path": rec["image"], "question": rec["question"], "answer": rec["answer"],
            "answers": [rec["answer"], *aliases], "passages": passages, "key": f"{dataset}|{key}",
            "dataset": dataset, "held_out": bool(rec.get("held_out", False))}
    present = [f for f in PIVOT_FIELDS if f in rec]
    if not present:
        return {**item, "task": "answer", "kind": dataset, "conflict": None}
    missing = [f for f in PIVOT_FIELDS if f not in rec]
    if rec.get("conflict") is True:
        missing += [f for f in ("pivot", "values") if f not in rec]
    if missing:
        raise ValueError(f"{where}: missing field {missing[0]!r} (a record with pivot annotations needs entity, "
                         "relation, conflict, and pivot + values when conflict is true)")
    if not isinstance(rec["conflict"], bool):
        raise ValueError(f"{where}: field 'conflict' must be true or false")
    kind = rec.get("kind", "true" if rec["conflict"] else "clean")
    if kind not in KINDS:
        raise ValueError(f"{where}: kind {kind!r} must be one of {', '.join(KINDS)}")
    values = rec.get("values", []) if rec["conflict"] else []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{where}: field 'values' must be a list of strings")
    return {**item, "task": "vqa", "kind": kind, "entity": str(rec["entity"]), "relation": str(rec["relation"]),
            "conflict": rec["conflict"], "pivot": str(rec.get("pivot", "")) if rec["conflict"] else "",
            "values": values}


def load_image(path: Path, image_size: int | None) -> np.ndarray:
    """An (H, W, 3) uint8 RGB array, resized to a square ``image_size`` when set."""
    from PIL import Image

    with Image.open(path) as img:
        img = img.convert("RGB")
        if image_size is not None and img.size != (image_size, image_size):
            img = img.resize((image_size, image_size), Image.BICUBIC)
        return np.asarray(img).copy()


class FileItems(Dataset):
    """The items of one split across datasets; records are parsed (and image paths checked) up front, images are
    read when an item is fetched."""

    def __init__(self, root: str | Path, datasets, split: str, k: int = 3, image_size: int | None = None):
        self.image_size, self.items = image_size, []
        self.files = [Path(root) / d / f"{split}.jsonl" for d in datasets]
        for dataset, path in zip(datasets, self.files):
            if not path.exists():
                continue
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    item = parse_record(line, f"{path}:{n}", dataset, k)
                    image = Path(item["image_path"])
                    image = image if image.is_absolute() else path.parent / image
                    if not image.is_file():
                        raise ValueError(f"{path}:{n}: image {image} does not exist")
                    item["image_path"] = str(image)
                    self.items.append(item)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        item = self.items[i]
        return {**item, "image": load_image(Path(item["image_path"]), self.image_size)}


def load_splits(root: str | Path | None, datasets, k: int = 3, image_size: int | None = None) -> dict[str, FileItems]:
    """{split: FileItems}; bad input (no root, an unknown dataset folder, no test file at all) fails here."""
    if not root:
        raise ValueError("data.source=files needs data.root (by default ${local.data_root}/real_vqa): set "
                         "local.data_root or data.root")
    if not datasets:
        raise ValueError("data.source=files needs data.datasets, e.g. [evqa, infoseek, aokvqa]")
    root = Path(root)
    for d in datasets:
        if not (root / d).is_dir():
            raise ValueError(f"data.datasets: no folder {root / d} (set local.data_root or data.root to the folder "
                             "holding <dataset>/{train,val,test}.jsonl)")
    out = {s: FileItems(root, datasets, s, k, image_size) for s in SPLITS}
    for s in ("train", "test"):
        if not len(out[s]):
            raise ValueError(f"data.source=files: no {s} items in {', '.join(map(str, out[s].files))}")
    return out
