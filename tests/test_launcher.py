"""``launcher=slurm``: the node/GPU numbers travel from the trainer config into the sbatch script, as data.

Nothing is submitted: the real submitit launcher builds its real executor (the ``srun`` presence check is
faked) and renders the sbatch file; only ``map_array`` (the submission) is replaced by a recorder.
Requeue has one owner: submitit (checkpoint + resubmit with ``ckpt_path=last``); Lightning's own SLURM
auto-requeue is off.
"""
from __future__ import annotations

import re
import shutil

import pytest
from omegaconf import OmegaConf

from tests.helpers import compose


def _sbatch(cfg, monkeypatch):
    import submitit
    from hydra.utils import instantiate

    rendered = {}

    def record_map_array(self, fn, *iterables):
        ex = self._executor
        rendered["sbatch"] = ex._make_submission_file_text("python -u -m submitit.core._submit %j", "uid")
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
