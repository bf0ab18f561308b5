"""benchmarks/tiny_runs.py: the README's tiny experiments, one real (shortened) run recorded, and its rendering."""
from __future__ import annotations

import json

import pytest

from benchmarks.tiny_runs import TINY, load_tiny, main, render_tiny, run_one, tiny_experiments
from tests.helpers import experiments


def test_every_tiny_experiment_is_found_with_its_paper():
    found = tiny_experiments()
    assert set(found) == {e for e in experiments() if e.endswith("_tiny")}
    assert found["gptq_tiny"] == "watersic" and found["longlora_tiny"] == "hici" and found["lm_tiny"] == "core"


def test_a_recorded_run_holds_the_runners_metrics_and_renders(tmp_path):
    rec = run_one("lm_tiny", "core", ["debug=smoke", "trainer.max_steps=2", "trainer.val_check_interval=2",
                                      "logger=none"], out_dir=tmp_path)
    on_disk = json.loads((tmp_path / "lm_tiny.json").read_text())
    assert on_disk == rec and rec["global_step"] == 2 and rec["command"].startswith("python run.py experiment=lm_tiny")
    assert rec["best"]["metric"] == "val/loss" and rec["best"]["value"] > 0
    table = "\n".join(render_tiny(load_tiny(tmp_path)))
    assert "| core | `lm_tiny` | val/loss" in table and f"{rec['best']['value']:.4g}" in table


def test_committed_records_name_known_experiments():
    known = tiny_experiments()
    for r in load_tiny(TINY):
        assert known.get(r["experiment"]) == r["paper"], f"{r['experiment']}: not a tiny experiment of {r['paper']}"


def test_unknown_experiment_lists_the_known_ones():
    with pytest.raises(SystemExit, match="known: .*lm_tiny"):
        main(["no_such_tiny"])
