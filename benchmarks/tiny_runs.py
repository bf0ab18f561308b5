"""Full runs of the tiny experiments, as a user types them, with their figures kept for the report.

Each experiment runs as ``python run.py experiment=<name>`` (no debug preset: the whole tiny recipe) in a fresh
log dir; its ``metrics.json`` (the runner's one summary: best validation metric, final test/val figures) is kept in
``benchmarks/results/tiny/<name>.json`` with the command, commit, machine and wall time, and
``python -m benchmarks.report`` renders them as the report's "Tiny runs" table. One file per experiment, so running
one experiment again replaces only its own line.

    python -m benchmarks.tiny_runs hici_tiny longlora_tiny        # these two, one after the other
    python -m benchmarks.tiny_runs --paper watersic               # every tiny experiment of a paper (READMEs' tables)
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.schema import ROOT, _commit, machine

TINY = ROOT / "benchmarks" / "results" / "tiny"
# The README's experiment table: | `name` | paper (role) | scale | ... |; its first word is the paper.
_ROW = re.compile(r"^\| `([\w.-]+)` \| ([\w_]+)[^|]*\| tiny \|", re.M)


def tiny_experiments(root: Path = ROOT) -> dict[str, str]:
    """{experiment: paper} for every tiny experiment in the READMEs' tables (the top one and each paper's)."""
    readmes = [root / "README.md", *sorted((root / "lightning_modules").glob("*/README.md"))]
    return {m.group(1): m.group(2) for p in readmes for m in _ROW.finditer(p.read_text())}


def run_one(experiment: str, paper: str, extra: list[str] = (), out_dir: Path = TINY) -> dict:
    """Run one experiment to the end and write its record; a failed run raises with the tail of its log."""
    with tempfile.TemporaryDirectory(prefix=f"tiny_{experiment}_") as tmp:
        cmd = [sys.executable, "run.py", f"experiment={experiment}", *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd + [f"paths.log_dir={tmp}", "callbacks.progress_bar=null"], cwd=ROOT,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        found = sorted(Path(tmp).glob("runs/*/*/metrics.json"))
        if proc.returncode != 0 or not found:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}):\n{tail}")
        metrics = json.loads(found[0].read_text())
    record = {"experiment": experiment, "paper": paper, "command": " ".join(["python", *cmd[1:]]),
              "commit": _commit(), "machine": machine(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "wall_s": round(wall, 1), "best": metrics.get("best"), "final": metrics.get("final", {}),
              "global_step": metrics.get("global_step")}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{experiment}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def load_tiny(tiny_dir: Path = TINY) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(tiny_dir).glob("*.json"))]


# the figures a reader compares across arms; others stay in the JSON
_SHOWN = ("test/loss", "test/ppl", "test/acc", "test/kl_bits", "val/loss", "val/ppl")


def render_tiny(records: list[dict]) -> list[str]:
    """The report's "Tiny runs" section (empty when nothing was recorded)."""
    if not records:
        return []
    out = ["## Tiny runs", "", "Full tiny runs (`python -m benchmarks.tiny_runs <experiment>`), one seed each; the "
           "paper-scale runs are not executed here.", "",
           "| paper | experiment | best | final figures | steps | wall | commit |", "|---|---|---|---|---:|---:|---|"]
    for r in sorted(records, key=lambda r: (r["paper"], r["experiment"])):
        b = r.get("best") or {}
        best = f"{b['metric']} {b['value']:.4g}" if b.get("value") is not None else "—"
        fin = ", ".join(f"{k} {v:.4g}" for k, v in sorted(r["final"].items())
                        if k in _SHOWN or k.startswith(("test/", "quant/")) and isinstance(v, (int, float)))
        out.append(f"| {r['paper']} | `{r['experiment']}` | {best} | {fin or '—'} | {r.get('global_step', '—')} | "
                   f"{r['wall_s'] / 60:.1f} min | `{r['commit']}` |")
    return out + [""]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("experiments", nargs="*", help="tiny experiments (names as in the README table)")
    p.add_argument("--paper", nargs="+", default=[], help="every tiny experiment of these papers")
    p.add_argument("--override", nargs="*", default=[], help="extra Hydra overrides for every run")
    args = p.parse_args(argv)
    known = tiny_experiments()
    chosen = list(args.experiments) + [e for e, pp in known.items() if pp in args.paper and e not in args.experiments]
    unknown = [e for e in chosen if e not in known]
    if unknown or not chosen:
        raise SystemExit(f"unknown or no tiny experiment {unknown}; known: {', '.join(sorted(known))}")
    records = []
    for e in chosen:
        print(f"running {e} ...", flush=True)
        r = run_one(e, known[e], args.override)
        print(f"  {e}: best {r['best']}, {r['wall_s']:.0f} s", flush=True)
        records.append(r)
    return records


if __name__ == "__main__":
    main()
