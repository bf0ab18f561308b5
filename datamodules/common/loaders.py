"""Local-file loaders through `datasets`, with one clear line for a malformed record."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence


from datamodules.common.errors import ConfigError, MissingPathError, UserError


class MalformedRecordError(UserError, ValueError):
    """A data record that cannot be read; the message names file and line."""


def expand_files(files, key: str = "data.files") -> list[Path]:
    """The files ``files`` names (paths, globs or folders; sorted, without duplicates); none at all is one line naming
    ``key``. A folder stands for every data file under it, recursively: a dataset as released, e.g. MATH's
    ``train/<subject>/<n>.json`` (one problem a file)."""
    import glob

    patterns = [files] if isinstance(files, (str, Path)) else list(files or [])
    paths = set()
    for pat in patterns:
        for p in map(Path, glob.glob(str(Path(pat).expanduser()))):
            paths |= {q for q in p.rglob("*") if q.is_file() and _is_data(q)} if p.is_dir() else {p}
    if not paths:
        raise MissingPathError(f"no data files match {[str(p) for p in patterns]} — put your files there or set "
                               f"{key}=<path, glob or folder>")
    return sorted(paths)


def numbered_jsonl(path: Path, fields: Sequence[str] = (), hint: str = "") -> Iterator[tuple[int, dict]]:
    """(line number, record) of a .jsonl(.gz) file, streamed; a malformed line or a record without one of ``fields``
    raises one error naming file and line (``hint``, e.g. which config key to set, ends the missing-field one)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise MalformedRecordError(f"{path}:{lineno}: malformed JSON record ({err.msg}); fix or remove that line") from None
            for f in fields:
                if not isinstance(rec, dict) or f not in rec:
                    raise MalformedRecordError(f"{path}:{lineno}: record has no field {f!r}{'; ' + hint if hint else ''}")
            yield lineno, rec


def iter_jsonl(path: Path, field: str | None = None) -> Iterator[dict]:
    """The records of a .jsonl(.gz) file, streamed; a bad line raises an error naming file and line."""
    hint = "set data.text_field to the right key" if field is not None else ""
    for _, rec in numbered_jsonl(path, () if field is None else (field,), hint):
        yield rec


def _check_jsonl(path: Path, field: str | None) -> None:
    """`datasets` reports a bad JSON line without naming it; check first so the error names file and line."""
    if path.suffix == ".zst":  # no reader for it here: `datasets` reports what it finds
        return
    for _ in iter_jsonl(path, field):
        pass


def _kind(path: Path) -> str:
    suffix = "".join(path.suffixes[-2:]) if path.suffix in {".gz", ".zst"} else path.suffix
    if suffix.startswith((".jsonl", ".json")):
        return "json"
    if suffix.startswith(".parquet"):
        return "parquet"
    if suffix.startswith((".txt", ".text", ".md")):
        return "text"
    raise ConfigError(f"{path}: unknown data file type {suffix!r} — use .txt, .jsonl/.json or .parquet")


def _is_data(path: Path) -> bool:
    if path.name.startswith("."):
        return False
    try:
        _kind(path)
    except ValueError:
        return False
    return True


def load_local(files: str | Iterable[str], field: str | None = "text", split: str = "train"):
    """A `datasets.Dataset` from local text / jsonl / json / parquet files (globs and folders allowed, see
    :func:`expand_files`; a .json file holds one record, as MATH's, or a list of them), checked line by line."""
    import datasets

    paths = expand_files(files)
    kinds = {_kind(p) for p in paths}
    if len(kinds) > 1:
        raise ConfigError(f"data.files mixes file types {sorted(kinds)} — give one kind at a time")
    kind = kinds.pop()
    if kind == "json":
        for p in paths:
            if p.suffix == ".jsonl" or p.suffixes[-2:-1] == [".jsonl"]:
                _check_jsonl(p, field)
    ds = datasets.load_dataset(kind, data_files=[str(p) for p in paths], split=split)
    if field is not None and field not in ds.column_names:
        raise MalformedRecordError(f"{paths[0]}: no column {field!r} (have {ds.column_names}); set data.text_field")
    return ds


def local_documents(files, field: str = "text") -> list[str]:
    ds = load_local(files, field=field)
    return [t for t in ds[field] if isinstance(t, str) and t.strip()]
