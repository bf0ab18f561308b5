"""After a multirun: one table of every job's status and metric, written to ``summary.json``.

A job that failed is recorded by ``run`` (its metrics.json says ``failed: ...``) and the others go on; the
summary names the failures and the process exits non-zero when there were any.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


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
