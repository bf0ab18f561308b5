"""The corpus that needs no download: the Python reference manual plus standard-library docstrings.

Docstrings are read with ``ast.get_docstring`` from the ``.py`` sources, never by importing the modules
(some have side effects). ``embedded_documents_by_source()`` keeps where each document came from (a stdlib module's
dotted name, or ``reference.<topic>`` for the manual), so stdlib families serve as text domains.
Documents are deduplicated by content; ``datamodules.common.splits`` splits them into train/val/test by a hash of
the document, so the split never depends on order or on how many documents there are.
"""
from __future__ import annotations

import ast
import json
import sys
import sysconfig
from pathlib import Path

from datamodules.common.cache import cache_root, stable_hash

# Parts of the stdlib tree that are tests, vendored packages or tooling rather than documentation.
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "ensurepip", "turtledemo"}
CORPUS_VERSION = 1  # bump when the extraction below changes, so caches keyed on it are rebuilt


def _docstrings_of(source: str) -> list[str]:
    tree = ast.parse(source)
    docs = []
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                docs.append(doc)
    return list(dict.fromkeys(docs))  # ast.walk revisits the module node


def _build_documents() -> list[str]:
    from pydoc_data.topics import topics

    docs = [topics[k] for k in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(stdlib).parts[:-1]):
            continue
        try:
            source = path.read_text(encoding="utf-8", errors="replace")
            parts = _docstrings_of(source)
        except (SyntaxError, ValueError, OSError):
            continue  # a few stdlib files are templates or Python-2 leftovers
        if parts:
            docs.append("\n\n".join(parts))
    # Valid UTF-8 only, and each document once.
    docs = [d.encode("utf-8", errors="replace").decode("utf-8").strip() for d in docs]
    return list(dict.fromkeys(d for d in docs if d))


def corpus_key() -> str:
    return stable_hash("embedded", CORPUS_VERSION, sys.version_info[:2], sysconfig.get_paths()["stdlib"])


def embedded_documents() -> list[str]:
    """All documents of the embedded corpus, deduplicated, in a fixed order (cached after the first call)."""
    path = cache_root() / "corpus" / f"embedded-{corpus_key()}.json"
    if path.exists():
        return json.loads(path.read_text())
    docs = _build_documents()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(docs))
    tmp.replace(path)
    return docs


def _build_sourced() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    pairs = [(f"reference.{k}", topics[k]) for k in sorted(topics)]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if _SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        try:
            parts = _docstrings_of(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError, OSError):
            continue
        if parts:
            name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            pairs.append((name, "\n\n".join(parts)))
    pairs = [(src, d.encode("utf-8", errors="replace").decode("utf-8").strip()) for src, d in pairs]
    seen, out = set(), []
    for src, d in pairs:  # each text once, under its first source
        if d and d not in seen:
            seen.add(d)
            out.append((src, d))
    return out


def embedded_documents_by_source() -> list[tuple[str, str]]:
    """(source, text) pairs of the embedded corpus: source is a stdlib module's dotted name (``asyncio.tasks``,
    ``os``) or ``reference.<topic>`` for a Python-manual topic; the same texts as ``embedded_documents()``."""
    path = cache_root() / "corpus" / f"sourced-{corpus_key()}.json"
    if path.exists():
        return [tuple(p) for p in json.loads(path.read_text())]
    pairs = _build_sourced()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(pairs))
    tmp.replace(path)
    return pairs
