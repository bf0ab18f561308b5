"""After a multirun: one table of every job's status and metric, written to ``summary.json``.

A job that failed is recorded by ``run`` (its metrics.json says ``failed: ...``) and the others go on; the
summary names the failures and the process exits non-zero when there were any.

Also the resolvers that name a sweep (its dir, and the W&B group its runs share).
"""
from __future__ import annotations

import json
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
    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        out = Path(job_return.working_dir or ".")
        try:
            from hydra.core.hydra_config import HydraConfig

            out = Path(HydraConfig.get().runtime.output_dir)
        except Exception:
            pass
        metrics_path = out / "metrics.json"
        info = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
        status = info.get("status", "ok" if getattr(job_return.status, "name", "") == "COMPLETED" else "failed")
        if getattr(job_return.status, "name", "") == "FAILED":
            status = f"failed: {job_return._return_value!r}"
        overrides = list(job_return.overrides or [])
        self.jobs.append({"overrides": overrides, "dir": str(out), "status": status,
                          "final": info.get("final", {})})

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if not self.jobs:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        failed = [j for j in self.jobs if not str(j["status"]).startswith("ok")]
        (sweep_dir / "summary.json").write_text(json.dumps({"jobs": self.jobs, "failed": len(failed)}, indent=2))
        print(f"\nmultirun summary ({sweep_dir / 'summary.json'}): {len(self.jobs) - len(failed)} ok, {len(failed)} failed")
        for j in self.jobs:
            print(f"  [{'ok' if j not in failed else 'FAILED'}] {' '.join(j['overrides']) or '(no overrides)'}"
                  + ("" if j not in failed else f"  -> {j['status'][:200]}"))
        if failed:
            raise SystemExit(1)
