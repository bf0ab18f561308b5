"""What ``run.py`` does with a composed config: check it, instantiate, run the task, write results.

Kept free of module-level heavy imports: ``python run.py --cfg job`` must not import Lightning.
"""
from __future__ import annotations

import json
import math
import time
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

TASKS = ("fit", "test", "fit_test", "validate")


class ConfigError(ValueError):
    """A config that cannot work, found before any expensive work; the message names the fix."""


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_dirname"):
        # The part of a run dir that comes from the command line's overrides; 'default' when there are none.
        OmegaConf.register_new_resolver("run_dirname", run_dirname)


def run_dirname(overrides: str, max_len: int = 160) -> str:
    """A run dir name from ``hydra.job.override_dirname``: readable, deterministic, within a filename's limit.

    Long override lists (a file name holds at most 255 bytes) keep their first part and end in a hash of the
    whole, so the same command still finds the same dir and different commands never share one.
    """
    if not overrides:
        return "default"
    name = overrides.replace("/", "_")
    if len(name.encode()) <= max_len:
        return name
    import hashlib

    digest = hashlib.sha1(overrides.encode()).hexdigest()[:12]
    return name.encode()[: max_len - 13].decode(errors="ignore") + "-" + digest


def _strategy_target(cfg: DictConfig) -> str:
    strategy = cfg.trainer.get("strategy")
    return strategy.get("_target_", "") if isinstance(strategy, DictConfig) else str(strategy or "")


def check_config(cfg: DictConfig) -> None:
    """Impossible combinations and missing inputs, each as one line, before anything is built."""
    if cfg.get("task") not in TASKS:
        raise ConfigError(f"task={cfg.get('task')!r}: choose one of {', '.join(TASKS)}")
    tr = cfg.trainer
    target = _strategy_target(cfg)
    devices = tr.get("devices", 1)
    n_dev = devices if isinstance(devices, int) else (len(devices) if not isinstance(devices, str) else -1)
    world = n_dev * int(tr.get("num_nodes", 1) or 1) if n_dev > 0 else -1
    if "ModelParallelStrategy" in target and world == 1:
        raise ConfigError("trainer=fsdp with trainer.devices=1 shards nothing: use trainer=cpu/gpu, or set trainer.devices>=2")
    strategy = tr.get("strategy")
    if "ModelParallelStrategy" in target and isinstance(strategy, DictConfig) and (strategy.get("tensor_parallel_size") or 1) > 1:
        raise ConfigError("trainer=fsdp with tensor_parallel_size>1: paperlab modules shard with FSDP2 over data "
                          "parallelism only; set trainer.strategy.tensor_parallel_size=1")
    if "deepspeed" in target.lower() and tr.get("accelerator") == "cpu" and not cfg.get("allow_deepspeed_cpu", False):
        raise ConfigError("DeepSpeed needs GPUs (trainer.accelerator=gpu); on CPU use trainer=ddp or trainer=fsdp")
    pretrained = cfg.get("backbone", {}).get("pretrained")
    if pretrained:
        from lightning_modules.common.backbone import resolve_pretrained

        if pretrained != "tiny-lm":
            resolve_pretrained(pretrained)  # raises one clear line for a missing local path
    ckpt = cfg.get("ckpt_path")
    if ckpt and ckpt not in ("last", "best") and not Path(ckpt).exists():
        raise ConfigError(f"ckpt_path={ckpt!r} does not exist: pass an existing .ckpt, or ckpt_path=last to resume this run dir")


def _instantiate_dict(node, what: str) -> list:
    from hydra.utils import instantiate

    out = []
    for name, sub in (node or {}).items():
        if isinstance(sub, DictConfig) and "_target_" in sub:
            out.append(instantiate(sub, _convert_="all"))
    return out


def _is_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:
        return False


def _write_failure(cfg: DictConfig, err: BaseException, t0: float) -> None:
    path = Path(cfg.paths.output_dir) / "metrics.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    previous.update({"status": f"failed: {type(err).__name__}: {err}", "wall_time_s": round(time.time() - t0, 2)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(previous, indent=2, default=str))


def run(cfg: DictConfig):
    """Run one job; in a multirun a failed job is recorded (metrics.json, summary) and the others go on."""
    t0 = time.time()
    try:
        return _run(cfg)
    except BaseException as err:  # noqa: BLE001 - recorded, then re-raised or reported
        if isinstance(err, KeyboardInterrupt):
            raise
        try:
            _write_failure(cfg, err, t0)
        except Exception:
            pass
        if _is_multirun():
            traceback.print_exc()
            return float("nan")
        raise
    finally:
        _finish_wandb()


def _finish_wandb() -> None:
    import sys

    if "wandb" in sys.modules:  # only if a wandb logger was made; never import it otherwise
        import wandb

        if wandb.run is not None:
            wandb.finish()


def _run(cfg: DictConfig):
    check_config(cfg)
    import lightning as L
    from hydra.utils import instantiate

    L.seed_everything(cfg.seed, workers=True)
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    datamodule = instantiate(cfg.data, _convert_="all") if cfg.get("data") and "_target_" in cfg.data else None
    module = instantiate(cfg.model, _convert_="all")
    callbacks = _instantiate_dict(cfg.get("callbacks"), "callbacks")
    if "deepspeed" in _strategy_target(cfg).lower():  # transformers must know about ZeRO-3 while the backbone is built
        from callbacks.deepspeed_hf import HFZero3Init

        callbacks.append(HFZero3Init())
    loggers = _instantiate_dict(cfg.get("logger"), "logger")
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, _convert_="all")
    for lg in loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))

    task = cfg.task
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path == "last" and not any(out_dir.glob("checkpoints/last*.ckpt")):
        print(f"ckpt_path=last: no checkpoint in {out_dir / 'checkpoints'} yet, starting from scratch")
        ckpt_path = None
    metrics: dict[str, float] = {}

    def collect():
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1})

    if task in ("fit", "fit_test"):
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        collect()
    if task == "validate":
        trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path)
        collect()
    if task in ("test", "fit_test"):
        if task == "fit_test":
            best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
            trainer.test(module, datamodule=datamodule, ckpt_path=best or None)
        else:
            trainer.test(module, datamodule=datamodule, ckpt_path=ckpt_path)
        collect()

    if trainer.global_rank == 0:
        _print_table(cfg, metrics, out_dir)
    value = metrics.get(cfg.get("optimized_metric") or "", None)
    return value if value is None or math.isfinite(value) else float("nan")


def _print_table(cfg, metrics: dict, out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from hydra.core.hydra_config import HydraConfig

    try:
        name = HydraConfig.get().runtime.choices.get("experiment", "?")
    except Exception:
        name = "?"
    table = Table(title=f"{name} — results ({out_dir})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k in sorted(metrics):
        table.add_row(k, f"{metrics[k]:.4f}")
    Console().print(table)
