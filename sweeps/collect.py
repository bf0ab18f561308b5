"""Collect Hydra multirun directories into one table.

Every job dir holds ``metrics.json`` (written by the runner, also on failure) and
``.hydra/{config,overrides}.yaml``. ``collect(*dirs)`` returns (jobs, failures): a job whose status is not ok
is reported and left out, never fatal. A job is a dict with its dir, overrides, seed, status, the metrics file
and ``flat`` (overrides + final metrics + parameter counts, one row per job: what a generic law fits).

Papers whose jobs produce several rows (one per variant) give a table builder here; ``qat_table`` reads
``results.qat_law.rows`` and pairs every row with the full-precision row of the same (N, D, seed), from the same
job when it has one, else from any job (paper scale trains the twin as its own job).

    python -m sweeps.collect logs/multirun/qat_law_tiny --out table.csv [--qat]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd


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


def qat_table(jobs: list[dict]) -> pd.DataFrame:
    """One row per (job, variant): N, D, seed, precision, bits, group_size, loss, delta (vs the fp twin)."""
    rows = []
    for job in jobs:
        res = job["metrics"].get("results", {}).get("qat_law")
        if not res:
            continue
        for r in res["rows"]:
            rows.append({"N": res["N"], "D": res["D"], "seed": job["seed"], **r, "job": job["dir"]})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    return add_deltas(table)


def error_table(jobs: list[dict]) -> pd.DataFrame:
    """One row per (job, task, format, n) of an error_law job (``results.error_law.rows``): n, k right of m,
    acc, plus the job's model, seed and overrides (so a sweep's cells stay apart)."""
    rows = []
    for job in jobs:
        res = job["metrics"].get("results", {}).get("error_law")
        if not res:
            continue
        extra = {k: v for k, v in job["flat"].items() if k in ("seed",) or "." in k}  # the overrides
        for r in res["rows"]:
            rows.append({**extra, "model": res.get("model"), **r, "job": job["dir"]})
    return pd.DataFrame(rows)


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
    ap.add_argument("--qat", action="store_true", help="one row per QAT variant (results.qat_law.rows)")
    args = ap.parse_args(argv)
    jobs, failures = collect(*args.dirs)
    table = qat_table(jobs) if args.qat else pd.DataFrame([j["flat"] for j in jobs])
    for f in failures:
        print(f"excluded failed job {f['dir']}: {f['status'][:200]}")
    (table.to_parquet if args.out.endswith(".parquet") else table.to_csv)(args.out, index=False)
    print(f"{len(table)} rows from {len(jobs)} jobs ({len(failures)} failed) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
