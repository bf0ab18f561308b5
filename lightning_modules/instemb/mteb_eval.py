"""Evaluate a trained InstEmb run through mteb (the paper-scale evaluation: FollowIR, generic MTEB tasks), offline.

    python -m lightning_modules.instemb.mteb_eval --checkpoint <run dir> --tasks FollowIR STSBenchmark \
        --output <dir> [--cache-dir <HF_HOME with the datasets>] [--batch-size 32] [--pooling daap] [--device cuda]

- :class:`MtebEncoder` gives ``InstEmbModule.encode`` mteb 2.x's ``EncoderProtocol`` (read from mteb 2.26's
  ``mteb/models/models_protocols.py``): ``encode(inputs, *, task_metadata, hf_split, hf_subset, prompt_type=None,
  **kwargs) -> (N, d)`` float32 numpy, where ``inputs`` is a DataLoader of batches ``{"text": [...], ...}``; a plain
  list of strings (mteb 1.x's ``encode(sentences, batch_size=...)``) is accepted too. Instructions: mteb joins a
  FollowIR query with its instruction into ``text`` and keeps the parts as ``query`` / ``instruction``; InstEmb
  needs them apart (``### Input`` / ``### Instruction``), so rows that carry an ``instruction`` use it with their
  ``query``; other rows get the task's instruction (``prompts[task name]``, else the task metadata's ``prompt``,
  per query / document when it is a dict, else the task type's generic one, e.g. "Retrieve text based on user
  query.", as mteb's ``AbsEncoder.get_instruction`` picks).
- :func:`load_module` rebuilds the run's ``InstEmbModule`` from ``.hydra/config.yaml`` and loads
  ``checkpoints/last.ckpt`` (``weights_only=True``; a DeepSpeed checkpoint directory is first merged into one fp32
  state dict). The warm-up is not rebuilt: the checkpoint holds every weight.
- mteb is the ``instemb`` extra, not a test dependency: it is imported only when used (:func:`main`, the model's
  mteb metadata, the generic-instruction fallback).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

INSTALL = 'mteb is not installed: pip install -c constraints.txt -e ".[instemb]"'
# the paper's task names -> mteb's (FollowIR's three tasks are mteb's InstructionRetrieval tasks)
ALIASES = {
    "FollowIR": ["Robust04InstructionRetrieval", "News21InstructionRetrieval", "Core17InstructionRetrieval"],
    "FollowIR-Robust04": ["Robust04InstructionRetrieval"],
    "FollowIR-News21": ["News21InstructionRetrieval"],
    "FollowIR-Core17": ["Core17InstructionRetrieval"],
}


class MtebEncoder:
    """mteb's encoder interface over a trained ``InstEmbModule`` (cosine similarity, as DAAP is L2-normalised)."""

    def __init__(self, module, prompts: Mapping[str, str] | None = None, pooling: str | None = None,
                 name: str = "paperlab/instemb", revision: str = "local"):
        self.module, self.prompts, self.pooling = module, dict(prompts or {}), pooling
        self.name, self.revision = name, revision

    @property
    def mteb_model_meta(self):
        from mteb.models.model_meta import ModelMeta, ScoringFunction

        return ModelMeta.create_empty({"name": self.name, "revision": self.revision, "use_instructions": True,
                                       "similarity_fn_name": ScoringFunction.COSINE})

    def task_instruction(self, task_metadata, prompt_type) -> str:
        if task_metadata is None:
            return ""
        if task_metadata.name in self.prompts:
            return self.prompts[task_metadata.name]
        prompt = getattr(task_metadata, "prompt", None)
        if isinstance(prompt, dict):  # per prompt type; none for a type it lacks (as mteb's AbsEncoder)
            return prompt.get(getattr(prompt_type, "value", prompt_type), "") if prompt_type is not None else ""
        if prompt:
            return prompt
        try:  # else the task type's generic instruction, as mteb's instruction models get
            from mteb.abstasks.abstask import get_abstask_prompt
        except ImportError:
            return ""
        return get_abstask_prompt(task_metadata.name)

    def encode(self, inputs: Iterable[Mapping[str, Any]] | Sequence[str], *, task_metadata=None, hf_split=None,
               hf_subset=None, prompt_type=None, batch_size: int = 32, **kwargs) -> np.ndarray:
        default = None  # the task's instruction, looked up once, when a row has none of its own

        def task_default() -> str:
            nonlocal default
            if default is None:
                default = self.task_instruction(task_metadata, prompt_type)
            return default

        if isinstance(inputs, (list, tuple)) and all(isinstance(t, str) for t in inputs):
            inputs = [{"text": list(inputs[i:i + batch_size])} for i in range(0, len(inputs), batch_size)]
        out = []
        for batch in inputs:
            if batch.get("instruction") is not None and batch.get("query") is not None:
                texts = list(batch["query"])
                instructions = [q if q is not None else task_default() for q in batch["instruction"]]
            else:
                texts, instructions = list(batch["text"]), [task_default()] * len(batch["text"])
            out.append(self.module.encode(texts, instructions, pooling=self.pooling))
        if not out:
            return np.zeros((0, self.module.model.config.hidden_size), dtype=np.float32)
        return torch.cat(out).float().numpy()

    @staticmethod
    def similarity(a, b) -> torch.Tensor:
        f = torch.nn.functional.normalize
        return f(torch.as_tensor(np.asarray(a), dtype=torch.float32), dim=-1) @ f(
            torch.as_tensor(np.asarray(b), dtype=torch.float32), dim=-1).T

    @staticmethod
    def similarity_pairwise(a, b) -> torch.Tensor:
        return torch.nn.functional.cosine_similarity(torch.as_tensor(np.asarray(a), dtype=torch.float32),
                                                     torch.as_tensor(np.asarray(b), dtype=torch.float32), dim=-1)


# --- loading a run ----------------------------------------------------------------------------------------------
def run_paths(checkpoint: str | Path) -> tuple[Path, Path]:
    """A run dir (its ``checkpoints/last.ckpt``) or a checkpoint inside one -> (run dir, checkpoint)."""
    p = Path(checkpoint)
    run_dir, ckpt = (p.parent.parent, p) if p.suffix == ".ckpt" else (p, p / "checkpoints" / "last.ckpt")
    if not (run_dir / ".hydra" / "config.yaml").is_file():
        raise ValueError(f"--checkpoint {checkpoint}: no {run_dir / '.hydra' / 'config.yaml'}; pass the run dir of "
                         "an instemb experiment (or a .ckpt in its checkpoints/)")
    if not ckpt.exists():
        raise ValueError(f"--checkpoint {checkpoint}: no checkpoint at {ckpt}; pass a run dir with "
                         "checkpoints/last.ckpt or one of its .ckpt files")
    return run_dir, ckpt


def load_state(ckpt: Path) -> dict[str, torch.Tensor]:
    if ckpt.is_dir():  # DeepSpeed: merge the per-rank files into one fp32 state dict
        import tempfile

        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        with tempfile.TemporaryDirectory() as tmp:
            convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), f"{tmp}/fp32.ckpt")
            # the merged file also pickles DeepSpeed's client state: it is this run's own file
            return torch.load(f"{tmp}/fp32.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    return state.get("state_dict", state)


def load_module(checkpoint: str | Path, device: str = "cpu", pooling: str | None = None):
    """The run's ``InstEmbModule`` (as configured, without the warm-up rebuild) with the checkpoint's weights."""
    from omegaconf import OmegaConf

    from lightning_modules.instemb.module import InstEmbModule

    run_dir, ckpt = run_paths(checkpoint)
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    kw = OmegaConf.to_container(cfg.model, resolve=True)
    target = kw.pop("_target_", None)
    if target != f"{InstEmbModule.__module__}.{InstEmbModule.__name__}":
        raise ValueError(f"--checkpoint {checkpoint}: model._target_ is {target}, not InstEmbModule")
    for k in ("optimizer", "scheduler"):
        kw.pop(k, None)
    kw["warmup"] = None  # the checkpoint holds every weight, the warmed-up ones too
    if pooling is not None:
        kw["pooling"] = pooling
    module = InstEmbModule(**kw)
    module.configure_model()
    module.load_state_dict(load_state(ckpt), strict=True)
    return module.to(device).eval()


# --- the CLI ----------------------------------------------------------------------------------------------------
def resolve_tasks(names: Sequence[str], available: Sequence[str]) -> list[str]:
    """Expand the paper's aliases; an unknown name is one line naming what to pass."""
    known, out = set(available), []
    for n in names:
        if n in ALIASES:
            out += ALIASES[n]
        elif n in known:
            out.append(n)
        else:
            near = difflib.get_close_matches(n, list(known) + list(ALIASES), n=5, cutoff=0.5)
            raise ValueError(f"unknown mteb task {n!r}: pass an mteb task name{f' (closest: {near})' if near else ''}"
                             f" or one of {sorted(ALIASES)}; list all with python -c \"import mteb; "
                             "print([t.metadata.name for t in mteb.get_tasks()])\"")
    return list(dict.fromkeys(out))


def require_mteb():
    try:
        import mteb
    except ImportError as err:
        raise ImportError(INSTALL) from err
    return mteb


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="an instemb run dir (or a .ckpt inside one)")
    p.add_argument("--tasks", nargs="+", required=True, help=f"mteb task names or {', '.join(ALIASES)}")
    p.add_argument("--output", required=True, help="where the per-task results and summary.json go")
    p.add_argument("--cache-dir", help="HF_HOME holding the tasks' datasets (default: the current HF_HOME)")
    p.add_argument("--online", action="store_true", help="let datasets download (default: offline)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--pooling", help="override the run's model.pooling (daap | last | lookahead | mean)")
    p.add_argument("--prompts", help="a JSON file {task name: instruction} for tasks without per-query instructions")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main(argv=None) -> dict[str, float]:
    args = parse(argv)
    try:
        # before datasets / huggingface_hub are imported: they read these at import
        if args.cache_dir:
            os.environ["HF_HOME"] = str(Path(args.cache_dir).resolve())
        if not args.online:
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        mteb = require_mteb()
        names = resolve_tasks(args.tasks, [t.metadata.name for t in mteb.get_tasks()])
        run_paths(args.checkpoint)
        prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else None
    except (ValueError, ImportError, OSError) as err:
        sys.exit(f"mteb_eval: {err}")
    tasks = mteb.get_tasks(tasks=names)
    for task in tasks:  # the data before the (large) model: offline, a dataset missing from the cache stops here
        try:
            task.load_data()
        except ConnectionError as err:
            sys.exit(f"mteb_eval: {task.metadata.name}: {task.metadata.dataset['path']} is not in the local datasets "
                     f"cache ({err}); download it once online (--online, same --cache-dir) or pass the --cache-dir "
                     "that holds it")
    module = load_module(args.checkpoint, args.device, args.pooling)
    encoder = MtebEncoder(module, prompts, name=f"paperlab/{Path(args.checkpoint).resolve().name}")
    result = mteb.evaluate(encoder, tasks, cache=None, overwrite_strategy="always",
                           encode_kwargs={"batch_size": args.batch_size})
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for tr in result.task_results:
        tr.to_disk(out / f"{tr.task_name}.json")
        summary[tr.task_name] = float(tr.get_score())
    (out / "summary.json").write_text(json.dumps({"checkpoint": str(args.checkpoint), "main_score": summary}, indent=2))
    for k, v in summary.items():
        print(f"{k}: {v:.4f}")
    return summary


if __name__ == "__main__":
    main()
