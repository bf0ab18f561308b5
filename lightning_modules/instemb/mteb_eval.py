"""Evaluate a trained InstEmb run through mteb (the paper-scale evaluation: FollowIR, generic MTEB tasks), offline.

    python -m lightning_modules.instemb.mteb_eval --checkpoint <run dir> --tasks FollowIR STSBenchmark \
        --output <dir> [--cache-dir <HF_HOME with the datasets>] [--batch-size 32] [--pooling daap] [--device cuda]
    python -m lightning_modules.instemb.mteb_eval --checkpoint <run dir> --tasks InBedder --inbedder-dir <dir> \
        --output <dir> [--prompts <{task: instruction} json>]

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

InBedder's instruction-awareness tests (IntentEmotion, InstructSTSB, NYTClustering; ``--tasks InBedder`` names all
three, or name them one by one) are read from local jsonl files, ``<--inbedder-dir>/<task>.jsonl``, one record a line:

- clustering (IntentEmotion, NYTClustering): ``{"text": ..., "label": ...}``; score: V-measure of k-means with
  k = the number of labels (mteb's clustering evaluator: ``MiniBatchKMeans``, batch 500, ``n_init="auto"``, seed 42);
- STS (InstructSTSB): ``{"sentence1": ..., "sentence2": ..., "score": <number>}``; score: Spearman of the pairs'
  cosine similarity against ``score`` (mteb's ``cosine_spearman``).

These field names are ours: InBedder's own file layout is not in the spec. Convert with e.g.
``jq -c '{text: .sentence, label: .emotion}' in.jsonl > IntentEmotion.jsonl``. Every text of a task is embedded
with the task's one instruction: ``--prompts`` ({task: instruction}) or the default in :data:`INBEDDER` (also ours;
pass the paper's wording through ``--prompts``). With mteb installed the files become mteb task objects
(:func:`inbedder_mteb_task`: legacy clustering over one cluster set, STS) and go through ``mteb.evaluate`` with the
other tasks; without it, :func:`score_inbedder` computes the same two metrics with scikit-learn / scipy, and
``--tasks InBedder`` needs no mteb at all.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from datamodules.common.errors import MissingExtraError

INSTALL = 'mteb is not installed — pip install -c constraints.txt -e ".[instemb]"'
# the paper's task names -> mteb's (FollowIR's three tasks are mteb's InstructionRetrieval tasks)
ALIASES = {
    "FollowIR": ["Robust04InstructionRetrieval", "News21InstructionRetrieval", "Core17InstructionRetrieval"],
    "FollowIR-Robust04": ["Robust04InstructionRetrieval"],
    "FollowIR-News21": ["News21InstructionRetrieval"],
    "FollowIR-Core17": ["Core17InstructionRetrieval"],
}
# InBedder's instruction-awareness tests, from local files: task -> (kind, default instruction; the wording is ours)
INBEDDER = {
    "IntentEmotion": ("clustering", "What emotion does the speaker express?"),
    "InstructSTSB": ("sts", "What is the main subject of the sentence?"),
    "NYTClustering": ("clustering", "What is the topic of this news article?"),
}
FIELDS = {"clustering": ("text", "label"), "sts": ("sentence1", "sentence2", "score")}
METRIC = {"clustering": "v_measure", "sts": "cosine_spearman"}  # mteb's main scores of the two task types
ALIASES["InBedder"] = list(INBEDDER)
KMEANS_SEED = 42  # mteb's Evaluator default seed


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


# --- InBedder's tests from local files --------------------------------------------------------------------------
def load_inbedder(name: str, root: str | Path | None) -> dict[str, list]:
    """``<root>/<name>.jsonl`` -> columns; a bad line is one line naming file:line and what is wrong."""
    kind = INBEDDER[name][0]
    fields = FIELDS[kind]
    if root is None:
        raise ValueError(f"{name} is read from a local file: set --inbedder-dir to the folder holding {name}.jsonl")
    path = Path(root) / f"{name}.jsonl"
    if not path.is_file():
        raise ValueError(f"{name}: no {path}; put the task's jsonl there or set --inbedder-dir to the folder holding "
                         f"{name}.jsonl")
    cols: dict[str, list] = {f: [] for f in fields}
    from datamodules.common.loaders import numbered_jsonl

    record = f"a {kind} record is {{{', '.join(repr(f) for f in fields)}}}"
    for i, rec in numbered_jsonl(path, fields, record):
        if kind == "sts" and not isinstance(rec["score"], (int, float)):
            raise ValueError(f"{path}:{i}: 'score' is {rec['score']!r}, not a number")
        for f in fields:
            cols[f].append(rec[f])
    if kind == "clustering" and len(set(map(str, cols["label"]))) < 2:
        raise ValueError(f"{path}: fewer than 2 distinct labels; V-measure needs at least 2")
    if kind == "sts" and len(set(cols["score"])) < 2:
        raise ValueError(f"{path}: all scores are equal (or none); Spearman is undefined")
    return cols


def mteb_v_measure(emb: np.ndarray, labels: Sequence, seed: int = KMEANS_SEED) -> float:
    """V-measure of k-means as mteb's clustering evaluator fits it (MiniBatchKMeans, k = the number of labels)."""
    from sklearn.cluster import MiniBatchKMeans
    from sklearn.metrics import v_measure_score

    labels = [str(x) for x in labels]
    km = MiniBatchKMeans(n_clusters=len(set(labels)), batch_size=500, n_init="auto", random_state=seed).fit(emb)
    return float(v_measure_score(labels, km.labels_))


def score_inbedder(encoder: MtebEncoder, name: str, data: Mapping[str, list], instruction: str,
                   batch_size: int = 32) -> float:
    """mteb's main score of a local InBedder task, without mteb: V-measure (clustering) or cosine Spearman (STS)."""
    from lightning_modules.common.embedding import spearman

    meta = SimpleNamespace(name=name, prompt=instruction)
    enc = lambda texts: encoder.encode(list(texts), task_metadata=meta, batch_size=batch_size)  # noqa: E731
    if INBEDDER[name][0] == "clustering":
        return mteb_v_measure(enc(data["text"]), data["label"])
    cos = MtebEncoder.similarity_pairwise(enc(data["sentence1"]), enc(data["sentence2"]))
    return spearman(cos.tolist(), data["score"])


def inbedder_mteb_task(name: str, data: Mapping[str, list], instruction: str):
    """A local InBedder task as an mteb task object (legacy clustering: one cluster set; STS), data already loaded."""
    from datasets import Dataset, DatasetDict
    from mteb.abstasks.clustering_legacy import AbsTaskClusteringLegacy
    from mteb.abstasks.sts import AbsTaskSTS
    from mteb.abstasks.task_metadata import TaskMetadata

    clustering = INBEDDER[name][0] == "clustering"
    meta = TaskMetadata(
        name=name, description=f"InBedder's {name}, from a local jsonl file", reference=None,
        dataset={"path": "local", "revision": "local"}, type="Clustering" if clustering else "STS",
        category="t2c" if clustering else "t2t", modalities=["text"], eval_splits=["test"], eval_langs=["eng-Latn"],
        main_score=METRIC[INBEDDER[name][0]], prompt=instruction, date=None, domains=None,
        task_subtypes=None, license=None, annotations_creators=None, dialect=None, sample_creation=None,
        bibtex_citation=None)
    if clustering:
        attrs, rows = {}, {"sentences": [list(data["text"])], "labels": [[str(x) for x in data["label"]]]}
        base = AbsTaskClusteringLegacy
    else:  # Spearman ignores mteb's (score - min) / (max - min)
        attrs = {"min_score": min(data["score"]), "max_score": max(data["score"])}
        rows, base = {k: list(v) for k, v in data.items()}, AbsTaskSTS
    task = type(name, (base,), {"metadata": meta, **attrs})()
    task.dataset = {"default": DatasetDict({"test": Dataset.from_dict(rows)})}
    task.data_loaded = True
    return task


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
        raise MissingExtraError(INSTALL) from err
    return mteb


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, help="an instemb run dir (or a .ckpt inside one)")
    p.add_argument("--tasks", nargs="+", required=True,
                   help=f"mteb task names, {', '.join(ALIASES)} or the local {', '.join(INBEDDER)}")
    p.add_argument("--output", required=True, help="where the per-task results and summary.json go")
    p.add_argument("--cache-dir", help="HF_HOME holding the tasks' datasets (default: the current HF_HOME)")
    p.add_argument("--inbedder-dir", help=f"the folder of <task>.jsonl for {', '.join(INBEDDER)}")
    p.add_argument("--online", action="store_true", help="let datasets download (default: offline)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--pooling", help="override the run's model.pooling (daap | last | lookahead | mean)")
    p.add_argument("--prompts", help="a JSON file {task name: instruction} for tasks without per-query instructions")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main(argv=None) -> dict[str, float]:
    args = parse(argv)
    local = set(INBEDDER) | {"InBedder"}
    try:
        # before datasets / huggingface_hub are imported: they read these at import
        if args.cache_dir:
            os.environ["HF_HOME"] = str(Path(args.cache_dir).resolve())
        if not args.online:
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if any(n not in local for n in args.tasks):  # mteb's own tasks need mteb; the local ones do not
            mteb = require_mteb()
            available = [t.metadata.name for t in mteb.get_tasks()]
        else:
            try:
                import mteb
            except ImportError:
                mteb = None
            available = []
        names = resolve_tasks(args.tasks, available + list(INBEDDER))
        prompts = json.loads(Path(args.prompts).read_text()) if args.prompts else {}
        inbedder = {n: load_inbedder(n, args.inbedder_dir) for n in names if n in INBEDDER}
        run_paths(args.checkpoint)
    except (ValueError, ImportError, OSError) as err:
        sys.exit(f"mteb_eval: {err}")
    instruction = {n: prompts.get(n, INBEDDER[n][1]) for n in inbedder}
    tasks = list(mteb.get_tasks(tasks=[n for n in names if n not in inbedder])) if len(inbedder) < len(names) else []
    for task in tasks:  # the data before the (large) model: offline, a dataset missing from the cache stops here
        try:
            task.load_data()
        except ConnectionError as err:
            sys.exit(f"mteb_eval: {task.metadata.name}: {task.metadata.dataset['path']} is not in the local datasets "
                     f"cache ({err}); download it once online (--online, same --cache-dir) or pass the --cache-dir "
                     "that holds it")
    if mteb is not None:
        tasks += [inbedder_mteb_task(n, d, instruction[n]) for n, d in inbedder.items()]
    module = load_module(args.checkpoint, args.device, args.pooling)
    encoder = MtebEncoder(module, prompts, name=f"paperlab/{Path(args.checkpoint).resolve().name}")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    if tasks:
        result = mteb.evaluate(encoder, tasks, cache=None, overwrite_strategy="always",
                               encode_kwargs={"batch_size": args.batch_size})
        for tr in result.task_results:
            tr.to_disk(out / f"{tr.task_name}.json")
            summary[tr.task_name] = float(tr.get_score())
    if mteb is None:  # no mteb: the local tasks scored here, with mteb's metrics
        for n, d in inbedder.items():
            summary[n] = score_inbedder(encoder, n, d, instruction[n], args.batch_size)
            kind = INBEDDER[n][0]
            record = {"task_name": n, "main_score": summary[n], "metric": METRIC[kind], "instruction": instruction[n],
                      "n": len(d[FIELDS[kind][0]])}
            (out / f"{n}.json").write_text(json.dumps(record, indent=2))
    (out / "summary.json").write_text(json.dumps({"checkpoint": str(args.checkpoint), "main_score": summary}, indent=2))
    for k, v in summary.items():
        print(f"{k}: {v:.4f}")
    return summary


if __name__ == "__main__":
    main()
