"""HiCI under FSDP2 with 2 CPU processes: the long-context evaluation runs on every rank (sharded weights need all
of them in each forward; rank 0 alone would wait forever), and its figures equal a single-process recomputation
from the exported `full` model, which is gathered from the shards before it is written."""
import json

import pytest

from tests.test_hici import SMOKE, full_model_figures
from tests.test_strategies import run_py


def test_long_context_eval_and_export_on_every_rank_under_fsdp2(tmp_path, tiny_lm_dir):
    run_dir = tmp_path / "fsdp"
    proc = run_py(["experiment=hici_tiny", *SMOKE, "trainer=fsdp", "trainer.max_steps=4",
                   "trainer.val_check_interval=4", "logger=csv"], run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["global_step"] == 4
    want = full_model_figures(run_dir, SMOKE, "hici_tiny")
    assert {k: metrics["results"][k] for k in want} == pytest.approx(want, rel=1e-4)
