"""``launcher=slurm``: the node/GPU numbers travel from the trainer config into the sbatch script, as data.

Nothing is submitted: the real submitit launcher builds its real executor (the ``srun`` presence check is
faked) and renders the sbatch file; only ``map_array`` (the submission) is replaced by a recorder.
Requeue has one owner: submitit (checkpoint + resubmit with ``ckpt_path=last``); Lightning's own SLURM
auto-requeue is off.
"""
from __future__ import annotations

import re
import shutil
import sys

import pytest
from omegaconf import OmegaConf

from tests.helpers import compose


def _sbatch(cfg, monkeypatch):
    import submitit
    from hydra.utils import instantiate

    rendered = {}

    def record_map_array(self, fn, *iterables):
        ex = self._executor
        rendered["sbatch"] = ex._make_submission_file_text(ex._submitit_command_str, "uid")  # what sbatch gets
        rendered["max_num_timeout"] = ex.max_num_timeout
        rendered["jobs"] = list(zip(*iterables))
        rendered["callable"] = fn
        return []

    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/usr/bin/srun" if name == "srun" else real_which(name, *a, **k))
    monkeypatch.setattr(submitit.AutoExecutor, "map_array", record_map_array)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    launcher.launch([["seed=1"]], initial_job_idx=0)
    return rendered


def _directive(sbatch: str, name: str) -> str | None:
    m = re.search(rf"^#SBATCH --{name}=(\S+)$", sbatch, flags=re.M)
    return m.group(1) if m else None


@pytest.mark.parametrize("nodes,gpus", [(1, 8), (4, 8)])
def test_slurm_numbers_propagate(nodes, gpus, tmp_path, monkeypatch):
    cfg = compose("lm_llama7b", ["launcher=slurm", f"trainer.num_nodes={nodes}", f"trainer.devices={gpus}",
                                 "local.slurm.partition=gpu-long", "local.slurm.account=lab",
                                 f"hydra.sweep.dir={tmp_path}"])
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"].endswith("SlurmLauncher")
    assert (launcher["nodes"], launcher["tasks_per_node"], launcher["gpus_per_node"]) == (nodes, gpus, gpus)
    assert (launcher["partition"], launcher["account"]) == ("gpu-long", "lab")  # from conf/local

    rendered = _sbatch(cfg, monkeypatch)
    sbatch = rendered["sbatch"]
    assert _directive(sbatch, "nodes") == str(nodes)
    assert _directive(sbatch, "ntasks-per-node") == str(gpus)  # one task per GPU: SLURM owns the processes
    assert _directive(sbatch, "gpus-per-node") == str(gpus)
    assert _directive(sbatch, "partition") == "gpu-long" and _directive(sbatch, "account") == "lab"
    assert "export NCCL_ASYNC_ERROR_HANDLING=1" in sbatch
    assert "--signal=USR2@120" in sbatch  # submitit's preemption/timeout signal, handled by its checkpoint()
    assert "#SBATCH --requeue" in sbatch.splitlines()  # requeueable whatever the cluster's default
    assert rendered["max_num_timeout"] == 5 and len(rendered["jobs"]) == 1

    # the one requeue owner: submitit resubmits the same job, which resumes from its own last checkpoint
    assert cfg.ckpt_path == "last"
    assert callable(getattr(rendered["callable"], "checkpoint"))
    from hydra.utils import instantiate

    plugins = instantiate(cfg.trainer.plugins)
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    (env,) = plugins
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue is False
    # and the Lightning side agrees on the world those numbers describe
    assert cfg.trainer.num_nodes * cfg.trainer.devices == nodes * gpus


def test_local_launcher_leaves_run_dir_and_trainer_alone():
    a = compose("lm_tiny", ["seed=3"])
    b = compose("lm_tiny", ["seed=3", "launcher=slurm"])
    assert OmegaConf.select(a, "hydra.run.dir") == OmegaConf.select(b, "hydra.run.dir")  # launcher not in the dir name
    assert "plugins" not in a.trainer


def test_hici_llama7b_on_four_nodes_on_paper(tmp_path, monkeypatch):
    """The README's multi-node line, ``python run.py experiment=hici_llama7b launcher=slurm trainer.num_nodes=4
    -m``: the whole sbatch script submitit would hand to sbatch (tests/test_slurm.py runs such scripts on a real
    one-node SLURM; more than one node and GPUs are only checked here, on paper)."""
    cfg = compose("hici_llama7b", ["launcher=slurm", "trainer.num_nodes=4", f"hydra.sweep.dir={tmp_path}"])
    gpus = cfg.trainer.devices
    assert gpus == 8 and cfg.trainer.accelerator == "gpu"  # the experiment's 8-GPU nodes
    lines = _sbatch(cfg, monkeypatch)["sbatch"].splitlines()
    sbatch = "\n".join(lines)
    assert _directive(sbatch, "nodes") == "4"
    assert _directive(sbatch, "ntasks-per-node") == _directive(sbatch, "gpus-per-node") == "8"  # a task per GPU
    assert _directive(sbatch, "cpus-per-task") == "10" and _directive(sbatch, "mem") is None
    assert _directive(sbatch, "time") == "1440"  # minutes; submitit requeues at the limit, at most 5 times
    assert _directive(sbatch, "signal") == "USR2@120" and "#SBATCH --requeue" in lines
    # the setup lines run in the batch script, before srun starts the 32 tasks (8 per node) of one job
    setup, srun = lines.index("export NCCL_ASYNC_ERROR_HANDLING=1"), next(i for i, ln in enumerate(lines)
                                                                           if ln.startswith("srun "))
    assert setup < srun
    assert lines[srun].endswith(f"{sys.executable} -u -m submitit.core._submit {tmp_path}/.submitit/%j")
    assert "--gpus" not in lines[srun] and "--ntasks" not in lines[srun]  # srun takes them from the allocation
    assert cfg.trainer.num_nodes * cfg.trainer.devices == 32


def test_slurm_cpu_asks_for_no_gpu(tmp_path, monkeypatch):
    """``launcher=slurm_cpu``: a CPU partition's job, one task per process (trainer=ddp: 2), no GPU request."""
    cfg = compose("lm_tiny", ["launcher=slurm_cpu", "trainer=ddp", f"hydra.sweep.dir={tmp_path}"])
    sbatch = _sbatch(cfg, monkeypatch)["sbatch"]
    assert _directive(sbatch, "ntasks-per-node") == "2" and _directive(sbatch, "nodes") == "1"
    assert _directive(sbatch, "cpus-per-task") == "2"
    assert not re.search(r"^#SBATCH --(gpus|gres)", sbatch, flags=re.M) and "NCCL" not in sbatch
    assert "#SBATCH --requeue" in sbatch.splitlines() and cfg.ckpt_path == "last"  # the rest is launcher=slurm's
