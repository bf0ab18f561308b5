"""Compose and run experiments in-process, as run.py would, with outputs under a temp dir."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, open_dict

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def experiments() -> list[str]:
    """The runnable experiments: conf/experiment/*.yaml (family bases in conf/experiment/base/ are not ones)."""
    return sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def compose(experiment: str, overrides: list[str] = (), output_dir: str | Path | None = None) -> DictConfig:
    """The config ``python run.py experiment=<name> <overrides>`` would run, with HydraConfig set."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from runner import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hydra_compose("run", overrides=[f"experiment={experiment}", *overrides], return_hydra_config=True)
    if output_dir is not None:
        with open_dict(cfg):
            cfg.paths.output_dir = str(output_dir)
            cfg.hydra.runtime.output_dir = str(output_dir)
    HydraConfig().set_config(cfg)
    return cfg


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
