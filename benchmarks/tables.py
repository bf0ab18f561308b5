"""Each paper's main tables and the paper-scale experiments or sweeps that reproduce them.

``lightning_modules/<paper>/tables.yaml`` lists a paper's main tables (id, what, sweeps; the shared core's are in
``benchmarks/core_tables.yaml``); every paper-scale experiment names
the ids it reproduces in its ``paper:`` header (``paper.reproduces``). This module joins the two for the report and
for ``tests/test_paper_scale.py``. It composes configs with Hydra (no torch, no Lightning).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# Runs executed at paper scale so far (experiment names). None: these machines have no GPU node.
EXECUTED: frozenset[str] = frozenset()


def experiments() -> list[str]:
    """Runnable experiments (``conf/experiment/*.yaml``; the bases in ``conf/experiment/base/`` are not)."""
    return sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def paper_scale_experiments() -> list[str]:
    return [e for e in experiments() if not e.endswith("_tiny")]


@lru_cache(maxsize=None)
def composed(experiment: str):
    """The config ``python run.py experiment=<name>`` runs (``runner.compose``, cached: it is read many times)."""
    from runner import compose

    return compose(experiment)


def reproduces(header) -> list[str]:
    ids = header.get("reproduces") or []
    return [ids] if isinstance(ids, str) else list(ids)


def table_files() -> dict[str, Path]:
    """paper -> the file listing its main tables: each paper package's ``tables.yaml``, and the core's."""
    files = {p.parent.name: p for p in sorted((ROOT / "lightning_modules").glob("*/tables.yaml"))}
    return {"core": ROOT / "benchmarks" / "core_tables.yaml", **files}


def load_tables() -> dict[str, list[dict]]:
    """paper -> its main tables, from :func:`table_files`."""
    out = {}
    for paper, path in table_files().items():
        doc = yaml.safe_load(path.read_text())
        if doc.get("paper") != paper or not isinstance(doc.get("tables"), list):
            raise ValueError(f"{path.relative_to(ROOT)}: needs `paper: {paper}` and a `tables:` list")
        for t in doc["tables"]:
            if not {"id", "what"} <= set(t):
                raise ValueError(f"{path.relative_to(ROOT)}: every table needs an id and a what ({t})")
        out[paper] = doc["tables"]
    return out


def coverage() -> dict[str, list[dict]]:
    """paper -> [{id, what, experiments, sweeps, executed}] for every listed table."""
    by_table: dict[tuple[str, str], list[str]] = {}
    for e in paper_scale_experiments():
        header = composed(e).get("paper")
        if header is not None:
            for tid in reproduces(header):
                by_table.setdefault((header.name, tid), []).append(e)
    out = {}
    for paper, tables in load_tables().items():
        out[paper] = [{"id": t["id"], "what": t["what"], "experiments": by_table.get((paper, t["id"]), []),
                       "sweeps": list(t.get("sweeps") or []),
                       "executed": [e for e in by_table.get((paper, t["id"]), []) if e in EXECUTED]}
                      for t in tables]
    return out


def render_coverage() -> list[str]:
    """Markdown lines: per paper, which tables have a paper-scale experiment or sweep (and whether it ran)."""
    out = ["## Paper-scale coverage", "",
           "Which of each paper's main tables a paper-scale experiment (`conf/experiment/`, its `paper:` header) or "
           "sweep (`conf/sweep/`) reproduces. None has been executed at paper scale yet: each needs the GPU node "
           "its header names.", "",
           "| paper | table | what | experiments | sweeps | executed |", "|---|---|---|---|---|---|"]
    for paper, tables in coverage().items():
        for t in tables:
            exps = ", ".join(f"`{e}`" for e in t["experiments"]) or "**none**"
            sweeps = ", ".join(f"`{s}`" for s in t["sweeps"]) or "—"
            what = str(t["what"]).replace("|", "\\|").replace("\n", " ")
            out.append(f"| {paper} | {t['id']} | {what} | {exps} | {sweeps} | {', '.join(t['executed']) or 'no'} |")
    return out
