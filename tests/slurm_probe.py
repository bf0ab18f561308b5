"""What Lightning sees inside a SLURM job, written by every rank: the SLURM tests add it to a real run with
``+callbacks.slurm_probe._target_=tests.slurm_probe.SlurmProbe`` and read ``slurm_probe_rank<r>.json`` from the
run dir (tests/test_slurm.py)."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import lightning as L

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS",
              "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NUM_NODES")


def _handler(signum) -> str:
    h = signal.getsignal(signum)
    return h.name if isinstance(h, signal.Handlers) else f"{h.__module__}.{h.__qualname__}"


class SlurmProbe(L.Callback):
    def on_train_start(self, trainer, pl_module):  # after Lightning has set up the processes and its signals
        import torch.distributed as dist
        from lightning.pytorch.plugins.environments import SLURMEnvironment

        env = trainer.strategy.cluster_environment
        seen = {
            "environment": type(env).__name__, "auto_requeue": getattr(env, "auto_requeue", None),
            "detected": SLURMEnvironment.detect(),
            "world_size": trainer.world_size, "num_nodes": trainer.num_nodes, "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank, "node_rank": trainer.node_rank,
            "strategy": type(trainer.strategy).__name__,
            # who started this process: slurmstepd (srun's task), not Lightning (it spawned no children)
            "parent": Path(f"/proc/{os.getppid()}/comm").read_text().strip(),
            "spawned_by_lightning": len(getattr(trainer.strategy.launcher, "procs", None) or []),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "dist_world_size": dist.get_world_size() if dist.is_initialized() else None,
            "dist_rank": dist.get_rank() if dist.is_initialized() else None,
            "sigusr1": _handler(signal.SIGUSR1), "sigusr2": _handler(signal.SIGUSR2),
            "slurm": {k: os.environ.get(k) for k in SLURM_VARS},
            "python": sys.executable, "paperlab_cache": os.environ.get("PAPERLAB_CACHE"),
        }
        out = Path(trainer.default_root_dir) / f"slurm_probe_rank{trainer.global_rank}.json"
        out.write_text(json.dumps(seen, indent=2))
