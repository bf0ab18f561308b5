"""Collect Hydra multirun directories into one table.

Every job dir holds ``metrics.json`` (written by the runner, also on failure) and
``.hydra/{config,overrides}.yaml``. ``collect(*dirs)`` returns (jobs, failures): a job whose status is not ok
is reported and left out, never fatal. A job is a dict with its dir, overrides, seed, status, the metrics file
and ``flat`` (overrides + final metrics + parameter counts, one row per job: what a generic law fits).

A paper whose jobs produce other rows (one per variant, one per task) gives its own table builder with its law
(``lightning_modules/<paper>/law.py``: ``sweeps.laws.Study.table``); ``--law`` picks it::

    python -m sweeps.collect logs/multirun/qat_law_tiny --out table.csv [--law qat_delta]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from sweeps.laws import study_for


def _yaml(path: Path):
    if not path.exists():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def collect(*dirs) -> tuple[list[dict], list[dict]]:
    jobs, failures = [], []
    for root in dirs:
        root = Path(root)
        if not root.exists():
            raise FileNotFoundError(f"{root} does not exist: pass the multirun dir (logs/multirun/<experiment>)")
        for metrics in sorted(root.rglob("metrics.json")):
            job_dir = metrics.parent
            data = json.loads(metrics.read_text())
            overrides = _yaml(job_dir / ".hydra" / "overrides.yaml") or []
            config = _yaml(job_dir / ".hydra" / "config.yaml") or {}
            job = {"dir": str(job_dir), "overrides": overrides, "seed": config.get("seed"),
                   "status": str(data.get("status", "unknown")), "metrics": data}
            if job["status"] != "ok":
                failures.append(job)
                continue
            flat = {"dir": str(job_dir), "seed": job["seed"]}
            for o in overrides:
                if "=" in o:
                    k, v = o.split("=", 1)
                    flat[k.lstrip("+~")] = v
            flat.update(data.get("final", {}))
            flat.update(data.get("parameters", {}))
            job["flat"] = flat
            jobs.append(job)
    return jobs, failures


def flat_table(jobs: list[dict]) -> pd.DataFrame:
    """One row per job: its overrides, final metrics and parameter counts (what a generic law fits)."""
    return pd.DataFrame([j["flat"] for j in jobs])


def add_deltas(table: pd.DataFrame, keys=("N", "D", "seed"), reference: str = "fp", by: str = "precision",
               value: str = "loss", out: str = "delta") -> pd.DataFrame:
    """``out`` = value − value of the ``reference`` row with the same keys (same job first, else any job)."""
    table = table.copy()
    ref = table[table[by] == reference]
    same_job = {(*k, j): v for k, j, v in zip(ref[list(keys)].itertuples(index=False, name=None), ref["job"], ref[value])}
    any_job = {k: v for k, v in zip(ref[list(keys)].itertuples(index=False, name=None), ref[value])}
    deltas = []
    for k, j, v in zip(table[list(keys)].itertuples(index=False, name=None), table["job"], table[value]):
        r = same_job.get((*k, j), any_job.get(k))
        deltas.append(None if r is None else v - r)
    table[out] = deltas
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="collect multirun dirs into one table")
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--out", required=True, help="a .csv or .parquet path")
    ap.add_argument("--law", default=None, help="the rows the law's paper collects (e.g. qat_delta: one row per QAT "
                    "variant; infolaw: one per mixture job); default: one row per job")
    args = ap.parse_args(argv)
    jobs, failures = collect(*args.dirs)
    builder = study_for(args.law).table if args.law else None
    table = (builder or flat_table)(jobs)
    for f in failures:
        print(f"excluded failed job {f['dir']}: {f['status'][:200]}")
    (table.to_parquet if args.out.endswith(".parquet") else table.to_csv)(args.out, index=False)
    print(f"{len(table)} rows from {len(jobs)} jobs ({len(failures)} failed) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
