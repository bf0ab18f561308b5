"""A short supervised warm-up on a task's format (before RL, or to align a model), cached like the tiny pretrained model.

RL from a model whose reward is always 0 learns nothing (every group advantage is 0). The tiny experiments
therefore start from the project's tiny pretrained LM fine-tuned for ``steps`` steps on generated
(prompt, response) pairs of ``warmup.task``, any generator registered in ``datamodules.instruct`` (``arithmetic``
by default; spard's ``spard_aligned``), with the loss on response tokens only. The pairs come from the train
part of the task's space only (``datamodules.verifiable``'s hash split, with the run's ``val_fraction`` and
``test_fraction``, which the RL module copies into the warm-up config), so no val or test problem is warmed up on. The result is saved in
transformers format under ``cache_root()/rl_warmup/<key>``, the key hashing the backbone spec, the warm-up
config, the tiny model's key and a sample of the task's pairs, so it is trained once per configuration.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from datamodules.common.cache import cache_root, stable_hash
from datamodules.instruct import sft_batch  # noqa: F401  (re-exported: the warm-up's batches)


def held_out(warmup: Mapping[str, Any]) -> tuple[float, float]:
    """The (val, test) shares of the problem space the warm-up must not see; required, so none is forgotten."""
    if "val_fraction" not in warmup or "test_fraction" not in warmup:
        raise ValueError("model.warmup needs val_fraction and test_fraction (the data's: the RL module copies "
                         "data.val_fraction / data.test_fraction), so the warm-up never sees a held-out problem")
    return float(warmup["val_fraction"]), float(warmup["test_fraction"])


# warm-up keys that configure the training loop; every other key is an option of the task's generator
# (``digits``, ``operations`` for arithmetic; whatever a registered task takes)
CONTROL_KEYS = ("steps", "lr", "batch_size", "task", "seed", "val_fraction", "test_fraction")


def task_options(warmup: Mapping[str, Any]) -> dict:
    opts = {k: v for k, v in warmup.items() if k not in CONTROL_KEYS}
    if "operations" in opts:
        opts["operations"] = tuple(opts["operations"])
    return opts


def warmup_key(backbone: Mapping[str, Any], warmup: Mapping[str, Any]) -> str:
    """Hash of what decides the warmed-up weights: the starting checkpoint, the warm-up config and the task's
    examples (a sample of them, so edits elsewhere in the generator module do not retrain)."""
    from datamodules.instruct import generate

    start = {k: backbone.get(k) for k in ("family", "pretrained", "dtype")} if backbone.get("pretrained") else dict(backbone)
    sample = generate(warmup.get("task", "arithmetic"), 4, 1, **task_options(warmup))
    parts = [start, dict(warmup), sample]
    from datamodules.common.tiny_models import is_tiny_model, key

    if is_tiny_model(backbone.get("pretrained")):
        parts.append(key(backbone["pretrained"]))
    return stable_hash(*parts)


def warmup_problems(warmup: Mapping[str, Any]) -> list[dict]:
    """The warm-up's (prompt, response) pairs: ``steps * batch_size`` draws of the registered ``task``
    (``datamodules.instruct``) from the train part of its space only."""
    from datamodules.instruct import generate

    val_fraction, test_fraction = held_out(warmup)
    return generate(warmup.get("task", "arithmetic"), int(warmup["steps"]) * int(warmup.get("batch_size", 32)),
                    int(warmup.get("seed", 0)) + 104729, "train", val_fraction, test_fraction, **task_options(warmup))


def train_warmup(backbone: Mapping[str, Any], warmup: Mapping[str, Any], out_dir: Path) -> None:
    from datamodules.common.tokenizer import load_tokenizer
    from lightning_modules.common.backbone import build_backbone

    torch.manual_seed(int(warmup.get("seed", 0)))
    model = build_backbone(backbone)
    tok = load_tokenizer(pretrained=backbone["pretrained"]) if backbone.get("pretrained") else None
    if tok is None:
        raise ValueError("the RL warm-up needs a pretrained backbone with its tokenizer (backbone.pretrained)")
    steps, bs = int(warmup["steps"]), int(warmup.get("batch_size", 32))
    problems = warmup_problems(warmup)
    opt = torch.optim.AdamW(model.parameters(), lr=float(warmup.get("lr", 1e-3)), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    model.train()
    for s in range(steps):
        batch = sft_batch(tok, problems[s * bs:(s + 1) * bs], "cpu")  # loss on the response only
        pos = (batch["attention_mask"].cumsum(-1) - 1).clamp_min(0)
        loss = model(**batch, position_ids=pos, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    (out_dir / "warmup_loss.txt").write_text(f"{loss.item():.4f}\n")


def warmup_dir(backbone: Mapping[str, Any], warmup: Mapping[str, Any]) -> Path:
    """The cached warmed-up model dir for (backbone, warm-up config), trained first if missing."""
    target = cache_root() / "rl_warmup" / warmup_key(backbone, warmup)
    if (target / "config.json").exists():
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():
            return target
        print(f"[paperlab] RL warm-up: {warmup['steps']} supervised steps on the task format (cached in {target})",
              file=sys.stderr)
        tmp = target.with_name(target.name + ".tmp")
        train_warmup(backbone, warmup, tmp)
        tmp.replace(target)
    return target
