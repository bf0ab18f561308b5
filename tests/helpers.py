"""Compose and run experiments in-process, as run.py would, with outputs under a temp dir."""
from __future__ import annotations

from pathlib import Path

from runner import compose, run_experiment  # noqa: F401  (tests import them from here too)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def experiments() -> list[str]:
    """The runnable experiments: conf/experiment/*.yaml (family bases in conf/experiment/base/ are not ones)."""
    return sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


# The cached warm-up (lightning_modules/common/rl/warmup.py) a tiny smoke test starts from: 40 steps at batch 16,
# not the experiments' 150-300 at 32, so a cold suite builds each in seconds. Smoke tests on one warm-up task use
# these same overrides, so they share one cache key (ps_ppo/grpo/rloo/hista on arithmetic build it once).
SMOKE_WARMUP = ("model.warmup.steps=40", "model.warmup.batch_size=16")


def saved_chat_tokenizer(tiny_tokenizer, out_dir: Path, chat_template: str):
    """The project's tokenizer with ChatML turn markers and ``chat_template``, saved and loaded back (no hub)."""
    import copy

    from transformers import AutoTokenizer

    name = tiny_tokenizer.name_or_path
    tok = AutoTokenizer.from_pretrained(name) if name else copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = chat_template
    tok.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(out_dir)
