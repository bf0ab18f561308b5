"""Loggers: wandb offline (in-process) and tensorboard, through the same ``run`` as run.py.

wandb 0.31 has no reader for offline run files, so the wandb test looks at three things: the metrics Lightning
hands to ``WandbLogger.log_metrics`` (spied), the live run's summary/config/group just before ``wandb.finish``
(spied too: the run is closed afterwards), and the offline ``.wandb`` file on disk. A failing run must still
call ``wandb.finish()`` so the next job of a multirun gets a fresh run.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

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
    # the records were written, offline, to disk. wandb-core writes this log from its own process and may still be
    # flushing when finish() returns: a fresh-clone suite once read the 7-byte header alone here
    deadline = time.monotonic() + 60
    written = lambda data: b"train/loss" in data and b"val/loss" in data
    while not written(data := files[0].read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert written(data), f"{files[0]} holds {len(data)} bytes after 60 s"


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


# --- W&B from the command line -------------------------------------------------------------------------------

def wandb_records(run_dir: Path) -> dict:
    """Summary, config and exit of the one offline W&B run under ``run_dir``.

    wandb 0.31 offline writes no ``files/wandb-summary.json`` / ``files/config.yaml`` (those are made when a run
    is synced) and ships no reader, so this reads the run's own record log: the ``.wandb`` file is a LevelDB-style
    log (a 7-byte header, 32 KiB blocks, chunks of crc32 + length + type) of ``wandb_internal_pb2.Record``s.
    """
    import json
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, buf, block = path.read_bytes(), 7, b"", 32768
    out = {"summary": {}, "config": {}, "exit": None}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf, pos = buf + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind not in (1, 4):  # FULL or LAST chunk ends a record
            continue
        record = pb.Record()
        record.ParseFromString(buf)
        buf = b""
        which = record.WhichOneof("record_type")
        if which == "summary":
            out["summary"].update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.summary.update})
        elif which == "config":
            out["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif which == "run":
            out["group"], out["tags"], out["job_type"] = record.run.run_group, list(record.run.tags), record.run.job_type
        elif which == "exit":
            out["exit"] = record.exit.exit_code
    return out


def test_wandb_multirun_from_the_cli(tmp_path):
    """``python run.py -m … logger=wandb`` with WANDB_MODE=offline, a failing job first: every job has its own
    finished run grouped by the sweep; the good job's summary holds metrics.json's final metrics."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "run.py", "-m", "experiment=lm_tiny", "logger=wandb", *SHORT, "callbacks.progress_bar=null",
           "model.optimizer.lr=-1.0,0.003", f"paths.log_dir={tmp_path}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb_home"))
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, "a sweep with a failed job exits non-zero"
    summary = json.loads((tmp_path / "multirun" / "lm_tiny" / "summary.json").read_text())
    bad, good = (Path(j["dir"]) for j in summary["jobs"])

    ok = wandb_records(good)
    metrics = json.loads((good / "metrics.json").read_text())
    assert metrics["status"] == "ok"
    for key in ("train/loss", "val/loss"):
        assert ok["summary"][key] == pytest.approx(metrics["final"][key], rel=1e-6)
    assert ok["config"]["experiment"] == "lm_tiny" and ok["config"]["trainer"]["max_steps"] == 6
    assert ok["config"]["model"]["optimizer"]["lr"] == 0.003
    assert ok["group"] == "multirun/lm_tiny" and ok["job_type"] == "fit"
    assert {"lm_tiny", "tiny_llama", "lm"} <= set(ok["tags"])
    assert ok["exit"] == 0

    failed = wandb_records(bad)  # the failed job's run was finished too, so the next job got a fresh one
    assert failed["exit"] is not None and failed["group"] == "multirun/lm_tiny"
    assert "val/loss" not in failed["summary"]


def test_run_config_drops_secrets():
    from omegaconf import OmegaConf

    from lightning_modules.common.dashboard import run_config

    cfg = OmegaConf.create({"a": 1, "b": "${a}", "local": {"wandb_api_key": "SECRET-1", "hf_token": "SECRET-2", "keep": [1]}})
    out = run_config(cfg)  # (plus the experiment and group choices when a HydraConfig is set)
    assert {k: out[k] for k in ("a", "b", "local")} == {"a": 1, "b": 1, "local": {"keep": [1]}}
    assert "SECRET" not in str(out)


# --- dashboards: log_table / log_figure -----------------------------------------------------------------------

ROWS = [{"task": "niah", "press": "knorm", "acc": 0.5}, {"task": "vt", "press": "snapkv", "acc": 0.25, "extra": 3}]


def _figure(width_px=300, height_px=200):
    from lightning_modules.common.dashboard import figure

    fig, ax = figure(figsize=(width_px / 100, height_px / 100), dpi=100)
    ax.plot([0, 1], [1, 0])
    return fig


def test_dashboard_reaches_a_spied_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    import wandb
    from lightning.pytorch.loggers import WandbLogger

    from lightning_modules.common.dashboard import log_figure, log_table

    logger = WandbLogger(project="paperlab-test", save_dir=str(tmp_path))
    logged = []
    monkeypatch.setattr(type(logger.experiment), "log", lambda self, data, *a, **k: logged.append(data))
    try:
        log_table("kv/accuracy", ROWS, [logger])
        log_figure("kv/budgets", _figure(), [logger])
    finally:
        wandb.finish()
    table = logged[0]["kv/accuracy"]
    assert isinstance(table, wandb.Table)
    assert table.columns == ["task", "press", "acc", "extra"]
    assert table.data == [["niah", "knorm", 0.5, None], ["vt", "snapkv", 0.25, 3]]
    (image,) = logged[1]["kv/budgets"]
    assert isinstance(image, wandb.Image) and (image.image.width, image.image.height) == (300, 200)


def test_dashboard_reaches_tensorboard_and_csv(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_modules.common.dashboard import log_figure, log_table

    tb, csv_logger = TensorBoardLogger(str(tmp_path), name="tb", version=""), CSVLogger(str(tmp_path), name="csv", version="")
    log_table("kv/accuracy", ROWS, [tb, csv_logger])
    log_figure("kv/budgets", _figure(), [tb, csv_logger], step=3)
    tb.experiment.flush()

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    (img,) = acc.Images("kv/budgets")
    assert (img.step, img.width, img.height) == (3, 300, 200)
    text = acc.Tensors("kv/accuracy/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| niah | knorm | 0.5 |" in text and "| vt | snapkv | 0.25 | 3 |" in text

    with open(tmp_path / "csv" / "tables" / "kv_accuracy.csv") as f:
        assert list(csv.DictReader(f)) == [{"task": "niah", "press": "knorm", "acc": "0.5", "extra": ""},
                                           {"task": "vt", "press": "snapkv", "acc": "0.25", "extra": "3"}]
    assert (tmp_path / "csv" / "figures" / "kv_budgets.png").stat().st_size > 0


def test_dashboard_does_nothing_without_a_logger(tmp_path):
    from lightning_modules.common.dashboard import log_figure, log_table

    class Other:  # a logger that can hold neither
        log_dir = str(tmp_path)

    log_table("t", ROWS, [Other()])
    log_table("t", ROWS, [])
    log_figure("f", _figure(), None)
    assert not any(tmp_path.iterdir())


# Each paper's tiny experiment puts its tables and figures on the dashboard (here: the CSV logger's run dir).
PAPER_DASHBOARDS = {
    "manifoldkv_tiny": ("kv_accuracy", "kv_retained_fraction_per_head"),
    "watersic_tiny": ("quant_layers", "quant_rate_vs_limit"),
    "hici_tiny": ("long_context_by_length", "long_context_ppl"),
    "llr_tiny": ("llr_recomputes", "llr_alpha"),
    "ps_ppo_tiny": ("val_completions", "rl_reward"),
    "qat_law_tiny": ("qat_variants", "qat_delta"),
}


@pytest.mark.slow
@pytest.mark.parametrize("experiment", sorted(PAPER_DASHBOARDS))
def test_paper_dashboards(experiment, tmp_path):
    import csv

    table, fig = PAPER_DASHBOARDS[experiment]
    _, metrics = run_experiment(experiment, tmp_path)
    assert metrics["status"] == "ok"
    with open(tmp_path / "csv" / "tables" / f"{table}.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(any(v not in ("", None) for v in r.values()) for r in rows)
    assert (tmp_path / "csv" / "figures" / f"{fig}.png").stat().st_size > 1000


def test_sweep_fit_logs_its_table_and_plot_to_wandb(tmp_path, monkeypatch):
    """``python -m sweeps.fit … --wandb``: the collected table and the fitted law's plot reach one W&B run."""
    import pandas as pd
    import wandb

    from sweeps.fit import main
    from tests.test_sweeps_qat import planted_delta

    monkeypatch.setenv("WANDB_MODE", "offline")
    df = planted_delta(noise=0.02).rename(columns={"G": "group_size"})
    df["precision"], df["seed"], df["loss"] = "w4a4", 1, 3.0
    pd.concat([df, df.drop_duplicates(["N", "D"]).assign(precision="fp", delta=0.0, group_size=0)],
              ignore_index=True).to_csv(tmp_path / "t.csv", index=False)
    logged = []
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", lambda self, data, *a, **k: logged.append(data))
    assert main([str(tmp_path / "t.csv"), "--law", "qat_delta", "--out", str(tmp_path / "out"), "--wandb"]) == 0
    assert wandb.run is None  # finished
    by_key = {k: v for d in logged for k, v in d.items()}
    assert isinstance(by_key["qat_law/fit"][0], wandb.Image)
    assert isinstance(by_key["law/table"], wandb.Table) and len(by_key["law/table"].data) == len(df) + df[["N", "D"]].drop_duplicates().shape[0]
