"""What ``run.py`` does with a composed config: check it, instantiate, run the task, write results.

The runner is the one writer of ``metrics.json`` (with any callbacks, or none). Kept free of module-level heavy
imports: ``python run.py --cfg job`` must not import Lightning.
"""
from __future__ import annotations

import inspect
import json
import logging
import math
import sys
import time
import traceback
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

# ConfigError is imported from here too (tests, older code)
from datamodules.common.errors import ConfigError, full_error_asked, one_line, user_error  # noqa: F401

TASKS = ("fit", "test", "fit_test", "validate")
MODES = ("min", "max")
log = logging.getLogger(__name__)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_dirname"):
        # The part of a run dir that comes from the command line's overrides; 'default' when there are none.
        OmegaConf.register_new_resolver("run_dirname", run_dirname)
    from callbacks.hydra_summary import register_resolvers as register_sweep_resolvers

    register_sweep_resolvers()  # sweep dir and W&B group


def compose(experiment: str | None, overrides=(), output_dir: str | Path | None = None) -> DictConfig:
    """The config ``python run.py experiment=<experiment> <overrides>`` would run, with HydraConfig set (what
    run.py's ``@hydra.main`` does), for in-process runs: benchmarks and tests. ``experiment=None`` leaves the
    experiment to ``overrides``; ``output_dir`` replaces the run's output folder."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    register_resolvers()
    GlobalHydra.instance().clear()
    head = [f"experiment={experiment}"] if experiment else []
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent / "conf"), version_base="1.3"):
        cfg = hydra_compose("run", overrides=[*head, *overrides], return_hydra_config=True)
    if output_dir is not None:
        with open_dict(cfg):
            cfg.paths.output_dir = cfg.hydra.runtime.output_dir = str(output_dir)
    HydraConfig().set_config(cfg)
    return cfg


def run_experiment(experiment: str, tmp_path, overrides: list[str] = ("debug=smoke",), logger: str = "csv"):
    """Run one experiment in-process, as ``python run.py experiment=<experiment> <overrides>`` would, writing into
    ``tmp_path``; returns (optimized metric, metrics.json contents). Tests and benchmarks use it."""
    cfg = compose(experiment, [*overrides, f"logger={logger}", "callbacks.progress_bar=null"], output_dir=tmp_path)
    value = run(cfg)
    metrics = json.loads((Path(tmp_path) / "metrics.json").read_text())
    return value, metrics


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
        raise ConfigError(f"task={cfg.get('task')!r} is not a task — choose one of {', '.join(TASKS)}")
    if cfg.get("optimized_mode") not in MODES:
        raise ConfigError(f"optimized_mode={cfg.get('optimized_mode')!r} is not a mode — choose min (lower is better) or max")
    seed = cfg.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ConfigError(f"seed={seed!r} is not an integer — pass one, e.g. seed=1")
    _check_in_memory_tokens(cfg)
    tr = cfg.trainer
    _check_nodes(tr)
    if str(tr.get("accelerator")) in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.accelerator=gpu but this machine has no CUDA GPU — use trainer=cpu")
    target = _strategy_target(cfg)
    world = _world_size(tr)
    if "ModelParallelStrategy" in target and world == 1:
        raise ConfigError("trainer=fsdp with trainer.devices=1 shards nothing — use trainer=cpu/gpu, or set trainer.devices>=2")
    strategy = tr.get("strategy")
    if "ModelParallelStrategy" in target and isinstance(strategy, DictConfig) and (strategy.get("tensor_parallel_size") or 1) > 1:
        raise ConfigError("trainer=fsdp with tensor_parallel_size>1: paperlab modules shard with FSDP2 over data "
                          "parallelism only — set trainer.strategy.tensor_parallel_size=1")
    if "deepspeed" in target.lower() and tr.get("accelerator") == "cpu" and not cfg.get("allow_deepspeed_cpu", False):
        raise ConfigError("DeepSpeed needs GPUs (trainer.accelerator=gpu) — on CPU use trainer=ddp or trainer=fsdp")
    # one clear line for a missing local path, a tiny model not built yet, or a hub id that HF_HUB_OFFLINE=1 cannot
    # read from the hub cache (an unreachable hub is only known by asking: the loaders report it)
    checked = set()
    for key in ("backbone.pretrained", "data.tokenizer.pretrained"):
        if isinstance(pretrained := OmegaConf.select(cfg, key, default=None), str) and pretrained not in checked:
            from datamodules.common.tiny_models import resolve_pretrained

            checked.add(pretrained)
            revision = OmegaConf.select(cfg, "backbone.revision", default=None) if key.startswith("backbone") else None
            resolve_pretrained(pretrained, key, revision)
    ckpt = cfg.get("ckpt_path")
    if ckpt and ckpt not in ("last", "best") and not Path(ckpt).exists():
        raise ConfigError(f"ckpt_path={ckpt!r} does not exist — pass an existing .ckpt, or ckpt_path=last to resume this run dir")
    _check_numbers(cfg, "")


# Set where a multi-node launcher started this process (SLURM, torchrun / torchelastic, LSF, MPI, or a hand-set
# NODE_RANK for Lightning's own environment); without one, every node is node 0 and waits for peers forever.
MULTI_NODE_ENV = ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "NODE_RANK", "LSB_JOBID", "OMPI_COMM_WORLD_SIZE",
                  "PMI_SIZE")


def _check_nodes(tr: DictConfig) -> None:
    import os

    nodes = tr.get("num_nodes") or 1
    if isinstance(nodes, int) and nodes > 1 and not any(os.environ.get(v) for v in MULTI_NODE_ENV):
        raise ConfigError(f"trainer.num_nodes={nodes} needs {nodes} nodes: launch with launcher=slurm, or set "
                          "trainer.num_nodes=1")


def _world_size(tr: DictConfig) -> int:
    """trainer.devices x trainer.num_nodes, or -1 where Lightning decides it (devices=auto / -1)."""
    devices = tr.get("devices", 1)
    n_dev = devices if isinstance(devices, int) else (len(devices) if not isinstance(devices, str) else -1)
    return n_dev * int(tr.get("num_nodes", 1) or 1) if n_dev > 0 else -1


def _check_in_memory_tokens(cfg: DictConfig) -> None:
    """Pretraining-scale runs stream memory-mapped shards: in-memory text data (``data=corpus``, ``long_docs``)
    tokenizes every document into each rank's memory, so a run whose training tokens (max_steps x global batch x
    seq_len, a proxy for the corpus it needs) pass ``max_in_memory_tokens`` is refused before anything is built."""
    data, limit, tr = cfg.get("data"), cfg.get("max_in_memory_tokens"), cfg.trainer
    if limit is None or "fit" not in str(cfg.get("task")) or not isinstance(data, DictConfig) or "_target_" not in data:
        return
    steps, seq_len, batch_size = tr.get("max_steps"), data.get("seq_len"), data.get("batch_size")
    accumulate = tr.get("accumulate_grad_batches") or 1
    if not all(isinstance(v, int) for v in (steps, seq_len, batch_size, accumulate)) or steps <= 0:
        return  # epoch-bounded (the corpus decides, which the config cannot know), or a word _check_numbers names
    try:
        limit = float(limit)
    except ValueError:
        raise ConfigError(f"max_in_memory_tokens={limit!r} is not a number — pass a number of tokens (e.g. 1e9), "
                          "or null for no limit") from None
    # an unknown world size (devices=auto) counts as one rank: a lower bound
    batch = batch_size * max(_world_size(tr), 1) * accumulate
    tokens = steps * batch * seq_len
    if tokens <= limit:
        return  # (before importing the data modules: a config check stays cheap)
    from hydra.utils import get_object

    from datamodules.shards import ShardDataModule
    from datamodules.text import TextDataModule

    try:
        cls = get_object(data._target_)
    except Exception:  # noqa: BLE001 - a target that does not import fails at instantiation with its own message
        return
    if not (isinstance(cls, type) and issubclass(cls, TextDataModule)) or issubclass(cls, ShardDataModule):
        return
    raise ConfigError(
        f"{data._target_.rsplit('.', 1)[-1]} holds all documents in memory on every rank, but this run trains on "
        f"{tokens:.3g} tokens (max_steps {steps} x global batch {batch} x seq_len {seq_len}) > "
        f"max_in_memory_tokens={limit:.3g} — use data=shards (build once: python -m datamodules.common.shards "
        f"--files '<glob>' --tokenizer <dir> --out <dir>; data.shard_dir=<dir>) or raise max_in_memory_tokens")


def _numeric_params(target: str) -> dict:
    """The parameters of a ``_target_`` that take a number, with their defaults (read from its signature)."""
    from hydra.utils import get_object

    try:
        params = inspect.signature(get_object(target)).parameters
    except Exception:  # noqa: BLE001 - a target that does not import fails later with its own message
        return {}
    return {name: p.default for name, p in params.items()
            if type(p.default) in (int, float) or p.annotation in (int, float, "int", "float")}


def _check_numbers(node, where: str) -> None:
    """A word where a target takes a number (``model.optimizer.lr=abc``) is a one-line error, not a TypeError later.

    Walks the config's own nodes (interpolations left unresolved, except the values checked)."""
    from omegaconf import ListConfig

    if isinstance(node, ListConfig):
        for i in range(len(node)):
            _check_numbers(node._get_node(i), f"{where}[{i}]")
        return
    if not isinstance(node, DictConfig) or node._is_none() or node._is_missing() or node._is_interpolation():
        return
    target = node._get_node("_target_") if "_target_" in node else None
    numeric = _numeric_params(target._value()) if target is not None and isinstance(target._value(), str) else {}
    for key in node.keys():
        if not where and key == "hydra":
            continue
        path = f"{where}.{key}" if where else str(key)
        if key in numeric and isinstance(value := node[key], str):
            try:
                float(value)
            except ValueError:
                example = numeric[key] if type(numeric[key]) in (int, float) else 1
                raise ConfigError(f"{path}={value!r} is not a number ({target._value()} takes a number for "
                                  f"{key}) — pass one, e.g. {path}={example}") from None
        _check_numbers(node._get_node(key), path)


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


def _number(v) -> float | None:
    """A logged scalar as a float; None for tensors with several values."""
    if hasattr(v, "numel"):
        if v.numel() != 1:
            return None
        v = v.detach().float().item()
    return float(v) if isinstance(v, (int, float)) else None


def _plain(v):
    """JSON for what module.results may hold beyond plain types (a 0-dim tensor, a numpy number, a path)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


class _State:
    """What a job has built and seen so far, so ``metrics.json`` is complete whether the job ends or fails."""

    def __init__(self, cfg: DictConfig):
        self.t0 = time.time()
        self.metric, self.mode = cfg.get("optimized_metric"), cfg.get("optimized_mode")
        self.trainer = self.module = None
        self.seen: dict[str, float] = {}  # NaN included: what sweepers get back
        self.final: dict[str, float] = {}
        self.best: dict = {"metric": self.metric, "mode": self.mode, "value": None, "step": None}

    def collect(self) -> None:
        """The trainer's current metrics into ``final``; the optimized metric's best (by ``optimized_mode``)."""
        if self.trainer is None:
            return
        for k, v in self.trainer.callback_metrics.items():
            if (x := _number(v)) is not None:
                self.seen[k] = x
        self.final = {k: x for k, x in self.seen.items() if not math.isnan(x)}  # every stage's last value
        x, old = self.final.get(self.metric), self.best["value"]
        if x is not None and (old is None or (x < old if self.mode == "min" else x > old)):
            self.best.update(value=x, step=self.trainer.global_step)

    def callback(self):
        """A Lightning callback that collects after every validation and test (added whatever ``callbacks`` is)."""
        import lightning as L

        state = self

        class _Collect(L.Callback):
            def on_validation_end(self, trainer, pl_module):
                if not trainer.sanity_checking:
                    state.collect()

            def on_test_end(self, trainer, pl_module):
                state.collect()

        return _Collect()

    def write(self, path: Path, status: str) -> None:
        trainer, module = self.trainer, self.module
        if trainer is not None and trainer.global_rank != 0:
            return
        payload = {"status": status, "final": self.final, "best": self.best,
                   "global_step": trainer.global_step if trainer is not None else 0,
                   "epoch": trainer.current_epoch if trainer is not None else 0,
                   "wall_time_s": round(time.time() - self.t0, 2),
                   "parameters": module.parameter_counts() if hasattr(module, "parameter_counts") else {},
                   # papers with extra results (tables, per-task accuracy) put plain dicts in module.results
                   "results": getattr(module, "results", None) or {}}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=2, default=_plain))
        tmp.replace(path)


def run(cfg: DictConfig):
    """Run one job; in a multirun a failed job is recorded (metrics.json, summary) and the others go on.

    A failed job's ``metrics.json`` status is ``failed: <what> — <the fix>`` for an error the user can fix (the line
    ``run.py`` prints after ``error:``), ``failed: <type>: <message>`` for a bug."""
    state = _State(cfg)
    try:
        return _run(cfg, state)
    except BaseException as err:  # noqa: BLE001 - recorded, then re-raised or reported
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            # an interruption, not a failure of the job: Ctrl+C, SIGTERM (Lightning exits on it) or submitit's
            # preemption handler (checkpoint, requeue, exit). The process must end, and a requeued job resumes.
            raise
        user = user_error(err)  # one line naming the fix (run.py prints it), or None for a bug
        try:
            state.collect()
            reason = one_line(user) if user is not None else f"{type(err).__name__}: {err}"
            state.write(Path(cfg.paths.output_dir) / "metrics.json", f"failed: {reason}")
        except Exception:
            pass
        if _is_multirun():
            if user is not None and not full_error_asked():
                print(f"error: {one_line(user)}", file=sys.stderr)
            else:
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


def _log_once() -> None:
    """Lightning's own console handler repeats every line Hydra's job logging (on the root logger) prints."""
    if logging.getLogger().handlers:
        logging.getLogger("lightning").handlers.clear()


def _needs_no_logger(callbacks: list, loggers: list) -> list:
    """Without a logger, drop the callbacks that refuse to run without one (one info line), keep the rest."""
    if loggers:
        return callbacks
    from lightning.pytorch.callbacks import DeviceStatsMonitor, LearningRateMonitor

    dropped = [type(c).__name__ for c in callbacks if isinstance(c, (LearningRateMonitor, DeviceStatsMonitor))]
    if dropped:
        log.info(f"no logger: dropped {', '.join(dropped)} (it needs one)")
    return [c for c in callbacks if type(c).__name__ not in dropped]


def _run(cfg: DictConfig, state: _State):
    if cfg.get("preflight") not in (None, False, "print", "only"):
        raise ConfigError(f"preflight={cfg.preflight!r}: choose print (then run), only (debug=preflight) or null")
    if cfg.get("preflight"):  # before check_config: it runs on the machine without the GPU it sizes
        import os

        from lightning_modules.common.preflight import preflight

        if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":  # once per run
            preflight(cfg)
        if cfg.preflight == "only":
            return None
    if cfg.get("dryrun"):  # debug=dryrun: shrink the sizes before anything is checked or built
        from lightning_modules.common.dryrun import prepare

        prepare(cfg)
    check_config(cfg)
    import lightning as L
    from hydra.utils import instantiate

    _log_once()

    L.seed_everything(cfg.seed, workers=True)
    out_dir = Path(cfg.paths.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    datamodule = instantiate(cfg.data, _convert_="all") if cfg.get("data") and "_target_" in cfg.data else None
    module = state.module = instantiate(cfg.model, _convert_="all")
    callbacks = _instantiate_dict(cfg.get("callbacks"), "callbacks")
    if "deepspeed" in _strategy_target(cfg).lower():  # transformers must know about ZeRO-3 while the backbone is built
        from callbacks.deepspeed_hf import HFZero3Init

        callbacks.append(HFZero3Init())
    loggers = _instantiate_dict(cfg.get("logger"), "logger")
    callbacks = _needs_no_logger(callbacks, loggers) + [state.callback()]
    trainer = state.trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers or False, _convert_="all")
    if loggers:
        from lightning_modules.common.dashboard import run_config

        for lg in loggers:
            lg.log_hyperparams(run_config(cfg))  # resolved, without secrets

    task = cfg.task
    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path == "last" and not any(out_dir.glob("checkpoints/last*.ckpt")):
        print(f"ckpt_path=last: no checkpoint in {out_dir / 'checkpoints'} yet, starting from scratch")
        ckpt_path = None
    collect = state.collect
    if task in ("fit", "fit_test"):
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        collect()
    if task == "validate":
        trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt_path)
        collect()
    if task in ("test", "fit_test"):
        if task == "fit_test":
            best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
            trainer.test(module, datamodule=datamodule, ckpt_path=_loadable(trainer, best) or None)
        else:
            trainer.test(module, datamodule=datamodule, ckpt_path=ckpt_path)
        collect()

    state.write(out_dir / "metrics.json", "ok")
    if trainer.global_rank == 0:
        _print_table(cfg, state.final, out_dir)
    value = state.seen.get(cfg.get("optimized_metric") or "", None)
    return value if value is None or math.isfinite(value) else float("nan")


def _loadable(trainer, ckpt: str) -> str:
    """A checkpoint the test loop can load. DeepSpeed ZeRO-3 saves a directory that its test-time engine cannot
    reload (loading without optimizer states calls ``_restore_from_bit16_weights``, which ZeRO-3's optimizer-less
    wrapper lacks): it is consolidated once into one fp32 file (``<dir>.fp32.ckpt``, rank 0) and loaded as full
    weights. ZeRO-1/2 directories load as they are (Lightning reads full weights from a file only under ZeRO-3)."""
    if not ckpt or not getattr(trainer.strategy, "zero_stage_3", False) or not Path(ckpt).is_dir():
        return ckpt
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    out = str(Path(ckpt).with_name(Path(ckpt).name + ".fp32.ckpt"))
    if trainer.global_rank == 0 and not Path(out).exists():
        convert_zero_checkpoint_to_fp32_state_dict(ckpt, out)
    trainer.strategy.barrier("consolidated checkpoint")
    trainer.strategy.load_full_weights = True
    return out


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
