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
  Optional with them: ``value`` (the pivot relation's value as the passages state it; default: ``answer``),
  ``kind`` (``clean`` | ``true`` | ``false`` | ``patch_shuffle``; default ``true`` if ``conflict`` else ``clean``)
  and ``held_out`` (bool: a relation kept out of training, scored as such).

Annotated records become items with the synthetic KI-VQA's keys (``task: vqa``), so RPA-SFT trains their full
pivot / conflict / answer target and the test loop scores the discriminator. Plain records (no pivot annotations)
get ``task: answer`` (an answer-only target) and ``conflict: None`` (the test loop scores their answer only); their
``kind`` is the dataset name, so the test logs ``acc_<dataset>`` per benchmark.

**Building REAL-VQA** (unreleased; ``data.inject: true``, :func:`inject_conflicts`): the synthetic source's conflicts
planted into clean annotated records. Their pivot triple is (``entity``, ``relation``, ``value``): ``value``
(optional) is the relation's value as the passages state it, by default the ``answer`` (InfoSeek's Wikidata
triples: subject, property, object). Per item, seeded by ``seed`` and its key: with probability ``true_frac`` a
``true`` conflict (in one passage stating the value, every occurrence replaced by another value of the same
relation drawn from other records: conflict yes, pivot = the relation, values = the two, sorted as the synthetic
items have them), with ``false_frac`` a ``false`` one (one non-pivot span of one passage changed: another
relation's value, as other records give it, becomes another value of that relation, else a number changes; the
pivot stays: no conflict), else clean. Items without a triple, already labelled a conflict, or whose passages do not
state the value verbatim stay as they are and are counted (logged per split). Records without a triple (E-VQA,
A-OKVQA) get one from an annotator model first when ``data.annotator`` is set (:func:`annotate_pivots`: a judge with
the ``pivot`` rubric; its replies are cached in ``data.annotation_cache``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from datamodules.common.miniature import register_layout

REQUIRED = {"image": str, "question": str, "answer": str, "passages": list}
PIVOT_FIELDS = ("entity", "relation", "conflict")
KINDS = ("clean", "true", "false", "patch_shuffle")
SPLITS = ("train", "val", "test")
log = logging.getLogger(__name__)


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
    value = rec.get("value", rec["answer"])
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: field 'value' must be a non-empty string (the pivot relation's value)")
    return {**item, "task": "vqa", "kind": kind, "entity": str(rec["entity"]), "relation": str(rec["relation"]),
            "conflict": rec["conflict"], "pivot": str(rec.get("pivot", "")) if rec["conflict"] else "",
            "values": values, "value": value}


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


def _spans(value: str, text: str) -> list[tuple[int, int]]:
    """Where ``value`` occurs in ``text`` as whole words (not inside a longer word or number)."""
    return [m.span() for m in re.finditer(rf"(?<!\w){re.escape(value)}(?!\w)", text)]


def _off_pivot_edits(text: str, value: str, relation: str, by_rel: dict[str, list[str]]):
    """[(start, end, replacements)] for the non-pivot spans of ``text``: other relations' values (replaced by another
    value of theirs), else numbers (replaced by a nearby one); none overlaps or creates the pivot value."""
    pivot = _spans(value, text)
    free = lambda a, b: not any(a < d and c < b for c, d in pivot)  # noqa: E731
    ok = lambda w: not _spans(value, w)  # noqa: E731
    edits = [(a, b, subs) for r, vals in sorted(by_rel.items()) if r != relation for v in vals if v != value
             for a, b in _spans(v, text) if free(a, b) and (subs := [w for w in vals if w != v and ok(w)])]
    if not edits:
        edits = [(m.start(), m.end(), [w for d in range(1, 10) if ok(w := str(int(m.group()) + d))])
                 for m in re.finditer(r"(?<!\w)\d+(?!\w)", text) if free(*m.span())]
    return [e for e in edits if e[2]]


def inject_conflicts(items: list[dict], seed: int = 0, true_frac: float = 1 / 3, false_frac: float = 1 / 3,
                     pool: list[dict] | None = None) -> tuple[list[dict], Counter]:
    """REAL-VQA by injection (see the module docstring): ``items`` with ``true`` / ``false`` conflicts planted into
    the eligible ones, and the counts (``no_triple``, ``labelled``, ``no_value``, ``eligible``; ``true``, ``false``,
    ``clean`` among the eligible; ``no_substitute`` / ``no_span`` when a drawn kind had nothing to change, left
    clean). Substitute values come from ``pool`` (default ``items``); each item's draw depends on ``seed`` and its
    key only, so it does not move when other records are added."""
    by_rel: dict[str, set] = {}
    for it in items if pool is None else pool:
        if it.get("task") == "vqa":
            by_rel.setdefault(it["relation"], set()).add(it["value"])
    by_rel = {r: sorted(v) for r, v in by_rel.items()}
    counts, out = Counter(), []
    for it in items:
        if it.get("task") != "vqa":
            counts["no_triple"] += 1
        elif it["kind"] != "clean" or it["conflict"]:
            counts["labelled"] += 1
        elif not any(_spans(it["value"], p) for p in it["passages"]):
            counts["no_value"] += 1
        else:
            counts["eligible"] += 1
            it = _inject_one(it, random.Random(f"{seed}|{it['key']}"), true_frac, false_frac, by_rel, counts)
        out.append(it)
    return out, counts


def _inject_one(it: dict, rng: random.Random, true_frac: float, false_frac: float, by_rel, counts: Counter) -> dict:
    u, value, rel, passages = rng.random(), it["value"], it["relation"], list(it["passages"])
    if u < true_frac:
        subs = [v for v in by_rel[rel] if not _spans(value, v)]  # a substitute never restates the value
        if not subs:
            counts["no_substitute"] += 1
        else:
            new = rng.choice(subs)
            j = rng.choice([i for i, p in enumerate(passages) if _spans(value, p)])
            passages[j] = re.sub(rf"(?<!\w){re.escape(value)}(?!\w)", lambda _: new, passages[j])
            counts["true"] += 1
            return {**it, "passages": passages, "kind": "true", "conflict": True, "pivot": rel,
                    "values": sorted([value, new])}
    elif u < true_frac + false_frac:
        edits = [(j, *e) for j, p in enumerate(passages) for e in _off_pivot_edits(p, value, rel, by_rel)]
        if not edits:
            counts["no_span"] += 1
        else:
            j, a, b, subs = rng.choice(edits)
            passages[j] = passages[j][:a] + rng.choice(subs) + passages[j][b:]
            counts["false"] += 1
            return {**it, "passages": passages, "kind": "false"}
    counts["clean"] += 1
    return it


def pivot_prompt(question: str, passages) -> str:
    """The ``prompt`` a pivot annotator grades (the judge's ``pivot`` rubric): the question and numbered passages."""
    return "Question: " + question + "\n" + "\n".join(f"Passage {i}: {p}" for i, p in enumerate(passages, 1))


def annotate_pivots(items: list[dict], annotator, cache: str | Path | None = None) -> tuple[list[dict], Counter]:
    """Pivot triples from an annotator model for the records that have none (E-VQA, A-OKVQA: no Wikidata triple).

    ``annotator`` is a judge with the ``pivot`` rubric (``lightning_modules.common.judge``: ``EndpointJudge`` or
    ``HFLocalJudge``, ``rubric: pivot``), graded on (question + passages, gold answer). A reply becomes the item's
    (``entity``, ``relation``, ``value``), a clean annotated item (``task: vqa``, ``conflict: false``, kind ``clean``,
    its dataset kept), only when the value occurs verbatim in one of its passages (else ``no_value``: the injection
    needs a span to change, and a value no passage states is not a pivot the evidence supplies). Replies are kept
    in ``cache`` (a jsonl of ``{key, entity, relation, value}``, appended as they come: an interrupted run resumes)
    and reused by item key; failed grades (an endpoint error, an unreadable reply) are not cached, counted
    ``failed`` and retried on the next load. Counts: ``annotated``, ``cached``, ``no_value``, ``failed``."""
    cache = Path(cache) if cache else None
    done: dict[str, dict] = {}
    if cache is not None and cache.is_file():
        for n, line in enumerate(cache.read_text(encoding="utf-8").splitlines(), 1):
            try:
                rec = json.loads(line)
                done[rec["key"]] = rec
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{cache}:{n}: not a pivot annotation (a JSON object with key, entity, relation, "
                                 "value); delete the line or the file to annotate again") from None
    todo = [it for it in items if it.get("task") == "answer"]
    counts, out = Counter(), []
    from rich.progress import track

    replies = {}
    for it in track(todo, description="annotating pivots", disable=not todo or all(i["key"] in done for i in todo)):
        if it["key"] in done:
            counts["cached"] += 1
            replies[it["key"]] = done[it["key"]]
            continue
        g = annotator.grade(pivot_prompt(it["question"], it["passages"]), it["answer"])
        if g.get("failed"):
            counts["failed"] += 1
            continue
        rec = {"key": it["key"], **{f: g.get(f) for f in ("entity", "relation", "value")}}
        replies[it["key"]] = rec
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with open(cache, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
    for it in items:
        rec = replies.get(it["key"]) if it.get("task") == "answer" else None
        if rec is not None:
            value = rec.get("value")
            if not value or not any(_spans(value, p) for p in it["passages"]):
                counts["no_value"] += 1
            else:
                counts["annotated"] += 1
                it = {**it, "task": "vqa", "kind": "clean", "entity": rec["entity"], "relation": rec["relation"],
                      "conflict": False, "pivot": "", "values": [], "value": value}
        out.append(it)
    return out, counts


def check_inject(inject: bool, true_frac: float, false_frac: float, source: str = "files") -> None:
    """The injection switches, checked before any file is read."""
    if inject and source != "files":
        raise ValueError(f"data.inject=true builds conflicts into file items: set data.source=files (not {source!r})")
    if not (0 <= true_frac <= 1 and 0 <= false_frac <= 1 and true_frac + false_frac <= 1):
        raise ValueError(f"data.true_frac={true_frac}, data.false_frac={false_frac}: each in [0, 1], their sum <= 1")


def load_splits(root: str | Path | None, datasets, k: int = 3, image_size: int | None = None, inject: bool = False,
                true_frac: float = 1 / 3, false_frac: float = 1 / 3, seed: int = 0, annotator=None,
                annotation_cache: str | Path | None = None, require_conflicts: bool = False) -> dict[str, FileItems]:
    """{split: FileItems}: records without a pivot triple annotated by ``annotator`` when one is given
    (:func:`annotate_pivots`, replies kept in ``annotation_cache``; an annotator that cannot run, e.g. an endpoint
    without url, fails first, in one line), then conflicts injected when ``inject`` (:func:`inject_conflicts`;
    substitutes drawn from all splits' records); bad input (no root, an unknown dataset folder, no test file at all)
    fails here. ``require_conflicts`` (the paper-scale runs): a train split without a single pivot conflict is
    refused, since RPA-SFT would then learn answers only and RPGD never trigger."""
    check_inject(inject, true_frac, false_frac)
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
    untripled = sum(it.get("task") == "answer" for s in SPLITS for it in out[s].items)
    if annotator is not None and untripled and hasattr(annotator, "check"):
        try:
            annotator.check()
        except ValueError as err:
            raise ValueError(f"data.annotator cannot run ({err}): {untripled} records have no pivot triple; or set "
                             "data.annotator=null to train them on answers only") from None
    if annotator is not None:
        for s in SPLITS:
            out[s].items, counts = annotate_pivots(out[s].items, annotator, annotation_cache)
            log.info("data.annotator %s: %s", s, ", ".join(f"{n} {c}" for c, n in sorted(counts.items())) or "nothing to do")
    if inject:
        pool = [it for s in SPLITS for it in out[s].items]
        for s in SPLITS:
            out[s].items, counts = inject_conflicts(out[s].items, seed, true_frac, false_frac, pool)
            log.info("data.inject %s: %d of %d items eligible (%s)", s, counts["eligible"], len(out[s]),
                     ", ".join(f"{n} {c}" for c, n in sorted(counts.items())))
    if require_conflicts and not any(it.get("conflict") is True for it in out["train"].items):
        raise ValueError("data.require_conflicts: the train split holds no pivot conflict, so RPA-SFT would train "
                         "answers only and RPGD never trigger: give records a pivot triple (entity, relation, value) "
                         "with data.inject=true, an annotator for those without one (local.endpoints.pivot_annotator),"
                         " or labelled REAL-VQA records")
    return out


# --- the miniature for debug=dryrun (datamodules/common/miniature.py) -------------------------------------------------
@register_layout("real_vqa")
def write_miniature_datasets(target: Path, cfg) -> None:
    """Each of ``data.datasets`` as ``<dataset>/{train,val,test}.jsonl`` + PNG images, from the synthetic KI-VQA's
    clean items (drawn entities, k passages stating the pivot value): records with their pivot triple (``entity``,
    ``relation``, ``value``, ``conflict: false``), as InfoSeek's are, so ``data.inject`` plants REAL-VQA's conflicts
    in them without an annotator."""
    from PIL import Image

    from lightning_modules.real_vqa.data import generate_items

    k = int(cfg.data.get("k") or 3)
    for d, dataset in enumerate(cfg.data.datasets):
        folder = target / str(dataset)
        (folder / "images").mkdir(parents=True, exist_ok=True)
        for s, split in enumerate(SPLITS):
            items = generate_items(12, seed=100 * d + s, split=split, kinds=("clean",), k=k)
            with open(folder / f"{split}.jsonl", "w") as fh:
                for i, item in enumerate(items):
                    name = f"images/{split}_{i}.png"
                    Image.fromarray(item["image"]).save(folder / name)
                    fh.write(json.dumps({"image": name, "question": item["question"], "answer": item["answer"],
                                         "passages": item["passages"], "entity": item["entity"],
                                         "relation": item["relation"], "value": item["answer"],
                                         "conflict": False}) + "\n")
