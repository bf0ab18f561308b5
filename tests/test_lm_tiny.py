"""The default job runs end to end through the same path as run.py, and its checkpoints load safely."""
import math

import torch

from tests.helpers import run_experiment


def test_lm_tiny_smoke_trains_and_writes_results(tmp_path):
    value, metrics = run_experiment("lm_tiny", tmp_path)
    assert metrics["status"] == "ok"
    assert metrics["global_step"] == 20
    assert math.isfinite(value)
    # loss falls from its untrained value (ln 2048 = 7.6) within 20 steps
    assert metrics["final"]["train/loss"] < math.log(2048) - 0.5
    # fit_test tests on held-out documents, not on the validation set the checkpoint was selected on
    assert metrics["best"]["metric"] == "val/loss" and metrics["best"]["mode"] == "min"
    assert abs(metrics["final"]["test/loss"] - metrics["best"]["value"]) > 1e-4
    assert metrics["parameters"]["params/total"] > metrics["parameters"]["params/non_embedding"] > 0
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True, map_location="cpu")  # plain containers only
    assert state["global_step"] == 20
    assert (tmp_path / "hf_model" / "config.json").exists()
