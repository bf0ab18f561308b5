"""``python -m benchmarks.all``: every paper's benchmark, one after another, at one clean commit.

Refuses a tree whose code differs from HEAD (tracked changes or untracked files outside ``benchmarks/results/``,
which only holds outputs), records the commit, then runs ``python -m benchmarks <paper>`` for each paper in its own
process, with its default arguments, so that every results file says the same commit. A benchmark that fails or
times out is recorded and the rest go on; the log, ``benchmarks/results/all/run.json``, is rewritten after each
one (a stopped run keeps what it did), each benchmark's output goes to ``outputs/benchmarks/all/<paper>.log``, and
``python -m benchmarks.report`` shows the failures and any results file older than the run. Exit status 1 when
any benchmark failed.

    OMP_NUM_THREADS=1 python -m benchmarks.all                      # all nineteen: about 2.5 h on 2 idle cores
    python -m benchmarks.all --papers llr manifoldkv                # a subset, same bookkeeping
    python -m benchmarks.all --timeout 3600                          # give up on one benchmark after an hour

The wall times of the benchmarks' last full runs (each results file's ``wall_s``) add up to about 2.5 h on 2 cores;
real_vqa alone took 76 min.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.__main__ import papers
from benchmarks.schema import RESULTS, ROOT, machine

RUN_LOG = RESULTS / "all" / "run.json"
LOGS = ROOT / "outputs" / "benchmarks" / "all"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def dirty() -> list[str]:
    """Paths whose state differs from HEAD, outputs under benchmarks/results/ aside (untracked files count: an
    untracked module can change what runs)."""
    out = _git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    return [line[3:] for line in out.splitlines() if line.strip()]


def run_one(paper: str, timeout: float | None, log_dir: Path = LOGS) -> dict:
    """``python -m benchmarks <paper>`` in its own process; its status, wall time and the tail of its output."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{paper}.log"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "1")}
    t0 = time.perf_counter()
    with log.open("w") as fh:
        try:
            rc = subprocess.run([sys.executable, "-m", "benchmarks", paper], cwd=ROOT, env=env, stdout=fh,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc, status = None, "timeout"
    lines = log.read_text(errors="replace").splitlines()
    return {"status": status, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "log": str(log),
            "tail": lines[-5:] if status != "ok" else lines[-1:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--papers", nargs="+", default=None, help="a subset (default: every paper with a benchmark)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before one benchmark is given up")
    args = p.parse_args(argv)
    known = papers()
    chosen = args.papers or known
    if unknown := [x for x in chosen if x not in known]:
        raise SystemExit(f"benchmarks.all: no benchmark for {', '.join(unknown)} — choose among: {' '.join(known)}")
    if changed := dirty():
        raise SystemExit(f"benchmarks.all: the tree differs from HEAD ({', '.join(changed[:5])}"
                         f"{', ...' if len(changed) > 5 else ''}) — commit or stash first: every result must name one "
                         "clean commit")
    commit = _git("rev-parse", "--short", "HEAD")
    doc = {"commit": commit, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "finished": None,
           "machine": machine(), "papers": {}}
    RUN_LOG.parent.mkdir(parents=True, exist_ok=True)
    for paper in chosen:
        print(f"[benchmarks.all {commit}] {paper} ...", flush=True)
        rec = run_one(paper, args.timeout)
        now = _git("rev-parse", "--short", "HEAD")
        if now != commit or dirty():
            rec["note"] = f"the tree changed during the run (HEAD {now}{', dirty' if dirty() else ''})"
        doc["papers"][paper] = rec
        RUN_LOG.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"[benchmarks.all {commit}] {paper}: {rec['status']} in {rec['wall_s'] / 60:.1f} min", flush=True)
    doc["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    RUN_LOG.write_text(json.dumps(doc, indent=1) + "\n")
    failed = [k for k, r in doc["papers"].items() if r["status"] != "ok"]
    print(f"[benchmarks.all {commit}] {len(chosen) - len(failed)} of {len(chosen)} ok"
          + (f"; failed: {', '.join(failed)}" if failed else "") + "; render: python -m benchmarks.report")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
