"""The runner is the one writer of metrics.json; optimized_mode decides "best"; loggers, console and bad values."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import compose

ROOT = Path(__file__).resolve().parents[1]
TINY = ["debug=smoke", "trainer.max_steps=2", "trainer.val_check_interval=1", "trainer.limit_val_batches=1",
        "data.max_val_sequences=4"]


def _cli(args: list[str], log_dir: Path) -> tuple[subprocess.CompletedProcess, Path]:
    proc = subprocess.run([sys.executable, "run.py", *args, f"paths.log_dir={log_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HYDRA_FULL_ERROR="0", OMP_NUM_THREADS="1"))
    (run_dir,) = (log_dir / "runs").glob("*/*")
    return proc, run_dir


def test_metrics_json_without_callbacks_or_logger(tmp_path):
    """debug=bench (callbacks=none, logger=none) still gets its metrics.json, from the runner."""
    proc, run_dir = _cli(["debug=bench", "trainer.max_steps=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["global_step"] == 2
    assert metrics["final"]["train/loss"] > 0
    assert metrics["parameters"]["params/total"] > 0


def test_logger_none_drops_lr_monitor_and_prints_each_line_once(tmp_path):
    proc, run_dir = _cli(["logger=none", "task=fit", "callbacks.progress_bar=null", *TINY], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert out.count("dropped LearningRateMonitor") == 1
    assert out.count("`Trainer.fit` stopped: `max_steps=2` reached.") == 1, out[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["global_step"] == 2
    assert metrics["best"]["metric"] == "val/loss" and metrics["best"]["value"] == min(
        metrics["best"]["value"], metrics["final"]["val/loss"])


def test_gpu_trainer_without_cuda_is_one_line(tmp_path, monkeypatch):
    import torch

    from runner import ConfigError, run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU — use trainer=cpu") as info:
        run(compose("lm_tiny", ["trainer=gpu"], output_dir=tmp_path))
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_optimized_mode_drives_checkpoint_and_best():
    from runner import _State

    assert compose("lm_tiny").callbacks.model_checkpoint.mode == "min"
    assert compose("grpo_tiny").callbacks.model_checkpoint.mode == "max"

    class Trainer:
        global_rank, global_step, callback_metrics = 0, 0, {}

    seen = [3.0, 1.0, 2.0]
    for mode, want, step in (("min", 1.0, 2), ("max", 3.0, 1)):
        state = _State(compose("lm_tiny", [f"optimized_mode={mode}"]))
        state.trainer = Trainer()
        for i, x in enumerate(seen, start=1):
            state.trainer.global_step, state.trainer.callback_metrics = i, {"val/loss": x}
            state.collect()
        assert state.best == {"metric": "val/loss", "mode": mode, "value": want, "step": step}
        assert state.final["val/loss"] == seen[-1]


def test_optimized_mode_must_be_min_or_max(tmp_path):
    from runner import ConfigError, check_config

    with pytest.raises(ConfigError, match="optimized_mode='maximum' is not a mode — choose min"):
        check_config(compose("lm_tiny", ["optimized_mode=maximum"], output_dir=tmp_path))
