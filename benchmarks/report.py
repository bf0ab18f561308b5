"""Render ``benchmarks/REPORT.md`` from the committed results files ``benchmarks/results/<paper>.json``.

At the top: the verdict rule (``benchmarks/stats.py``), the total compute, which commit the results were measured
at (and which are older, and why), and a summary of all papers. Then one section per paper: its scale (model,
data, steps, seeds, evaluation size, wall time, machine), the claims table (measured value with its 90% interval
and what it is over, the test and whose threshold it is, the paper's figure, the verdict), every arm's absolute
numbers, its figures and the command that reproduces it. It never runs a benchmark itself unless asked:

    python -m benchmarks.report                      # render from the committed JSON
    python -m benchmarks.report --run qat_law        # run python -m benchmarks qat_law first, then render
    python -m benchmarks.report --wandb              # also log every claim as one wandb.Table plus the figures
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from benchmarks.schema import RESULTS, ROOT, SCALE_KEYS, VERDICTS, load, log_wandb
from benchmarks.stats import RULE, UNKNOWN
from benchmarks.tables import render_coverage
from benchmarks.tiny_runs import load_tiny, render_tiny

MARK = {"held": "held (tiny scale)", "not_held": "**not held**", "inconclusive": "inconclusive",
        "not_measurable_here": "not measurable here"}
ROLE = {"control": "control", "by_construction": "by construction"}
RUN_LOG = RESULTS / "all" / "run.json"


def load_all(results: Path = RESULTS) -> list[dict]:
    """Every results file, validated (the first bad one raises with its file and field)."""
    return [load(p) for p in sorted(Path(results).glob("*.json"))]


def load_run_log(path: Path = RUN_LOG) -> dict | None:
    """The last ``python -m benchmarks.all`` run's log (or another JSON record beside the results), if there is one."""
    return json.loads(Path(path).read_text()) if Path(path).is_file() else None


def _num(v) -> str:
    if v is None:
        return "—"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _cell(s) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _count(v) -> str:
    return "?" if v == UNKNOWN else "—" if v is None else str(v)


def measured(c: dict) -> str:
    out = _num(c.get("value"))
    if c.get("interval"):
        lo, hi = c["interval"]
        out += f" [{_num(lo)}, {_num(hi)}]"
    return out


def replicates(c: dict) -> str:
    """n_seeds and n_items, then what the interval is over and how it was made."""
    if c["verdict"] == "not_measurable_here" and c.get("expect") is None:
        return "—"
    counts = f"seeds {_count(c.get('n_seeds'))} · items {_count(c.get('n_items'))}"
    if not c.get("interval"):
        return f"{counts}; no noise estimate"
    n = c.get("n_seeds") if c.get("over") == "seeds" else c.get("n_items")
    df = f", df {c['df']:.3g}" if c.get("df") is not None else ""
    level = f"{100 * c['level']:.4g}%"
    extra = f", best of {c['candidates']} (Bonferroni)" if c.get("candidates", 1) > 1 else ""
    return f"{counts}; {level} {c['method']}{df} over {_count(n)} {c['over']}{extra}"


def test(c: dict) -> str:
    if c.get("expect") is None:
        return "—"
    t = c["threshold"]
    s = f"within {_num(t)} ± {_num(c['margin'])}" if c["expect"] == "within" else f"{c['expect']} {_num(t)}"
    return s + (f" (ours: {c['our_threshold']})" if c.get("our_threshold") else "")


def verdict(c: dict) -> str:
    v = MARK[c["verdict"]]
    if c.get("degenerate"):
        v += f" — cannot test: {c['degenerate']}"
    if c.get("role", "claim") != "claim":
        v += f" · {ROLE[c['role']]}, not counted"
    return v


def counts(d: dict) -> list[int]:
    counted = [c for c in d["claims"] if c.get("role", "claim") == "claim"]
    return [sum(c["verdict"] == v for c in counted) for v in VERDICTS] + [len(d["claims"]) - len(counted)]


def scale_line(d: dict) -> str:
    s, m = d.get("scale") or {}, d["machine"]
    parts = []
    for key in SCALE_KEYS:
        v = s.get(key)
        if v is None:
            continue
        if key == "params" and isinstance(v, (int, float)):
            v = f"{v / 1e6:.3g}M" if v >= 1e5 else f"{v / 1e3:.3g}K"
        parts.append(f"{key} {v}")
    parts.append(f"wall {d['wall_s'] / 60:.1f} min on {m['cores']} cores, {m['device']}")
    return "**Scale**: " + " · ".join(_cell(p) for p in parts) + "."


def _table(t: dict) -> list[str]:
    return [f"*{_cell(t['caption'])}*", "", "| " + " | ".join(_cell(c) for c in t["columns"]) + " |",
            "|" + "---|" * len(t["columns"]),
            *("| " + " | ".join(_cell(_num(v)) for v in r) + " |" for r in t["rows"])]


def header(docs: list[dict], run_log: dict | None) -> list[str]:
    wall = sum(d["wall_s"] for d in docs)
    machines = sorted({f"{d['machine']['cores']} cores, {d['machine']['device']}" for d in docs})
    out = [RULE, "", f"**Compute**: {len(docs)} benchmarks, {wall / 3600:.1f} h of wall time in all (each "
           f"benchmark's last full run) on {'; '.join(machines)}. Scale is per paper below: these are tiny models on "
           "CPU, never the papers' settings.", ""]
    commits = Counter(d["commit"].split()[0] for d in docs)
    dirty = [d["paper"] for d in docs if "dirty" in d["commit"]]
    ref = run_log["commit"] if run_log else None
    if len(commits) == 1 and not dirty and (ref is None or ref in commits):
        out.append(f"**Commit**: every result was measured at `{next(iter(commits))}`.")
    else:
        out.append(f"**Commit**: the results span {len(commits)} commits"
                   + (f" ({len(dirty)} measured on a modified tree)" if dirty else "")
                   + (f"; the last `python -m benchmarks.all` ran at `{ref}`" if ref else
                      "; `python -m benchmarks.all` has not rerun them at one commit yet")
                   + ". Older results, and why:")
        out += ["", "| paper | commit | why |", "|---|---|---|"]
        for d in docs:
            if ref is not None and d["commit"] == ref:
                continue
            why = ("a schema-1 result, verdicts recomputed from its stored numbers; not rerun at one commit yet"
                   if d.get("migrated") else "measured before the last benchmarks.all")
            if "dirty" in d["commit"]:
                why += "; measured on a modified tree"
            if run_log and d["paper"] in run_log["papers"] and run_log["papers"][d["paper"]]["status"] != "ok":
                r = run_log["papers"][d["paper"]]
                why = f"benchmarks.all {r['status']} (rc {r['rc']}): {(r['tail'] or [''])[-1]}"
            out.append(f"| {d['paper']} | `{d['commit']}` | {_cell(why)} |")
    if run_log:
        bad = {k: r for k, r in run_log["papers"].items() if r["status"] != "ok"}
        out += ["", f"**Last `python -m benchmarks.all`**: `{run_log['commit']}`, started {run_log['started']}, "
                f"{len(run_log['papers']) - len(bad)} of {len(run_log['papers'])} ok"
                + ("; failed: " + ", ".join(f"{k} ({r['status']})" for k, r in bad.items()) if bad else "") + "."
                + (f" ({run_log['note']})" if run_log.get("note") else "")]
    return out


def comparisons(c: dict, shown: int = 6) -> str:
    """An 'every competitor' claim's comparisons: each one, or past ``shown`` the tally and the ones not held."""
    xs = c["comparisons"]
    one = lambda x: f"vs {x['against']} {measured(x)} {MARK[x['verdict']].strip('*')}"  # noqa: E731
    if len(xs) <= shown:
        return f"{c['id']}, every comparison: " + "; ".join(map(one, xs)) + "."
    tally = Counter(x["verdict"] for x in xs)
    rest = [x for x in xs if x["verdict"] != "held"][:shown]
    return (f"{c['id']}, {len(xs)} comparisons: " + ", ".join(f"{n} {MARK[v].strip('*')}" for v, n in tally.items())
            + (("; not held or inconclusive: " + "; ".join(map(one, rest))) if rest else "") + ".")


def changes(d: dict) -> list[str]:
    """A migrated file's verdicts that the rule changed (until the rerun replaces it)."""
    ch = (d.get("migrated") or {}).get("changes") or []
    moved = [c for c in ch if c["old"] != c["new"]]
    if not moved:
        return []
    return ["", f"Verdicts changed by the rule (schema-1 numbers, recomputed): " + "; ".join(
        f"{c['id']} {c['old'].replace('_', ' ')} → {c['new'].replace('_', ' ')} ({_cell(c['why'])})" for c in moved)
        + "."]


def render(docs: list[dict], figures_prefix: str = "results/", coverage: list[str] | None = None,
           tiny: list[dict] = (), run_log: dict | None = None, attention: dict | list[dict] | None = None) -> str:
    """The report; ``coverage`` (``benchmarks.tables.render_coverage()``) adds which tables have a paper-scale run,
    ``tiny`` (``benchmarks.tiny_runs.load_tiny()``) the full tiny runs, ``run_log`` (:func:`load_run_log`) the last
    ``python -m benchmarks.all``, ``attention`` (``python -m benchmarks.attention``'s results file) the CPU scaling
    table."""
    out = ["# Reproduction report", "",
           "Generated by `python -m benchmarks.report` from `benchmarks/results/*.json` (do not edit by hand). Each "
           "claim quotes the paper's abstract, the number we measured at tiny scale with its interval, and a verdict "
           "from the one rule below. \"Held\" means held at tiny scale: no verdict here says a paper is reproduced.",
           "", *header(docs, run_log), "",
           "| paper | " + " | ".join(MARK[v].strip("*") for v in VERDICTS) + " | not counted (controls, by "
           "construction) | wall | commit |", "|---|" + "---:|" * (len(VERDICTS) + 1) + "---:|---|"]
    for d in docs:
        out.append(f"| [{d['paper']}](#{d['paper']}) | " + " | ".join(map(str, counts(d)))
                   + f" | {d['wall_s'] / 60:.1f} min | `{d['commit']}` |")
    total = [sum(col) for col in zip(*(counts(d) for d in docs))]
    out.append("| **all** | " + " | ".join(f"**{n}**" for n in total) + f" | "
               f"{sum(d['wall_s'] for d in docs) / 3600:.1f} h | |")
    if coverage:
        out += ["", *coverage]
    for d in docs:
        out += ["", f"## {d['paper']}", "", scale_line(d)]
        if d.get("provenance"):
            out += ["", f"*Provenance*: {_cell(d['provenance'])}."]
        out += ["", "| claim | abstract says | metric | measured [90% interval] | replicates | test | paper | verdict "
                "| why |", "|---|---|---|---:|---|---|---|---|---|"]
        for c in d["claims"]:
            out.append(f"| {_cell(c['id'])} | “{_cell(c['quote'])}” | {_cell(c['metric'])} | {measured(c)} | "
                       f"{_cell(replicates(c))} | {_cell(test(c))} | {_cell(c.get('paper_value') or '—')} | "
                       f"{_cell(verdict(c))} | {_cell(c['why'])} |")
        for c in d["claims"]:
            if c.get("comparisons"):
                out += ["", comparisons(c)]
        out += changes(d)
        for t in d.get("arms") or []:
            out += ["", *_table(t)]
        out.append("")
        out += [f"![{f}]({figures_prefix}{f})" for f in d["figures"]] or [
            "*No figure in this results file: the benchmark draws one on its next run.*"]
        out += ["", f"Reproduce (`{d['commit']}`, {d['date']}, {d['wall_s'] / 60:.1f} min on {d['machine']['cores']} "
                    f"cores, {d['machine']['device']}):", "", f"    OMP_NUM_THREADS=1 {d['command']}"]
    if tiny:
        out += ["", *render_tiny(list(tiny))]
    if attention:
        from benchmarks.attention import markdown

        for i, doc in enumerate(attention if isinstance(attention, list) else [attention]):
            out += ["", *markdown(doc, first=i == 0)]
    return "\n".join(out).rstrip("\n") + "\n"


def render_results(docs: list[dict], results: Path = RESULTS, figures_prefix: str = "results/") -> str:
    """The report as ``python -m benchmarks.report`` writes it: the results, the table coverage, the tiny runs, the
    last ``benchmarks.all`` log and the attention scaling table found beside the results."""
    return render(docs, figures_prefix, coverage=render_coverage(), tiny=load_tiny(),
                  run_log=load_run_log(results / "all" / "run.json"),
                  attention=[load_run_log(f) for f in sorted((results / "attention").glob("cpu*.json"),
                                                             key=lambda f: (f.name != "cpu.json", f.name))])


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", nargs="+", default=[], metavar="PAPER", help="run python -m benchmarks PAPER first")
    p.add_argument("--wandb", action="store_true", help="log the claims table and figures to W&B")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "REPORT.md")
    args = p.parse_args(argv)
    for paper in args.run:
        if not (ROOT / "lightning_modules" / paper / "benchmark.py").is_file():
            raise SystemExit(f"--run {paper}: no lightning_modules/{paper}/benchmark.py")
        subprocess.run([sys.executable, "-m", "benchmarks", paper], cwd=ROOT, check=True)
    docs = load_all(args.results)
    if not docs:
        raise SystemExit(f"no results in {args.results}: run a benchmark (python -m benchmarks <paper>) first")
    prefix = Path(args.results).resolve().relative_to(args.out.resolve().parent).as_posix() + "/" \
        if args.results.resolve().is_relative_to(args.out.resolve().parent) else f"{args.results.resolve()}/"
    args.out.write_text(render_results(docs, Path(args.results), prefix))
    print(f"wrote {args.out} ({len(docs)} papers, {sum(len(d['claims']) for d in docs)} claims)")
    if args.wandb:
        log_wandb(docs, args.results, name="report")
    return args.out


if __name__ == "__main__":
    main()
