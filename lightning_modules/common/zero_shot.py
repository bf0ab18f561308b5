"""Zero-/few-shot suites through EleutherAI's lm-evaluation-harness (the ``lm_eval`` package), on our backbone.

``ZeroShotEvalModule`` is a ``CausalLMModule`` whose test loop is one call of ``lm_eval.simple_evaluate``: the
backbone (as built or loaded from ``backbone.pretrained``, possibly patched by a subclass's ``build_model``) and
its tokenizer are wrapped in lm-eval's ``HFLM``, the tasks are evaluated, and each task's metrics are logged as
``zero_shot/<task>/<metric>`` (accuracy: ``acc``, length-normalised ``acc_norm``; whatever the task defines)
plus ``zero_shot/avg_acc``; the full lm-eval results table goes to ``metrics.json`` under ``results``.
Run it as ``task=test``.

Nothing is downloaded: with ``offline: true`` (default) the Hugging Face hub and datasets libraries are put in
offline mode, so a task's data must already be in the datasets cache (``datasets_cache`` or
``$HF_DATASETS_CACHE``; fill it on a machine with internet with ``lm_eval --tasks <names> --limit 1`` or
``datasets.load_dataset``), or come from local files through a task yaml of your own in ``include_path``
(``dataset_path: json`` with ``dataset_kwargs.data_files``). A task name that neither the harness nor
``include_path`` knows is refused before any evaluation.

Switches: ``tasks``, ``num_fewshot`` (null = each task's default, 0 for the zero-shot suites the papers report),
``fewshot_per_task`` ({task: shots}, overriding ``num_fewshot`` for those tasks, for suites that mix zero-shot tasks
with e.g. 5-shot MMLU: the harness takes one shot count per call, so each shot count is one ``simple_evaluate``
call on the same loaded model and the results are merged), ``limit`` (examples per task; null = all),
``batch_size``, ``max_length`` (null = the model's ``max_position_embeddings``), ``include_defaults`` (the harness's own task registry), ``bootstrap_iters``
(stderr resamples; 0 = none).

lm-eval runs in one process here: use one device (``trainer=gpu``); a 7-8B model in bf16 fits one GPU.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Mapping, Sequence

import torch

from lightning_modules.common.lm import CausalLMModule

_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@contextlib.contextmanager
def hub_offline(offline: bool = True, datasets_cache: str | None = None):
    """Hub and datasets offline (and the datasets cache pointed at ``datasets_cache``) for the duration."""
    saved = {k: os.environ.get(k) for k in (*_OFFLINE_VARS, "HF_DATASETS_CACHE")}
    patched = []
    try:
        if offline:
            for k in _OFFLINE_VARS:
                os.environ[k] = "1"
        if datasets_cache:
            os.environ["HF_DATASETS_CACHE"] = os.path.expanduser(datasets_cache)
        import datasets.config as dcfg  # read at import: patch the module values too

        for name, value in (("HF_HUB_OFFLINE", True if offline else None), ("HF_DATASETS_OFFLINE", True if offline else None),
                            ("HF_DATASETS_CACHE", os.path.expanduser(datasets_cache) if datasets_cache else None)):
            if value is not None and hasattr(dcfg, name):
                patched.append((name, getattr(dcfg, name)))
                setattr(dcfg, name, type(getattr(dcfg, name))(value) if name == "HF_DATASETS_CACHE" else value)
        yield
    finally:
        import datasets.config as dcfg

        for name, old in patched:
            setattr(dcfg, name, old)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def task_metrics(results: Mapping[str, Mapping[str, Any]], tasks: Sequence[str] | None = None) -> dict[str, float]:
    """Flat ``zero_shot/<task>/<metric>`` floats from lm-eval's ``results`` (``'acc,none'`` → ``acc``; stderrs
    and non-numbers left out) and ``zero_shot/avg_acc``, the unweighted mean of the ``acc`` of ``tasks`` (the names
    asked for: a group such as ``mmlu`` counts once, by its aggregate, not once per subtask; None: every row)."""
    out: dict[str, float] = {}
    accs = []
    for task, row in results.items():
        for key, value in row.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if metric in ("sample_len", "samples", "alias", "name"):
                continue
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            out[f"zero_shot/{task}/{name}"] = float(value)
            if name == "acc" and math.isfinite(float(value)) and (tasks is None or task in tasks):
                accs.append(float(value))
    if accs:
        out["zero_shot/avg_acc"] = sum(accs) / len(accs)
    return out


def _plain_results(results: Mapping) -> dict:
    """lm-eval's results table as JSON-able plain data."""
    def plain(v):
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, (int, float, str, bool)) or v is None:
            return v
        return str(v)

    return plain(results)


class ZeroShotEvalModule(CausalLMModule):
    """The backbone evaluated on lm-eval-harness tasks in its test loop (see the module docstring).

    Args:
        backbone: the backbone spec (``pretrained`` set at paper scale).
        tasks: lm-eval task or group names (``[arc_easy, hellaswag, piqa, winogrande, ...]``).
        include_path: a dir (or list) of extra task yamls, e.g. tasks over local jsonl files.
        include_defaults: also index the harness's own tasks (scanning them takes a few seconds).
        num_fewshot, limit, batch_size, max_length, bootstrap_iters: passed to lm-eval.
        fewshot_per_task: {task: shots} for the tasks whose shot count differs from ``num_fewshot``.
        offline: keep hub and datasets offline (tasks come from the local cache / local files).
        datasets_cache: where the cached task datasets are (default ``$HF_DATASETS_CACHE``).
        tokenizer: a tokenizer dir / hub id; default the backbone's ``pretrained``.
    """

    def __init__(self, backbone: Mapping[str, Any], tasks: Sequence[str] = ("arc_easy",), include_path: Any = None,
                 include_defaults: bool = True, num_fewshot: int | None = 0, limit: int | float | None = None,
                 batch_size: int = 8, max_length: int | None = None, bootstrap_iters: int = 0, offline: bool = True,
                 datasets_cache: str | None = None, tokenizer: str | None = None, seed: int = 1234,
                 fewshot_per_task: Mapping[str, int] | None = None, **kw):
        super().__init__(backbone, **kw)
        if isinstance(tasks, str):
            tasks = [t.strip() for t in tasks.split(",") if t.strip()]
        if not tasks:
            raise ValueError("model.tasks is empty: name at least one lm-eval task, e.g. model.tasks=[arc_easy]")
        self.tasks = list(tasks)
        self.fewshot_per_task = {str(k): int(v) for k, v in (fewshot_per_task or {}).items()}
        stray = sorted(set(self.fewshot_per_task) - set(self.tasks))
        if stray:
            raise ValueError(f"model.fewshot_per_task names {stray}, which are not in model.tasks {self.tasks}: "
                             "add them to model.tasks or drop them")
        self.include_path = ([include_path] if isinstance(include_path, str) else list(include_path)) if include_path else None
        self.include_defaults = include_defaults
        self.num_fewshot, self.limit, self.eval_batch_size = num_fewshot, limit, batch_size
        self.max_length, self.bootstrap_iters, self.offline = max_length, bootstrap_iters, offline
        self.datasets_cache, self.tokenizer_name, self.seed = datasets_cache, tokenizer, seed
        self.results: dict = {}
        self.lm_eval_output: dict | None = None

    # --- pieces (each usable on its own) ---------------------------------------------------------
    def load_tokenizer(self):
        from datamodules.common.tokenizer import load_tokenizer

        name = self.tokenizer_name or self.backbone_spec.get("pretrained")
        if not name:
            raise ValueError("zero-shot evaluation needs a tokenizer: set backbone.pretrained (or model.tokenizer)")
        return load_tokenizer(pretrained=name)

    def task_manager(self):
        from lm_eval.tasks import TaskManager

        if self.include_path:
            for p in self.include_path:
                if not os.path.isdir(os.path.expanduser(p)):
                    raise FileNotFoundError(f"model.include_path={p!r} is not a directory of lm-eval task yamls")
        manager = TaskManager(include_path=[os.path.expanduser(p) for p in self.include_path] if self.include_path else None,
                              include_defaults=self.include_defaults)
        unknown = [t for t in self.tasks if t not in manager.all_tasks]
        if unknown:
            where = "the harness's registry" + (f" or {self.include_path}" if self.include_path else "")
            raise ValueError(f"model.tasks: {unknown} are not in {where}; check the names (lm_eval --tasks list) "
                             "or add task yamls under model.include_path")
        return manager

    def harness_model(self, tokenizer):
        from lm_eval.models.huggingface import HFLM

        max_length = self.max_length or getattr(self.model.config, "max_position_embeddings", None) or 2048
        return HFLM(pretrained=self.model, tokenizer=tokenizer, batch_size=self.eval_batch_size,
                    device=str(self.device), max_length=int(max_length))

    def fewshot_plan(self) -> list[tuple[int | None, list[str]]]:
        """(shots, tasks) per harness call: the tasks grouped by their shot count, in the order of ``tasks``."""
        plan: dict[int | None, list[str]] = {}
        for task in self.tasks:
            plan.setdefault(self.fewshot_per_task.get(task, self.num_fewshot), []).append(task)
        return list(plan.items())

    def evaluate(self) -> dict[str, float]:
        """Run the suite now; returns the flat metrics and keeps lm-eval's output in ``lm_eval_output``."""
        import lm_eval

        if self.model is None:
            self.configure_model()
        was_training = self.model.training
        self.model.eval()
        with hub_offline(self.offline, self.datasets_cache):
            manager = self.task_manager()
            tokenizer = self.load_tokenizer()
            harness = self.harness_model(tokenizer)
            try:
                out: dict = {}
                for shots, tasks in self.fewshot_plan():
                    part = lm_eval.simple_evaluate(
                        model=harness, tasks=tasks, task_manager=manager,
                        num_fewshot=shots, limit=self.limit, bootstrap_iters=self.bootstrap_iters,
                        log_samples=True, random_seed=self.seed, numpy_random_seed=self.seed,
                        torch_random_seed=self.seed, fewshot_random_seed=self.seed)
                    for key, value in part.items():  # per-task tables merge; run-level entries keep the first call's
                        if isinstance(value, dict) and isinstance(out.get(key, {}), dict):
                            out.setdefault(key, {}).update(value)
                        else:
                            out.setdefault(key, value)
            except (ConnectionError, OSError) as err:
                if not self.offline:
                    raise
                raise FileNotFoundError(
                    f"a task's data is not in the local datasets cache ({err.__class__.__name__}: {err}). Fill the cache "
                    "where there is internet (lm_eval --tasks <names> --limit 1) and copy it here, set "
                    "model.datasets_cache=<dir>, or use task yamls over local files (model.include_path)") from err
        self.model.train(was_training)
        self.lm_eval_output = out
        metrics = task_metrics(out["results"], self.tasks)
        self.results = {"zero_shot": _plain_results(out["results"]),
                        "n_samples": _plain_results(out.get("n-samples", {})),
                        "n_shot": _plain_results(out.get("n-shot", {})),
                        "config": {"tasks": self.tasks, "num_fewshot": self.num_fewshot,
                                   "fewshot_per_task": self.fewshot_per_task, "limit": self.limit}}
        return metrics

    # --- Lightning test loop: one step that runs the whole suite --------------------------------
    def test_dataloader(self):
        return torch.utils.data.DataLoader([0], batch_size=1)

    def on_test_epoch_start(self):
        pass

    def test_step(self, batch, batch_idx):
        metrics = self.evaluate() if self.trainer.is_global_zero else {}
        for k, v in metrics.items():
            self.log(k, v, rank_zero_only=True)

    def on_test_epoch_end(self):
        pass
