"""After a multirun: one table of every job's status and metric, written to ``summary.json``.

A job that failed is recorded by ``run`` (its metrics.json says ``failed: ...``) and the others go on; the
summary names the failures and the process exits non-zero when there were any. It is read from the run dirs, not
collected in the submitting process, so it holds under any launcher (basic, submitit local or SLURM).

Also the resolvers that name a sweep (its dir, and the W&B group its runs share).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("sweep_experiment"):
        # Cached: Hydra copies the sweep-time cache into each job's config, so every job resolves
        # hydra.sweep.dir to the dir the sweep itself was given, even when the experiment is a swept axis.
        OmegaConf.register_new_resolver("sweep_experiment", sweep_experiment, use_cache=True)
    if not OmegaConf.has_resolver("sweep_subdir"):
        OmegaConf.register_new_resolver("sweep_subdir", sweep_subdir)
    if not OmegaConf.has_resolver("run_group"):
        OmegaConf.register_new_resolver("run_group", run_group)


def sweep_experiment(task_overrides, chosen: str) -> str:
    """The experiment part of a multirun dir, from the overrides the user typed (``hydra.overrides.task``).

    It is resolved when the sweep starts, before any job's Hydra config exists (``${hydra:...}`` is not set
    then). A swept experiment (``experiment=a,b``) names one dir for the whole sweep: ``a+b``.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    typed = [o for o in task_overrides or () if o.split("=", 1)[0].lstrip("+~") == "experiment"]
    for ov in OverridesParser.create().parse_overrides(typed):
        if ov.is_sweep_override():
            try:
                return "+".join(ov.sweep_string_iterator())
            except Exception:  # glob(...) and the like: name the dir by what was typed
                return "".join(c if c.isalnum() or c in "_-" else "_" for c in ov.input_line.split("=", 1)[1])
    return chosen


def sweep_subdir(sweep: str, experiment: str, dirname: str) -> str:
    """A job's dir in its sweep: its overrides, under its experiment when the experiment is a swept axis
    (``experiment`` is left out of the overrides' dir name, so two experiments would otherwise share one)."""
    return dirname if sweep == experiment else f"{experiment}/{dirname}"


def run_group(experiment: str) -> str:
    """The W&B group of a run: its experiment; in a multirun the sweep (``multirun/<sweep dir name>``)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            return f"multirun/{Path(hc.sweep.dir).name}"
    except ValueError:  # no HydraConfig (composed by hand): a single run
        pass
    return experiment


class MultirunSummary(Callback):
    """The sweep's ``summary.json``, built from its jobs' run dirs, so it holds whatever the launcher.

    Jobs may run in other processes, on other nodes (``launcher=slurm``), and be requeued: each job leaves a
    ``.multirun.json`` in its run dir when it starts (this sweep's id, its number, its overrides), and the runner
    leaves ``metrics.json`` when it ends (``ok`` or ``failed: ...``). At the end of the sweep the submitting process
    reads the run dirs that carry this sweep's id (a sweep dir is shared by every sweep of an experiment) and
    exits non-zero when a job failed or left no ``metrics.json`` of its own (killed before the end).
    """

    MARK = ".multirun.json"

    def __init__(self) -> None:
        self.sweep_id: str | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        import uuid

        # set before the launcher runs: the launcher hands this object to every job (pickled for submitit)
        self.sweep_id = uuid.uuid4().hex

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        if self.sweep_id is None:  # a single run
            return
        out = Path(config.hydra.runtime.output_dir)
        mark = {"sweep": self.sweep_id, "num": config.hydra.job.num,
                "overrides": list(config.hydra.overrides.task)}
        tmp = out / f"{self.MARK}.{os.getpid()}"  # every rank of a multi-task job writes the same mark
        tmp.write_text(json.dumps(mark))
        tmp.replace(out / self.MARK)

    def jobs(self, sweep_dir: Path) -> list[dict[str, Any]]:
        """This sweep's jobs, in job order, each with its status and final metrics."""
        jobs = []
        for mark_path in sweep_dir.rglob(self.MARK):
            try:
                mark = json.loads(mark_path.read_text())
            except (OSError, ValueError):
                continue
            if mark.get("sweep") != self.sweep_id:
                continue
            out = mark_path.parent
            metrics_path = out / "metrics.json"
            # one left by an earlier sweep of the same job is older than this job's start
            fresh = metrics_path.exists() and metrics_path.stat().st_mtime >= mark_path.stat().st_mtime
            info = json.loads(metrics_path.read_text()) if fresh else {}
            status = info.get("status", "failed: no metrics.json from this sweep (the job ended before the runner "
                                        "wrote it: see its log, e.g. under .submitit/ in the sweep dir)")
            jobs.append({"num": mark["num"], "overrides": mark["overrides"], "dir": str(out), "status": status,
                         "final": info.get("final", {})})
        return sorted(jobs, key=lambda j: j["num"])

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = self.jobs(sweep_dir)
        if not jobs:
            return
        failed = [j for j in jobs if j["status"] != "ok"]
        (sweep_dir / "summary.json").write_text(json.dumps({"jobs": jobs, "failed": len(failed)}, indent=2))
        print(f"\nmultirun summary ({sweep_dir / 'summary.json'}): {len(jobs) - len(failed)} ok, {len(failed)} failed")
        for j in jobs:
            print(f"  [{'ok' if j not in failed else 'FAILED'}] {' '.join(j['overrides']) or '(no overrides)'}"
                  + ("" if j not in failed else f"  -> {j['status'][:200]}"))
        if failed:
            raise SystemExit(1)
