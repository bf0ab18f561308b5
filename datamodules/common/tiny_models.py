"""Cached tiny pretrained models: each trained once by an experiment, keyed on everything that trains it.

Tiny experiments that need a trained model say ``backbone.pretrained: tiny-lm``. A registry entry names the
experiment whose export *is* the model and the files that decide its weights; the cache key hashes those config
files, the project code they run (the import closure of the entry's code roots, found with ``ast``), the embedded
corpus and the library versions, so any change to them means a new model. Building is an explicit step:

    python -m datamodules.common.tiny_models build tiny-lm      # or `python run.py`: lm_tiny's export is tiny-lm

(the test suite builds each entry the first time a test needs it: ``PAPERLAB_BUILD_TINY_MODELS=1``). This is the lowest layer: both the
tokenizer and the backbone resolve ``pretrained`` here. Later papers register their own (``tiny-mdlm``, ...).
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from datamodules.common.cache import cache_root, stable_hash
from datamodules.common.errors import PretrainedNotFoundError, check_hub_cache  # noqa: F401 (imported from here too)

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ("torch", "transformers", "lightning", "tokenizers")
# Overrides that change where a run writes or what it prints, never the weights: such a run still publishes.
# Set (to 1) by the test suite: a tiny model missing from the cache is built when first resolved, not refused.
BUILD_ON_DEMAND = "PAPERLAB_BUILD_TINY_MODELS"
_NEUTRAL = ("experiment", "paths.log_dir", "logger", "launcher", "callbacks.progress_bar", "callbacks.export.dirpath")


@dataclass(frozen=True)
class TinyModel:
    name: str
    experiment: str           # conf/experiment/<experiment>.yaml trains it; its export is the cached model
    configs: tuple[str, ...]  # the config files its composed config comes from
    code: tuple[str, ...]     # code roots beside the configs' `_target_`s; they and all they import decide the weights


TINY_MODELS: dict[str, TinyModel] = {}


def register(model: TinyModel) -> TinyModel:
    TINY_MODELS[model.name] = model
    return model


register(TinyModel(
    "tiny-lm", "lm_tiny",
    configs=("conf/run.yaml", "conf/experiment/lm_tiny.yaml", "conf/backbone/tiny_llama.yaml", "conf/data/corpus.yaml",
             "conf/model/lm.yaml", "conf/trainer/cpu.yaml", "conf/callbacks/default.yaml"),
    code=("run.py", "runner.py"),  # plus every `_target_` in the configs (lm.py, text.py, tokenizer, export, ...)
))
register(TinyModel(
    "tiny-mdlm", "mdlm_tiny",
    configs=("conf/run.yaml", "conf/experiment/mdlm_tiny.yaml", "conf/backbone/tiny_mdlm.yaml",
             "conf/data/rule_induction.yaml", "conf/model/mdlm.yaml", "conf/trainer/cpu.yaml",
             "conf/callbacks/default.yaml"),
    code=("run.py", "runner.py"),
))

register(TinyModel(
    "tiny-moe", "growth_source_tiny",  # the growth paper's source MoE (tiny Mixtral), grown by growth_tiny
    configs=("conf/run.yaml", "conf/experiment/growth_source_tiny.yaml", "conf/backbone/tiny_mixtral.yaml",
             "conf/data/corpus.yaml", "conf/model/lm.yaml", "conf/trainer/cpu.yaml", "conf/callbacks/default.yaml"),
    code=("run.py", "runner.py"),
))


def _module_files(name: str, root: Path) -> list[str]:
    """The project files importing ``name`` runs: its parents' ``__init__``s and the module (none if not ours)."""
    parts, out = name.split("."), []
    for i in range(1, len(parts) + 1):
        base = root.joinpath(*parts[:i])
        out += [str(p.relative_to(root)) for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()]
    return out


def project_imports(files, root: Path = ROOT) -> list[str]:
    """``files`` and every project module they import, transitively (read with ``ast``; nothing is executed)."""
    seen, todo = set(), list(files)
    while todo:
        rel = todo.pop()
        if rel in seen or not (root / rel).is_file():
            continue
        seen.add(rel)
        for node in ast.walk(ast.parse((root / rel).read_text(), filename=rel)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                todo += _module_files(name, root)
    return sorted(seen)


def code_files(name: str, root: Path = ROOT) -> list[str]:
    """The code a tiny model's experiment runs: its code roots, the ``_target_``s of its configs, their imports."""
    entry = _entry(name)
    targets = [t for f in entry.configs for t in re.findall(r"_target_:\s*([\w.]+)", (root / f).read_text())]
    return project_imports([*entry.code, *(f for t in targets for f in _module_files(t, root))], root)


def key(name: str, root: Path = ROOT) -> str:
    """The cache key of a tiny model: its config files, its code's import closure, the corpus, library versions."""
    from datamodules.common.corpus import corpus_key

    entry = _entry(name)
    files = [*entry.configs, *code_files(name, root)]
    return stable_hash(entry.experiment, [(f, (root / f).read_text()) for f in files], corpus_key(),
                       {lib: version(lib) for lib in LIBRARIES})


def model_dir(name: str) -> Path:
    """Where the tiny model of this checkout lives (built or not)."""
    return cache_root() / "tiny_models" / name / key(name)


def is_tiny_model(pretrained) -> bool:
    return isinstance(pretrained, str) and pretrained in TINY_MODELS


def resolve_pretrained(pretrained: str, key: str = "backbone.pretrained", revision: str | None = None) -> str:
    """A loadable location for ``pretrained`` (the value of ``key``): a built tiny model, a local dir, or a hub id.

    Raises one clear line when a tiny model is not built yet, a local path is missing, or ``HF_HUB_OFFLINE=1`` is
    set and a hub id is not in the hub cache."""
    if is_tiny_model(pretrained):
        target = model_dir(pretrained)
        if not (target / "config.json").exists() and os.environ.get(BUILD_ON_DEMAND) == "1":
            build(pretrained)  # the test suite builds a tiny model the first time a test needs it
        if not (target / "config.json").exists():
            raise PretrainedNotFoundError(
                f"{key}={pretrained!r} is not built for this checkout — run "
                f"`python -m datamodules.common.tiny_models build {pretrained}` once (~90 s)")
        return str(target)
    expanded = os.path.expanduser(pretrained)
    if pretrained.startswith(("/", "./", "../", "~")) and not Path(expanded).exists():
        raise PretrainedNotFoundError(
            f"{key}={pretrained!r} does not exist — put the checkpoint there, or pass "
            f"{key}=<dir with config.json and weights> (a hub id works where the hub is reachable)")
    check_hub_cache(pretrained, key, revision)
    return expanded


def publish(name: str, export_dir: Path, experiment: str, overrides: list[str]) -> Path | None:
    """Copy a finished export into the cache when the run was the entry's experiment as configured."""
    entry = _entry(name)
    changed = [o for o in overrides if not o.lstrip("+~").split("=")[0].startswith(("hydra.", *_NEUTRAL))]
    if experiment != entry.experiment or changed:
        print(f"[paperlab] not caching this export as {name}: it is not `{entry.experiment}` as configured "
              f"(overrides {changed})", file=sys.stderr)
        return None
    target = model_dir(name)
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.copytree(export_dir, tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process published the same model first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build(name: str) -> Path:
    """Train a tiny model (a subprocess running its experiment) unless this checkout's is cached; its dir."""
    from filelock import FileLock

    target = model_dir(name)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():  # another process built it while we waited
            return target
        work = target.with_name(target.name + ".run")
        print(f"[paperlab] building {name} once (cached in {target}) ...", file=sys.stderr)
        cmd = [sys.executable, str(ROOT / "run.py"), f"experiment={_entry(name).experiment}", f"hydra.run.dir={work}"]
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PAPERLAB_ROOT=str(ROOT)), capture_output=True, text=True)
        if proc.returncode != 0 or not (target / "config.json").exists():
            raise RuntimeError(f"building {name} failed (log in {work}):\n{proc.stderr[-3000:]}")
    return target


def _entry(name: str) -> TinyModel:
    if name not in TINY_MODELS:
        raise ValueError(f"no tiny model {name!r}: choose one of {', '.join(TINY_MODELS)}")
    return TINY_MODELS[name]


def main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m datamodules.common.tiny_models",
                                description="Build, key or list the cached tiny pretrained models.")
    p.add_argument("command", choices=("build", "key", "list"))
    p.add_argument("names", nargs="*", help=f"tiny models (default: all of {', '.join(TINY_MODELS)})")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in TINY_MODELS]
    if unknown:
        p.error(f"no tiny model {', '.join(unknown)}: choose from {', '.join(TINY_MODELS)}")
    for name in args.names or list(TINY_MODELS):
        if args.command == "build":
            print(build(name))
        elif args.command == "key":
            print(name, key(name))
        else:
            print(name, _entry(name).experiment, model_dir(name))


if __name__ == "__main__":
    main(sys.argv[1:])
