"""Compose and run experiments in-process, as run.py would, with outputs under a temp dir."""
from __future__ import annotations

from pathlib import Path

from runner import compose  # noqa: F401  (tests and benchmarks import it from here too)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def experiments() -> list[str]:
    """The runnable experiments: conf/experiment/*.yaml (family bases in conf/experiment/base/ are not ones)."""
    return sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def run_experiment(experiment: str, tmp_path, overrides: list[str] = ("debug=smoke",), logger: str = "csv"):
    """Run one experiment in-process; returns (optimized metric, metrics.json contents)."""
    import json

    from runner import run

    cfg = compose(experiment, [*overrides, f"logger={logger}", "callbacks.progress_bar=null"], output_dir=tmp_path)
    value = run(cfg)
    metrics = json.loads((Path(tmp_path) / "metrics.json").read_text())
    return value, metrics


# The cached warm-up (lightning_modules/common/rl/warmup.py) a tiny smoke test starts from: 40 steps at batch 16,
# not the experiments' 150-300 at 32, so a cold suite builds each in seconds. Smoke tests on one warm-up task use
# these same overrides, so they share one cache key (ps_ppo/grpo/rloo/hista on arithmetic build it once).
SMOKE_WARMUP = ("model.warmup.steps=40", "model.warmup.batch_size=16")
