"""The project's tiny *pretrained* model: ``lm_tiny``'s export, trained once and cached.

Tiny experiments that need a trained model (quantization, KV-cache eviction, probing, RL) say
``backbone.pretrained: tiny-lm``; this resolves it to a cached transformers dir keyed by the lm_tiny config
files, training it first (a subprocess running ``run.py experiment=lm_tiny``, about 90 s on 2 cores) if missing.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from datamodules.common.cache import cache_root, stable_hash

ROOT = Path(__file__).resolve().parents[2]
# Everything that decides what lm_tiny trains; a change to any of them trains a new model.
_KEY_FILES = ["conf/run.yaml", "conf/experiment/lm_tiny.yaml", "conf/backbone/tiny_llama.yaml", "conf/data/corpus.yaml",
              "conf/model/lm.yaml", "conf/trainer/cpu.yaml", "datamodules/common/corpus.py", "datamodules/common/tokenizer.py"]


def tiny_pretrained_key() -> str:
    return stable_hash(*[(f, (ROOT / f).read_text()) for f in _KEY_FILES])


def tiny_pretrained_dir() -> Path:
    target = cache_root() / "tiny_lm" / tiny_pretrained_key()
    if (target / "config.json").exists():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():  # another process trained it while we waited
            return target
        work = target.with_name(target.name + ".run")
        print(f"[paperlab] training the tiny pretrained model once (cached in {target}) ...", file=sys.stderr)
        env = dict(os.environ, PAPERLAB_ROOT=str(ROOT))
        cmd = [sys.executable, str(ROOT / "run.py"), "experiment=lm_tiny", f"hydra.run.dir={work}",
               f"callbacks.export.dirpath={target}.tmp", "logger=csv"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"training the tiny pretrained model failed (log in {work}):\n{proc.stderr[-3000:]}")
        Path(str(target) + ".tmp").replace(target)
    return target
