"""Miniature data in each real dataset's layout, for ``debug=dryrun`` (generated text, never downloaded).

A dry run points ``local.data_root`` at a folder of its own and, for every path the composed config reads under it
(``<root>/gsm8k/train.jsonl``, ``<root>/fineweb/*.parquet``, ``<root>/ruler``), calls the writer registered for the
path's layout: the same files, fields and formats as the released dataset, a few dozen records of generated text.
A layout is a glob relative to the data root; shared layouts (text corpora, GSM8K, MATH, WikiText-2, C4, FineWeb,
PG-19, OpenOrca, prompt sets) are registered below; a paper reading its own dataset registers the layout in its own
``data*.py`` (found on disk by :func:`discover_layouts`, as instruction generators are)::

    @register_layout("ruler")
    def write_ruler(target: Path, cfg) -> None: ...

A writer gets the resolved target (its last part may still be a glob: :func:`concrete` names a file matching it)
and the composed config (``cfg.data`` for lengths, fields). :func:`write_miniature` runs one writer once per data
root (a marker file; a lock for the processes of a multi-process dry run) and fails with one line for a path no
layout claims.
"""
from __future__ import annotations

import fnmatch
import gzip
import importlib
import json
import random
from pathlib import Path
from typing import Callable

Writer = Callable[[Path, object], None]
LAYOUTS: dict[str, Writer] = {}
N_RECORDS = 40  # question/answer records per file; text corpora: N_DOCS documents
N_DOCS = 24


class MissingLayoutError(FileNotFoundError):
    """A path under the data root that no registered miniature writer claims."""


def register_layout(pattern: str) -> Callable[[Writer], Writer]:
    """Register ``writer`` for paths matching ``pattern`` (a glob relative to the data root)."""
    def deco(writer: Writer) -> Writer:
        LAYOUTS[pattern] = writer
        return writer
    return deco


def discover_layouts() -> None:
    """Import each paper's ``data*.py`` that registers layouts (found on disk: the data layer names no paper)."""
    root = Path(__file__).resolve().parents[2] / "lightning_modules"
    for path in sorted(root.glob("*/data*.py")):
        if "@register_layout(" in path.read_text():
            importlib.import_module(f"lightning_modules.{path.parent.name}.{path.stem}")


def layout_of(rel: str) -> str | None:
    """The registered layout claiming ``rel`` (a path relative to the data root, maybe a glob itself)."""
    if not LAYOUTS or not any(fnmatch.fnmatch(rel, p) for p in LAYOUTS):
        discover_layouts()
    return next((p for p in LAYOUTS if fnmatch.fnmatch(rel, p)), None)


def write_miniature(path: str | Path, root: str | Path, cfg) -> str:
    """Write the miniature of ``path`` (under ``root``) once; returns the layout that wrote it."""
    from filelock import FileLock

    from datamodules.common.cache import stable_hash

    path, root = Path(path), Path(root)
    rel = path.relative_to(root).as_posix()
    layout = layout_of(rel)
    if layout is None:
        raise MissingLayoutError(f"dry run: no miniature writer is registered for {rel} (under local.data_root): "
                                 "register its layout with datamodules.common.miniature.register_layout")
    marker = root / ".written" / stable_hash(rel)
    if marker.exists():
        return layout
    marker.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".written.lock")):
        if not marker.exists():
            LAYOUTS[layout](path, cfg)
            marker.write_text(rel + "\n")
    return layout


# --- helpers for writers ------------------------------------------------------------------------------------------
def concrete(target: Path, name: str) -> Path:
    """A file matching ``target``: its glob characters replaced by ``name`` (``fineweb/*.parquet`` -> ``fineweb/
    000.parquet``); a plain path as it is. Parents are made."""
    out = Path(str(target).replace("**/", "").replace("*", name).replace("?", "0"))
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def documents(n: int = N_DOCS, min_chars: int = 2000, seed: int = 0) -> list[str]:
    """``n`` documents of at least ``min_chars`` characters of real English prose (the embedded corpus: the Python
    manual and standard-library docstrings), deterministic in ``seed``."""
    from datamodules.common.corpus import embedded_documents

    docs = [d for d in embedded_documents() if len(d) >= 400]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = ""
        while len(text) < min_chars:
            text += rng.choice(docs) + "\n\n"
        out.append(text.strip())
    return out


def write_jsonl(path: Path, records, gz: bool = False) -> None:
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if gz or path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")


def write_parquet(path: Path, records: list[dict]) -> None:
    import pandas as pd

    pd.DataFrame(records).to_parquet(path, index=False)


def _files(target: Path, names=("000", "001")) -> list[Path]:
    """Two files for a glob target (a corpus of several files), the target itself otherwise."""
    return [concrete(target, n) for n in names] if any(c in target.name for c in "*?") else [concrete(target, "")]


def _split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


# --- text corpora ---------------------------------------------------------------------------------------------------
@register_layout("pretrain/*.jsonl")
@register_layout("booksum/*.jsonl")
@register_layout("redpajama_1t_sample/*.jsonl")
@register_layout("proof-pile/*/*.jsonl")
def write_text_jsonl(target: Path, cfg) -> None:
    """JSON lines with a ``text`` field (RedPajama / Proof-Pile style, with a ``meta`` record)."""
    files = _files(target)
    for path, docs in zip(files, _split(documents(), len(files))):
        write_jsonl(path, [{"text": d, "meta": {"source": "miniature", "n": i}} for i, d in enumerate(docs)])


@register_layout("olmoe_mix/*.jsonl.gz")
@register_layout("c4/*.json.gz")
def write_text_jsonl_gz(target: Path, cfg) -> None:
    """gzipped JSON lines with ``text`` (C4's ``timestamp`` / ``url``, the OLMoE mix's ``id`` / ``source``)."""
    files = _files(target)
    for path, docs in zip(files, _split(documents(), len(files))):
        write_jsonl(path, [{"id": f"doc-{i}", "text": d, "timestamp": "2019-04-25T12:57:54Z",
                            "url": f"https://example.org/{i}", "source": "miniature"} for i, d in enumerate(docs)], gz=True)


@register_layout("fineweb/*.parquet")
@register_layout("openwebtext/*.parquet")
def write_text_parquet(target: Path, cfg) -> None:
    """Parquet with a ``text`` column (FineWeb's ``id`` / ``dump`` / ``url`` / ``language`` too)."""
    files = _files(target)
    for path, docs in zip(files, _split(documents(), len(files))):
        write_parquet(path, [{"text": d, "id": f"<urn:uuid:{i}>", "dump": "CC-MAIN-2024-10",
                              "url": f"https://example.org/{i}", "language": "en"} for i, d in enumerate(docs)])


@register_layout("pg19/*/*.txt")
@register_layout("curvature/*.txt")
def write_books(target: Path, cfg) -> None:
    """One plain-text file per book (PG-19's layout: ``<split>/<book id>.txt``), a few long documents."""
    for i, book in enumerate(documents(n=6, min_chars=20000)):
        concrete(target, f"{10000 + i}").write_text(book + "\n", encoding="utf-8")


@register_layout("wikitext2/wiki.*.txt")
@register_layout("wikitext2/wiki.*.raw")
def write_wikitext(target: Path, cfg) -> None:
    """WikiText-2 raw: `` = Title = `` headings, paragraphs, blank lines between (one file per split)."""
    split = target.name.split(".")[1] if target.name.count(".") >= 2 else "train"
    out = []
    for i, doc in enumerate(documents(seed={"train": 0, "valid": 1, "test": 2}.get(split, 3))):
        out.append(f" = Article {i} = \n\n")
        out += [f" {p.strip()} \n\n" for p in doc.split("\n\n") if p.strip()]
    concrete(target, split).write_text("".join(out), encoding="utf-8")


# --- question / answer sets ---------------------------------------------------------------------------------------
def _word_problems(n: int, seed: int) -> list[dict]:
    from datamodules.verifiable import word_problem

    rng = random.Random(seed)
    return [word_problem(rng) for _ in range(n)]


def _seed(target: Path) -> int:
    return {"train": 0, "valid": 1, "val": 1, "test": 2}.get(target.stem.split("-")[0], 3)


@register_layout("gsm8k/*.jsonl")
def write_gsm8k(target: Path, cfg) -> None:
    """GSM8K: ``question`` / ``answer`` where the answer's reasoning ends in ``#### <number>``."""
    write_jsonl(concrete(target, "train"), [{"question": p["question"], "answer": p["solution"]}
                                             for p in _word_problems(N_RECORDS, _seed(target))])


def _math_records(n: int, seed: int) -> list[dict]:
    """MATH-style problems with LaTeX answers (fractions and roots, not only integers) in ``\\boxed{}``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 9), rng.randint(2, 9)
        kind = i % 3
        if kind == 0:
            problem, answer = f"Simplify $\\frac{{{a * b}}}{{{b * b}}}$.", f"\\frac{{{a}}}{{{b}}}"
        elif kind == 1:
            problem, answer = f"What is ${a} + {b}$?", str(a + b)
        else:
            problem, answer = f"Simplify $\\sqrt{{{a * a * b}}}$.", f"{a}\\sqrt{{{b}}}"
        out.append({"problem": problem, "solution": f"Working it through, the result is $\\boxed{{{answer}}}$.",
                    "answer": answer, "subject": "Algebra", "level": 1 + i % 5, "unique_id": f"test/algebra/{i}.json"})
    return out


@register_layout("math/*.jsonl")
@register_layout("math500/*.jsonl")
def write_math(target: Path, cfg) -> None:
    """MATH / MATH-500 as jsonl: ``problem``, ``solution`` (with ``\\boxed{}``), ``answer``, ``subject``, ``level``."""
    write_jsonl(concrete(target, "train"), _math_records(N_RECORDS, _seed(target)))


@register_layout("rlkv/deepscaler*.jsonl")
def write_deepscaler(target: Path, cfg) -> None:
    """DeepScaleR-Preview: ``problem``, ``answer`` (bare LaTeX), ``solution``."""
    write_jsonl(concrete(target, "train"), [{k: r[k] for k in ("problem", "answer", "solution")}
                                             for r in _math_records(N_RECORDS, 5)])


@register_layout("openorca/*.jsonl")
def write_openorca(target: Path, cfg) -> None:
    """OpenOrca: ``id``, ``system_prompt``, ``question``, ``response``."""
    records = [{"id": f"niv.{i}", "system_prompt": "You are a helpful assistant.", "question": p["question"],
                "response": p["solution"].split("\n")[0]} for i, p in enumerate(_word_problems(N_RECORDS, 7))]
    write_jsonl(concrete(target, "train"), records)


@register_layout("rlhf_prompts/*.jsonl")
def write_prompts(target: Path, cfg) -> None:
    """Prompts without answers (HH-RLHF / UltraFeedback style): ``prompt``."""
    write_jsonl(concrete(target, "train"), [{"prompt": p["question"]} for p in _word_problems(N_RECORDS, _seed(target))])


# --- lm-eval suites -------------------------------------------------------------------------------------------------
HARNESS_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {validation}
    test: {test}
validation_split: validation
test_split: test
fewshot_split: validation
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: choices
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@register_layout("lm_eval_tasks")
def write_harness_tasks(target: Path, cfg) -> None:
    """One lm-eval task yaml per name in ``model.tasks`` over local jsonl files (validation for few-shot examples,
    test): four-way multiple choice on word problems. The harness's own definitions of these tasks read the hub, so
    a dry run runs the suite's code path (the harness, its batching, the metrics and the average) on these."""
    target.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(cfg.model.tasks):
        rows = []
        for i, p in enumerate(_word_problems(16, 20 + k)):
            gold = p["solution"].rsplit("#### ", 1)[-1].strip()
            choices = [gold, str(int(gold) + 1) if gold.lstrip("-").isdigit() else gold + "1", "seven", "none"]
            rng = random.Random(i)
            rng.shuffle(choices)
            rows.append({"question": p["question"], "choices": choices, "label": choices.index(gold)})
        write_jsonl(target / f"{name}.validation.jsonl", rows[:8])  # enough for 5-shot MMLU
        write_jsonl(target / f"{name}.test.jsonl", rows[8:])
        (target / f"{name}.yaml").write_text(HARNESS_TASK.format(name=name, validation=target / f"{name}.validation.jsonl",
                                                                 test=target / f"{name}.test.jsonl"), encoding="utf-8")
