"""Resume: a real ``python run.py`` killed with SIGKILL and started again with ``ckpt_path=last`` ends where an
uninterrupted run ends — same final step, same per-step losses after the restart (same data order), same
weights — and the step-keyed sampler's position is a pure function of the step.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import compose

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 20
ARGS = ["experiment=lm_tiny", "task=fit", f"trainer.max_steps={MAX_STEPS}", "trainer.val_check_interval=5",
        "trainer.log_every_n_steps=1", "data.max_val_sequences=8", "callbacks.progress_bar=null"]


def _popen(args: list[str], log_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")
    log = open(log_dir.parent / f"{log_dir.name}.out", "w")
    return subprocess.Popen([sys.executable, "run.py", *args, f"paths.log_dir={log_dir}"], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def _run_dir(log_dir: Path) -> Path:
    dirs = list((log_dir / "runs" / "lm_tiny").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def _train_losses(run_dir: Path) -> dict[int, float]:
    out = {}
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                out[int(row["step"])] = float(row["train/loss"])
    return out


def _wait(proc: subprocess.Popen, log_dir: Path, timeout: float = 600) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out = (log_dir.parent / f"{log_dir.name}.out").read_text()
    assert proc.returncode == 0, out[-5000:]


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    ref_logs, logs = tmp_path / "ref", tmp_path / "killed"
    reference = _popen(ARGS, ref_logs)  # the uninterrupted run, alongside the one that gets killed
    victim = _popen(ARGS, logs)
    try:
        deadline = time.time() + 600
        ckpt = None
        while time.time() < deadline and victim.poll() is None:
            found = list(logs.glob("runs/lm_tiny/*/checkpoints/last.ckpt"))
            if found:
                ckpt = found[0]
                break
            time.sleep(0.1)
        assert ckpt is not None, "no checkpoint appeared before the run ended"
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    finally:
        if victim.poll() is None:
            victim.kill()
    run_dir = _run_dir(logs)
    assert not (run_dir / "metrics.json").exists(), "the run finished before it was killed; nothing was resumed"
    killed_at = torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    assert 0 < killed_at < MAX_STEPS

    # same command plus ckpt_path=last: it finds its own run dir (ckpt_path is not part of the dir name)
    _wait(_popen([*ARGS, "ckpt_path=last"], logs), logs)
    resumed_log = (tmp_path / "killed.out").read_text()
    assert "Restored all states from the checkpoint" in resumed_log  # resumed, not restarted from scratch
    _wait(reference, ref_logs)
    assert _run_dir(logs) == run_dir
    ref_dir = _run_dir(ref_logs)
    assert ref_dir.name == run_dir.name

    got = json.loads((run_dir / "metrics.json").read_text())
    want = json.loads((ref_dir / "metrics.json").read_text())
    assert got["status"] == want["status"] == "ok"
    assert got["global_step"] == want["global_step"] == MAX_STEPS
    assert got["final"]["val/loss"] == pytest.approx(want["final"]["val/loss"], rel=1e-5, abs=1e-6)

    # the steps after the restart saw the same batches: identical per-step training losses
    ref_losses, losses = _train_losses(ref_dir), _train_losses(run_dir)
    after = [s for s in ref_losses if s >= killed_at]
    assert after and all(s in losses for s in after)
    for s in after:
        assert losses[s] == pytest.approx(ref_losses[s], rel=1e-5, abs=1e-6), s

    a = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    b = torch.load(ref_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert a["global_step"] == b["global_step"] == MAX_STEPS
    for k, v in b["state_dict"].items():
        torch.testing.assert_close(a["state_dict"][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_sampler_position_is_a_function_of_the_step():
    from datamodules.common.sampling import StepStreamSampler

    n, total = 37, 100  # several passes over the data, a pass boundary mid-stream
    for world in (1, 2):
        for rank in range(world):
            full = list(StepStreamSampler(n, total, seed=3, rank=rank, world_size=world))
            assert len(full) == total
            for start in (0, 1, 36, 37, 55, 99):
                assert list(StepStreamSampler(n, total, seed=3, start=start, rank=rank, world_size=world)) == full[start:]
    # ranks partition the global stream: together they see each pass as a permutation
    r0 = list(StepStreamSampler(n, n, seed=3, rank=0, world_size=2))
    r1 = list(StepStreamSampler(n, n, seed=3, rank=1, world_size=2))
    merged = [x for pair in zip(r0, r1) for x in pair]
    assert sorted(merged[:n]) == list(range(n))
    # another seed, another order
    assert list(StepStreamSampler(n, n, seed=4)) != list(StepStreamSampler(n, n, seed=3))


def test_seeds_get_their_own_run_dirs():
    from omegaconf import OmegaConf

    dirs = {s: OmegaConf.select(compose("lm_tiny", [f"seed={s}"]), "hydra.run.dir") for s in (1, 2)}
    assert dirs[1] != dirs[2]
    assert dirs[1].endswith("lm_tiny/seed=1")
    # ckpt_path (resuming) and the launcher do not change the dir: a rerun finds its own checkpoint
    assert OmegaConf.select(compose("lm_tiny", ["seed=1", "ckpt_path=last"]), "hydra.run.dir") == dirs[1]


def test_long_override_lists_get_a_bounded_deterministic_dir_name():
    from runner import run_dirname

    long_a = ",".join(f"trainer.strategy.option_{i}=value_{i}" for i in range(20))
    long_b = long_a.replace("value_19", "value_xx")
    a, b = run_dirname(long_a), run_dirname(long_b)
    assert len(a.encode()) <= 160 and len(b.encode()) <= 160  # a file name holds at most 255 bytes
    assert a == run_dirname(long_a) and a != b  # the same command finds its dir; another never shares it
    assert run_dirname("") == "default"
    assert run_dirname("data.files=/x/y.jsonl,seed=1") == "data.files=_x_y.jsonl,seed=1"  # one dir level
