"""A short supervised warm-up on the task format before RL, cached like the tiny pretrained model.

RL from a model whose reward is always 0 learns nothing (every group advantage is 0). The tiny experiments
therefore start from the project's tiny pretrained LM fine-tuned for ``steps`` steps on generated
(prompt, solution) pairs of the RL task, with the loss on solution tokens only. The pairs come from the train
part of the problem space only (``datamodules.verifiable``'s hash split, with the run's ``val_fraction`` and
``test_fraction``, which the RL module copies into the warm-up config), so no val or test problem is warmed up on. The result is saved in
transformers format under ``cache_root()/rl_warmup/<key>``, the key hashing the backbone spec, the warm-up
config, the tiny model's key and this file and the task generator, so it is trained once per configuration.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from datamodules.common.cache import cache_root, stable_hash


def held_out(warmup: Mapping[str, Any]) -> tuple[float, float]:
    """The (val, test) shares of the problem space the warm-up must not see; required, so none is forgotten."""
    if "val_fraction" not in warmup or "test_fraction" not in warmup:
        raise ValueError("model.warmup needs val_fraction and test_fraction (the data's: the RL module copies "
                         "data.val_fraction / data.test_fraction), so the warm-up never sees a held-out problem")
    return float(warmup["val_fraction"]), float(warmup["test_fraction"])


def warmup_key(backbone: Mapping[str, Any], warmup: Mapping[str, Any]) -> str:
    """Hash of what decides the warmed-up weights: the starting checkpoint, the warm-up config and the task's
    examples (a sample of them, so edits elsewhere in the generator module do not retrain)."""
    from datamodules.verifiable import PROMPT, generate_problems

    start = {k: backbone.get(k) for k in ("family", "pretrained", "dtype")} if backbone.get("pretrained") else dict(backbone)
    sample = generate_problems(warmup.get("task", "arithmetic"), 4, 1, int(warmup.get("digits", 2)),
                               tuple(warmup.get("operations", ("+", "-"))))
    parts = [start, dict(warmup), PROMPT, sample]
    from datamodules.common.tiny_models import is_tiny_model, key

    if is_tiny_model(backbone.get("pretrained")):
        parts.append(key(backbone["pretrained"]))
    return stable_hash(*parts)


def sft_batch(tokenizer, problems: list[dict], device) -> dict:
    """Right-padded prompt+solution+EOS with labels -100 on the prompt and padding."""
    from datamodules.verifiable import PROMPT

    rows, labels = [], []
    for p in problems:
        prompt = tokenizer(PROMPT.format(q=p["question"]), add_special_tokens=False)["input_ids"]
        answer = tokenizer(" " + p["solution"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=device)
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels], device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def warmup_problems(warmup: Mapping[str, Any]) -> list[dict]:
    """The warm-up's (prompt, solution) problems: ``steps * batch_size`` draws from the train part only."""
    from datamodules.verifiable import generate_problems

    val_fraction, test_fraction = held_out(warmup)
    return generate_problems(warmup.get("task", "arithmetic"), int(warmup["steps"]) * int(warmup.get("batch_size", 32)),
                             int(warmup.get("seed", 0)) + 104729, int(warmup.get("digits", 2)),
                             tuple(warmup.get("operations", ("+", "-"))), "train", val_fraction, test_fraction)


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
        batch = sft_batch(tok, problems[s * bs:(s + 1) * bs], "cpu")
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
