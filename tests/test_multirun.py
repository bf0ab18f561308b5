"""``python run.py -m`` as the README types it (no ``hydra.*`` override, only ``paths.log_dir``): three jobs, one
made to fail; the others finish with their own results, the failure is recorded in its metrics.json and named in
the sweep's summary.json (in ``<log_dir>/multirun/<experiment>``), and the process exits non-zero."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_multirun_one_failing_job(tmp_path):
    sweep = tmp_path / "multirun" / "lm_tiny"  # the sweep dir comes from the typed experiment, at sweep time
    cmd = [sys.executable, "run.py", "-m", "experiment=lm_tiny", "debug=smoke", "task=fit", "trainer.max_steps=6",
           "trainer.val_check_interval=3", "data.max_val_sequences=8", "callbacks.progress_bar=null",
           "model.optimizer.lr=0.003,-1.0,0.002",  # a negative learning rate: AdamW refuses it at setup
           f"paths.log_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0, "a sweep with a failed job must exit non-zero"

    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["failed"] == 1 and len(summary["jobs"]) == 3
    by_lr = {next(o.split("=", 1)[1] for o in j["overrides"] if o.startswith("model.optimizer.lr=")): j
             for j in summary["jobs"]}
    assert set(by_lr) == {"0.003", "-1.0", "0.002"}
    assert by_lr["-1.0"]["status"].startswith("failed") and "Invalid learning rate" in by_lr["-1.0"]["status"]
    assert "model.optimizer.lr=-1.0" in proc.stdout  # the printed table names it too

    dirs = {lr: Path(j["dir"]) for lr, j in by_lr.items()}
    assert len(set(dirs.values())) == 3 and all(d.parent == sweep for d in dirs.values())
    failed = json.loads((dirs["-1.0"] / "metrics.json").read_text())
    assert failed["status"].startswith("failed: ValueError")
    finals = {}
    for lr in ("0.003", "0.002"):
        m = json.loads((dirs[lr] / "metrics.json").read_text())
        assert m["status"] == "ok" and m["global_step"] == 6
        assert math.isfinite(m["final"]["val/loss"])
        assert (dirs[lr] / "checkpoints" / "last.ckpt").exists()
        finals[lr] = m["final"]["train/loss"]
    assert finals["0.003"] != finals["0.002"]  # each job ran its own config, not a copy of another's


def test_sweep_experiment_names_the_typed_sweep():
    from callbacks.hydra_summary import sweep_experiment

    assert sweep_experiment(["experiment=hici_tiny", "seed=1,2"], "hici_tiny") == "hici_tiny"
    assert sweep_experiment(["seed=1,2"], "lm_tiny") == "lm_tiny"  # the default experiment
    assert sweep_experiment(["experiment=lm_tiny,llr_tiny", "seed=1"], "lm_tiny") == "lm_tiny+llr_tiny"
    assert sweep_experiment(["experiment=choice(a,b)"], "lm_tiny") == "a+b"


def test_a_swept_experiment_keeps_one_sweep_dir(tmp_path):
    """Each job resolves hydra.sweep.dir in its own config; the sweep-time value must win, or the jobs of
    ``experiment=a,b`` scatter over multirun/a and multirun/b while summary.json lands in a third dir.
    Both jobs stop in the config check (FSDP over one device), so this costs two imports, not two trainings; their
    one-line errors are what summary.json records."""
    cmd = [sys.executable, "run.py", "-m", "experiment=lm_tiny,llr_tiny", "trainer=fsdp", "trainer.devices=1",
           f"paths.log_dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    sweep = tmp_path / "multirun" / "lm_tiny+llr_tiny"
    assert [p.name for p in (tmp_path / "multirun").iterdir()] == [sweep.name]
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["failed"] == 2
    assert sorted(Path(j["dir"]).relative_to(sweep).parts[0] for j in summary["jobs"]) == ["llr_tiny", "lm_tiny"]
    assert all("shards nothing" in j["status"] for j in summary["jobs"])
    # a job's error a user can fix: its one line on stderr (no traceback) is what summary.json records for it
    lines = [line[len("error: "):] for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(j["status"] for j in summary["jobs"]) == sorted(f"failed: {line}" for line in lines)


def test_summary_is_read_from_the_run_dirs_of_this_sweep(tmp_path):
    """The summary holds whatever process ran the jobs: each job gets a copy of the callback (submitit pickles
    it into another process, on another node) and only leaves files in its run dir. Jobs of another sweep in the
    same sweep dir, and a metrics.json older than the job's start (left by an earlier sweep), are not this sweep's."""
    import pickle
    import time

    import pytest
    from omegaconf import OmegaConf

    from callbacks.hydra_summary import MultirunSummary

    sweep = tmp_path / "multirun" / "lm_tiny"
    sweep_cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})

    def job(cb, num, seed, metrics=None, stale=False):
        out = sweep / f"seed={seed}"
        out.mkdir(parents=True, exist_ok=True)
        if stale:  # an earlier sweep's result, written before this job started
            (out / "metrics.json").write_text(json.dumps({"status": "ok", "final": {}}))
            old = time.time() - 3600
            os.utime(out / "metrics.json", (old, old))
        copy = pickle.loads(pickle.dumps(cb))  # what the job's process holds
        copy.on_job_start(config=OmegaConf.create({"hydra": {"runtime": {"output_dir": str(out)}, "job": {"num": num},
                                                              "overrides": {"task": [f"seed={seed}"]}}}),
                          task_function=None)
        if metrics is not None:
            (out / "metrics.json").write_text(json.dumps(metrics))

    earlier = MultirunSummary()
    earlier.on_multirun_start(config=sweep_cfg)
    job(earlier, 0, 9, {"status": "failed: ValueError: from another sweep", "final": {}})

    cb = MultirunSummary()
    cb.on_multirun_start(config=sweep_cfg)
    job(cb, 0, 1, {"status": "ok", "final": {"val/loss": 2.5}})
    job(cb, 1, 2, {"status": "failed: ValueError: boom", "final": {}})
    job(cb, 2, 3)  # killed before the runner wrote metrics.json
    job(cb, 3, 4, stale=True)  # killed too, over an earlier sweep's metrics.json
    with pytest.raises(SystemExit) as exit_:
        cb.on_multirun_end(config=sweep_cfg)
    assert exit_.value.code == 1
    summary = json.loads((sweep / "summary.json").read_text())
    assert [j["overrides"] for j in summary["jobs"]] == [["seed=1"], ["seed=2"], ["seed=3"], ["seed=4"]]
    assert summary["failed"] == 3
    status = [j["status"] for j in summary["jobs"]]
    assert status[0] == "ok" and summary["jobs"][0]["final"] == {"val/loss": 2.5}
    assert status[1] == "failed: ValueError: boom"
    assert status[2].startswith("failed: no metrics.json from this sweep") and status[3] == status[2]

    # a sweep whose jobs all ended well writes its summary and does not fail
    ok = MultirunSummary()
    ok.on_multirun_start(config=sweep_cfg)
    job(ok, 0, 1, {"status": "ok", "final": {}})
    ok.on_multirun_end(config=sweep_cfg)
    assert json.loads((sweep / "summary.json").read_text())["failed"] == 0
