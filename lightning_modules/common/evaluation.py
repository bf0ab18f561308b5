"""The one evaluator every paper uses: perplexity, KL to a reference in bits/token, generation, string scoring.

- ``perplexity``: non-overlapping windows (``stride=None``), or a sliding window where each window scores only
  its last ``stride`` tokens with up to ``seq_len - stride`` tokens of context (the usual long-context protocol).
- ``kl_bits_per_token``: mean over predicted positions of KL(p_ref ‖ p_model), in bits (divided by ln 2).
- Scoring as RULER does it: ``string_match_all`` (fraction of references found in the prediction, averaged),
  ``string_match_part`` (1 if any reference is found); ``exact_match`` after light normalisation.
"""
from __future__ import annotations

import math
import re
from typing import Sequence

import torch

LN2 = math.log(2.0)


def _as_1d(token_ids) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    return ids.reshape(-1)


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def perplexity(model, token_ids, seq_len: int, stride: int | None = None, batch_size: int = 4,
               shard: tuple[int, int] = (0, 1)) -> dict:
    """Token-weighted NLL and perplexity of one long token stream.

    With ``stride=None`` the stream is cut into non-overlapping windows of ``seq_len`` (each window's first token is
    not scored, having no context inside it). With ``stride < seq_len`` window i covers ``[i*stride, i*stride+seq_len)``
    and scores only the tokens not scored before, so every token after the first is scored exactly once.
    ``shard=(rank, world)`` scores every world-th batch of windows from the rank-th, and runs a batch with
    nothing scored where a rank has run out, so that every rank makes the same number of forward passes (a
    collective under FSDP / ZeRO-3); sum ``nll`` and ``tokens`` over ranks for the whole stream's figure.
    """
    ids = _as_1d(token_ids)
    n = ids.numel()
    if n < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    stride = seq_len if stride is None else stride
    if not 0 < stride <= seq_len:
        raise ValueError(f"stride={stride} must be in (0, seq_len={seq_len}]")
    dev = _device(model)
    windows = []  # (begin, end, first scored target): a target needs its previous token inside the window
    prev_end = 1
    for begin in range(0, n - 1, stride):
        end = min(begin + seq_len, n)
        first = max(prev_end, begin + 1)
        if first < end:
            windows.append((begin, end, first))
        prev_end = end
        if end == n:
            break
    total_nll, total_tok = 0.0, 0
    rank, world = shard
    starts = list(range(0, len(windows), batch_size))
    starts += [None] * (-len(starts) % world)  # equal forward counts on every rank
    for i in starts[rank::world]:
        chunk = windows[i:i + batch_size] if i is not None else windows[:1]
        width = max(e - b for b, e, _ in chunk)
        x = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, (b, e, _) in enumerate(chunk):
            x[j, : e - b] = ids[b:e]
            mask[j, : e - b] = 1
        logits = model(input_ids=x.to(dev), attention_mask=mask.to(dev), use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        for j, (b, e, first) in enumerate(chunk if i is not None else []):
            tgt = ids[first:e].to(dev)  # targets at absolute positions first..e-1, predicted from position-1
            rows = logp[j, first - 1 - b: e - 1 - b]
            total_nll -= rows.gather(-1, tgt.unsqueeze(-1)).sum().item()
            total_tok += tgt.numel()
    loss = total_nll / total_tok if total_tok else float("nan")
    return {"loss": loss, "ppl": math.exp(loss), "nll": total_nll, "tokens": total_tok}


@torch.no_grad()
def kl_bits_per_token(model, reference, input_ids, attention_mask=None) -> float:
    """Mean KL(p_reference ‖ p_model) over all (unmasked) positions, in bits per token."""
    dev = _device(model)
    x = torch.as_tensor(input_ids, dtype=torch.long)
    if x.ndim == 1:
        x = x.unsqueeze(0)
    m = torch.ones_like(x) if attention_mask is None else torch.as_tensor(attention_mask)
    lp = torch.log_softmax(model(input_ids=x.to(dev), attention_mask=m.to(dev), use_cache=False).logits.float(), -1)
    rdev = _device(reference)
    lq = torch.log_softmax(reference(input_ids=x.to(rdev), attention_mask=m.to(rdev), use_cache=False).logits.float(), -1).to(dev)
    kl = (lq.exp() * (lq - lp)).sum(-1)  # nats, per position
    w = m.to(dev).float()
    return float((kl * w).sum() / w.sum() / LN2)


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 16,
                    synced_gpus: bool = False) -> list[str]:
    """Greedy continuations of each prompt (left-padded batch), decoded without the prompt. ``synced_gpus``:
    keep stepping until every rank is done (needed when the weights are sharded across ranks)."""
    dev = _device(model)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    out = model.generate(input_ids=enc["input_ids"].to(dev), attention_mask=enc["attention_mask"].to(dev),
                         max_new_tokens=max_new_tokens, do_sample=False, synced_gpus=synced_gpus,
                         pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    new = out[:, enc["input_ids"].shape[1]:]
    return tokenizer.batch_decode(new, skip_special_tokens=True)


def normalize_answer(s: str) -> str:
    s = s.lower().strip()
    s = re.sub(r"[^\w\s.-]", " ", s)
    return " ".join(s.split()).strip(" .")  # a sentence's closing period is not part of the answer ("42." == "42")


def exact_match(pred: str, gold: str) -> float:
    return float(normalize_answer(pred) == normalize_answer(gold))


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """RULER's score for tasks with several answers: the fraction of references found (case-insensitive)."""
    if not refs:
        raise ValueError("string_match_all needs at least one reference")
    p = pred.lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """RULER's score for QA-style tasks: 1 if any reference is found in the prediction."""
    p = pred.lower()
    return float(any(r.lower() in p for r in refs))
