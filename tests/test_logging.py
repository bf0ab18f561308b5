"""Loggers: wandb offline (in-process) and tensorboard, through the same ``run`` as run.py.

wandb 0.31 has no reader for offline run files, so the wandb test looks at three things: the metrics Lightning
hands to ``WandbLogger.log_metrics`` (spied), the live run's summary/config/group just before ``wandb.finish``
(spied too: the run is closed afterwards), and the offline ``.wandb`` file on disk. A failing run must still
call ``wandb.finish()`` so the next job of a multirun gets a fresh run.
"""
from __future__ import annotations

import math

import pytest

from tests.helpers import run_experiment

SHORT = ["debug=smoke", "task=fit", "trainer.max_steps=6", "trainer.val_check_interval=3",
         "trainer.log_every_n_steps=1", "data.max_val_sequences=8"]


@pytest.fixture
def wandb_spies(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    seen = {"log_metrics": [], "finish": []}
    log_metrics = WandbLogger.log_metrics

    def spy_log_metrics(self, metrics, step=None):
        seen["log_metrics"].append((dict(metrics), step))
        return log_metrics(self, metrics, step)

    finish = wandb.finish

    def spy_finish(*args, **kwargs):
        run = wandb.run
        seen["finish"].append(None if run is None else {
            "summary": {k: run.summary[k] for k in run.summary.keys()}, "config": dict(run.config),
            "group": run.group, "tags": tuple(run.tags), "dir": run.dir})
        return finish(*args, **kwargs)

    monkeypatch.setattr(WandbLogger, "log_metrics", spy_log_metrics)
    monkeypatch.setattr(wandb, "finish", spy_finish)
    return seen


def test_wandb_offline_run(tmp_path, wandb_spies):
    import wandb

    value, metrics = run_experiment("lm_tiny", tmp_path / "run", SHORT, logger="wandb")
    assert metrics["status"] == "ok" and math.isfinite(value)

    # per-step metrics as Lightning passed them: train loss every step, val loss at each validation
    logged = wandb_spies["log_metrics"]
    train_steps = [step for m, step in logged if "train/loss" in m]
    assert train_steps == list(range(6))
    assert all(math.isfinite(m["train/loss"]) for m, _ in logged if "train/loss" in m)
    vals = [m["val/loss"] for m, _ in logged if "val/loss" in m]
    assert len(vals) == 2 and vals[-1] == pytest.approx(metrics["final"]["val/loss"], rel=1e-6)

    # the live run just before finish: summary holds the last values, the resolved config, group and tags
    (live,) = wandb_spies["finish"]
    assert live is not None
    assert live["summary"]["val/loss"] == pytest.approx(vals[-1], rel=1e-6)
    assert live["summary"]["train/loss"] == pytest.approx(metrics["final"]["train/loss"], rel=1e-6)
    assert live["config"]["trainer"]["max_steps"] == 6  # resolved (plain numbers, no interpolations)
    assert live["config"]["model"]["scheduler"]["total_steps"] == 6
    assert live["group"] == "lm_tiny" and "lm_tiny" in live["tags"] and "tiny_llama" in live["tags"]
    assert wandb.run is None

    files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    data = files[0].read_bytes()
    assert b"train/loss" in data and b"val/loss" in data  # the records were written, offline, to disk


def test_wandb_finish_runs_when_the_run_fails(tmp_path, wandb_spies):
    import wandb

    with pytest.raises(ValueError, match="Invalid learning rate"):
        run_experiment("lm_tiny", tmp_path / "run", [*SHORT, "model.optimizer.lr=-1.0"], logger="wandb")
    assert len(wandb_spies["finish"]) == 1 and wandb_spies["finish"][0] is not None
    assert wandb.run is None  # closed: a next job starts its own run


def test_tensorboard_logger(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, metrics = run_experiment("lm_tiny", tmp_path, SHORT, logger="tensorboard")
    assert metrics["status"] == "ok"
    events = list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    train = acc.Scalars("train/loss")
    assert [e.step for e in train] == list(range(6))
    assert acc.Scalars("val/loss")[-1].value == pytest.approx(metrics["final"]["val/loss"], rel=1e-5)
