"""``launcher=slurm`` against a running SLURM (``bash .ci/slurm.sh start``: one node, its CPUs, no GPUs), each
command as a user types it (``python run.py -m ... launcher=slurm_cpu``), submitted with the real ``sbatch``:

- a multirun's jobs run on SLURM, and ``summary.json`` names the one that failed; the command exits non-zero;
- inside a job Lightning sees SLURM: ``SLURMEnvironment``, world size = nodes x tasks per node, ranks from SLURM,
  no Lightning auto-requeue (submitit owns the requeue signal); two tasks on the node train DDP (gloo) together;
- preemption: a running job is interrupted twice, by the signal submitit handles (USR2: checkpoint, requeue) and
  by ``scontrol requeue`` (what SLURM does when it preempts), comes back, resumes from ``checkpoints/last.ckpt``,
  and ends with the same step, losses and weights as an uninterrupted run.

Marked ``slurm`` (``python -m pytest -q -m slurm``); skipped only where SLURM is not installed. What they cannot
show: GPUs (``gpus_per_node``), and more than one node (the multi-node sbatch script is checked on paper in
tests/test_launcher.py).
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[1]
START = "bash .ci/slurm.sh install && bash .ci/slurm.sh start"
# two one-core jobs at a time on a 2-CPU node; one thread each
ON_SLURM = ["launcher=slurm_cpu", "hydra.launcher.cpus_per_task=1", "callbacks.progress_bar=null"]


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    if shutil.which("sbatch") is None:
        pytest.skip(f"SLURM is not installed: {START}")
    proc = subprocess.run(["sinfo", "-h", "-N", "-o", "%t %c"], capture_output=True, text=True, timeout=30)
    nodes = [line.split() for line in proc.stdout.splitlines()]
    if proc.returncode != 0 or not any(state.rstrip("*") in ("idle", "mix", "alloc") for state, _ in nodes):
        pytest.fail(f"SLURM is installed but no node is up ({(proc.stderr or proc.stdout).strip()}): "
                    "bash .ci/slurm.sh start")
    if max(int(cpus) for _, cpus in nodes) < 2:
        pytest.fail(f"the SLURM tests need a node with 2 CPUs; sinfo: {proc.stdout.strip()}")


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1")


def _multirun(args: list[str], log_dir: Path) -> subprocess.Popen:
    out = open(log_dir.parent / f"{log_dir.name}.out", "w")
    return subprocess.Popen([sys.executable, "run.py", "-m", *args, f"paths.log_dir={log_dir}"], cwd=ROOT,
                            env=_env(), stdout=out, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, log_dir: Path, timeout: float = 600) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return (log_dir.parent / f"{log_dir.name}.out").read_text()


def _job_ids(sweep: Path) -> list[str]:
    """The SLURM ids of a sweep's jobs, from submitit's folder: ``<array>_<task>`` for several, ``<id>`` for one."""
    names = [p.name for p in (sweep / ".submitit").iterdir()] if (sweep / ".submitit").is_dir() else []
    return sorted(n for n in names if re.fullmatch(r"\d+_\d+", n)) or sorted(n for n in names if n.isdigit())


def _job_logs(sweep: Path) -> str:
    return "".join(p.read_text() for p in sorted((sweep / ".submitit").glob("*/*_log.*")))


def test_multirun_on_slurm_names_the_failed_job(tmp_path):
    """Two seeds and a typo (``seed=abc``): three SLURM jobs; two finish with their metrics, the third is named in
    summary.json, and the submitting command exits non-zero."""
    logs = tmp_path / "logs"
    sweep = logs / "multirun" / "lm_tiny"
    proc = _multirun(["experiment=lm_tiny", "debug=smoke", *ON_SLURM, "seed=1,2,abc"], logs)
    out = _finish(proc, logs)
    assert proc.returncode != 0, out[-3000:]
    assert len(_job_ids(sweep)) == 3  # submitted to SLURM, one array task per job
    assert "Submitit 'slurm' sweep output dir" in out

    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["failed"] == 1 and [j["num"] for j in summary["jobs"]] == [0, 1, 2]
    by_seed = {next(o.split("=", 1)[1] for o in j["overrides"] if o.startswith("seed=")): j for j in summary["jobs"]}
    assert by_seed["abc"]["status"] == "failed: seed='abc' is not an integer — pass one, e.g. seed=1"
    assert "seed=abc" in out and "1 failed" in out  # the printed table names it too
    losses = {}
    for seed in ("1", "2"):
        job = by_seed[seed]
        m = json.loads((Path(job["dir"]) / "metrics.json").read_text())
        assert job["status"] == m["status"] == "ok" and m["global_step"] == 20  # debug=smoke's steps
        assert math.isfinite(m["final"]["val/loss"]) and job["final"] == m["final"]
        assert (Path(job["dir"]) / "checkpoints" / "last.ckpt").exists()
        losses[seed] = m["final"]["train/loss"]
    assert losses["1"] != losses["2"]  # each job ran its own seed


def test_lightning_sees_slurm_two_tasks_train_ddp(tmp_path):
    """``trainer=ddp`` (2 processes) on SLURM: 2 tasks on the node, started by srun, not by Lightning."""
    logs = tmp_path / "logs"
    sweep = logs / "multirun" / "lm_tiny"
    probe = "+callbacks.slurm_probe._target_=tests.slurm_probe.SlurmProbe"
    proc = _multirun(["experiment=lm_tiny", "debug=smoke", "task=fit", "trainer=ddp", "trainer.max_steps=4",
                      "trainer.val_check_interval=2", *ON_SLURM, probe], logs)
    out = _finish(proc, logs)
    assert proc.returncode == 0, out[-3000:] + _job_logs(sweep)[-3000:]
    assert len(_job_ids(sweep)) == 1
    (run_dir,) = [p.parent for p in sweep.glob("*/metrics.json")]

    seen = {r: json.loads((run_dir / f"slurm_probe_rank{r}.json").read_text()) for r in (0, 1)}
    for rank, s in seen.items():
        assert s["environment"] == "SLURMEnvironment" and s["detected"]
        assert s["auto_requeue"] is False
        # one requeue owner: submitit's handler holds USR2 (its timeout signal), Lightning set none on USR1
        assert s["sigusr2"] == "submitit.core.job_environment.SignalHandler.checkpoint_and_try_requeue"
        assert s["sigusr1"] == "SIG_DFL"
        # world = nodes x tasks per node, as SLURM counts it; the ranks are SLURM's
        assert s["world_size"] == s["dist_world_size"] == int(s["slurm"]["SLURM_NTASKS"]) == 1 * 2
        assert s["num_nodes"] == int(s["slurm"]["SLURM_JOB_NUM_NODES"]) == 1
        assert s["global_rank"] == s["dist_rank"] == int(s["slurm"]["SLURM_PROCID"]) == rank
        assert s["local_rank"] == int(s["slurm"]["SLURM_LOCALID"]) == rank and s["node_rank"] == 0
        assert s["parent"] == "slurmstepd" and s["spawned_by_lightning"] == 0  # srun started them, not Lightning
        assert s["strategy"] == "DDPStrategy" and s["backend"] == "gloo"
        # the job runs this venv's python with this environment (the tiny models' cache included)
        assert s["python"] == sys.executable and s["paperlab_cache"] == os.environ.get("PAPERLAB_CACHE")
    assert seen[0]["slurm"]["SLURM_JOB_ID"] == seen[1]["slurm"]["SLURM_JOB_ID"]  # one job, two tasks

    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["global_step"] == 4
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4


# ---- preemption ----

MAX_STEPS, EVERY = 30, 5
PREEMPTABLE = ["experiment=lm_tiny", "task=fit", f"trainer.max_steps={MAX_STEPS}",
               f"trainer.val_check_interval={EVERY}", "trainer.log_every_n_steps=1", "data.max_val_sequences=8",
               *ON_SLURM]


def _squeue(job_id: str) -> tuple[str, int]:
    """(state, restarts) of a job, from slurmctld (no accounting database needed)."""
    state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()
    show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    m = re.search(r"Restarts=(\d+)", show)
    return state, int(m.group(1)) if m else -1


def _wait_for(what: str, cond, proc: subprocess.Popen, timeout: float = 300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (got := cond()):
            return got
        assert proc.poll() is None, f"the submitting command ended while waiting for {what}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _ckpt_step(path: Path) -> int | None:
    """global_step of a checkpoint, or None while it is missing or half written."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["global_step"]
    except Exception:  # noqa: BLE001 - not there yet, or being written
        return None


def _train_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


def _preempt(job_id: str, how: str, restarts: int, ckpt: Path, proc: subprocess.Popen) -> int:
    """Interrupt the running job; wait until SLURM has requeued it; the step it will resume from."""
    if how == "timeout signal":  # what SLURM sends before the time limit (--signal=USR2@120): submitit's handler
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    else:  # what SLURM does when it preempts a job: SIGTERM to the job, then requeue
        subprocess.run(["scontrol", "requeue", job_id], check=True)
    _wait_for(f"{job_id} requeued ({how})", lambda: _squeue(job_id) == ("PENDING", restarts + 1), proc)
    step = _ckpt_step(ckpt)
    assert step is not None and 0 < step < MAX_STEPS, step
    assert not (ckpt.parent.parent / "metrics.json").exists(), "the job ended before it was interrupted"
    return step


def test_preempted_job_resumes_to_the_uninterrupted_result(tmp_path):
    ref_logs, logs = tmp_path / "ref", tmp_path / "preempted"
    reference = _multirun(PREEMPTABLE, ref_logs)  # the uninterrupted run, alongside
    victim = _multirun(PREEMPTABLE, logs)
    sweep = logs / "multirun" / "lm_tiny"
    try:
        ckpt = Path(_wait_for("a first checkpoint", lambda: next(sweep.glob("*/checkpoints/last.ckpt"), None), victim))
        (job_id,) = _job_ids(sweep)
        resumed_from = []
        for restarts, how in enumerate(("timeout signal", "scontrol requeue")):
            if resumed_from:  # back and running: wait for a checkpoint past the one it resumed from
                _wait_for("a newer checkpoint", lambda: (_ckpt_step(ckpt) or 0) > resumed_from[-1], victim)
            else:
                _wait_for("the checkpoint written", lambda: _ckpt_step(ckpt), victim)
            resumed_from.append(_preempt(job_id, how, restarts, ckpt, victim))
        out = _finish(victim, logs)
        assert victim.returncode == 0, out[-3000:] + _job_logs(sweep)[-3000:]
    finally:
        if victim.poll() is None or reference.poll() is None:  # a failed wait: leave no job behind
            victim.kill(), reference.kill()
            for d in (sweep, ref_logs / "multirun" / "lm_tiny"):
                subprocess.run(["scancel", *_job_ids(d)], check=False)
    ref_out = _finish(reference, ref_logs)
    assert reference.returncode == 0, ref_out[-3000:]
    assert resumed_from[0] < resumed_from[1]

    logs_text = _job_logs(sweep)
    assert "Caught signal SIGUSR2" in logs_text and f"Requeued job {job_id}" in logs_text  # submitit requeued it
    assert logs_text.count("Restored all states from the checkpoint") == 2  # resumed twice, not restarted
    assert _squeue(job_id)[1] == 2  # SLURM started it three times

    (run_dir,) = [p.parent for p in sweep.glob("*/metrics.json")]
    (ref_dir,) = [p.parent for p in (ref_logs / "multirun" / "lm_tiny").glob("*/metrics.json")]
    got, want = (json.loads((d / "metrics.json").read_text()) for d in (run_dir, ref_dir))
    assert got["status"] == want["status"] == "ok"
    assert got["global_step"] == want["global_step"] == MAX_STEPS
    assert got["final"]["val/loss"] == pytest.approx(want["final"]["val/loss"], rel=1e-5, abs=1e-6)
    summary = json.loads((sweep / "summary.json").read_text())
    assert summary["failed"] == 0 and [j["status"] for j in summary["jobs"]] == ["ok"]

    # the steps after the last restart saw the same batches: the same per-step training losses (the CSV log holds
    # the steps since the job's last start: Lightning's CSVLogger begins its file again); the weights cover the rest
    ref_losses, losses = _train_losses(ref_dir), _train_losses(run_dir)
    after = [s for s in ref_losses if s >= resumed_from[-1]]
    assert after and all(s in losses for s in after)
    for s in after:
        assert losses[s] == pytest.approx(ref_losses[s], rel=1e-5, abs=1e-6), s
    a = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    b = torch.load(ref_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert a["global_step"] == b["global_step"] == MAX_STEPS
    for k, v in b["state_dict"].items():
        torch.testing.assert_close(a["state_dict"][k], v, rtol=1e-5, atol=1e-6, msg=k)
