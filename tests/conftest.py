"""Shared test setup. Environment first: some of it is read when modules are imported."""
import os
import tempfile

# Triton reads this when @triton.jit runs, so it must be set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A tiny model (tiny-lm, tiny-mdlm, ...) is built the first time a test resolves it, so a test run builds only the
# ones its tests need (datamodules/common/tiny_models.py); a subprocess a test starts inherits this.
os.environ.setdefault("PAPERLAB_BUILD_TINY_MODELS", "1")
_wandb_tmp = tempfile.mkdtemp(prefix="paperlab-wandb-")
for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    os.environ.setdefault(var, _wandb_tmp)
# DeepSpeed compiles its communication op once; keep it in the user cache, not the repo.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
    os.environ.get("PAPERLAB_CACHE", os.path.expanduser("~/.cache/paperlab")), "torch_extensions"))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models():
    """Every cached tiny model of this checkout, built once (~90 s to 5 min each on a fresh machine)."""
    from datamodules.common.tiny_models import TINY_MODELS, build

    return {name: build(name) for name in TINY_MODELS}


@pytest.fixture(scope="session")
def tiny_lm_dir():
    from datamodules.common.tiny_models import build

    return build("tiny-lm")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from datamodules.common.tokenizer import corpus_tokenizer

    return corpus_tokenizer(2048)
