"""Greedy decoding under a KV press, and the evaluation module of RLKV's sparsity sweep.

``press_generate`` prefills a left-padded batch of prompts under the press (position ids from the mask, so every
row's prefill starts at position 0 and the press sees it as one) and decodes greedily one token at a time; it
returns the completions, the decode wall time per token and the KV entries kept at the end / the full cache's.
``RLKVEvalModule`` (``task: test``) scores those completions by exact match on held-out problems
(``test/accuracy``) with ``test/kv_kept_fraction`` and ``test/decode_ms_per_token``.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Mapping

import torch

from lightning_modules.common.kv_press import Press, attention_layers
from lightning_modules.common.rl.module import RLModule
from lightning_modules.common.rl.rollouts import left_pad


def kv_entries(model, cache, length: int) -> tuple[int, int]:
    """(entries attention can still see, entries an uncompressed cache of ``length`` tokens would hold), over layers,
    heads and batch rows."""
    from lightning_modules.rlkv.press import HeadSplitLayer

    kept = full = 0
    for module, layer in zip(attention_layers(model), cache.layers):
        if isinstance(layer, HeadSplitLayer):
            B = layer.keys.shape[0]
            kept += int(layer.keys.shape[1] * layer.keys.shape[-2] * B + layer.valid.sum() * len(layer.stream_idx))
            full += layer.n_heads * length * B
            continue
        B, H, K, _ = layer.keys.shape
        evicted = getattr(module, "press_evicted", None)
        kept += B * H * K - (int(evicted[..., :K].sum()) if evicted is not None else 0)
        full += B * H * length
    return kept, full


@torch.no_grad()
def press_generate(model, press: Press | None, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None,
                   pad_id: int, targets: torch.Tensor | None = None) -> dict[str, Any]:
    """``targets`` (B, T): feed these tokens instead of the argmax (teacher forcing through the pressed cache) and
    also return their mean log-likelihood per real token (``nll``)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out, nll, n_real = [], 0.0, 0
    with press(model) if press is not None else contextlib.nullcontext():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1]
        t0, steps = time.perf_counter(), 0
        n_new = max_new_tokens if targets is None else targets.shape[1]
        for t in range(n_new):
            tok = logits.argmax(-1) if targets is None else targets[:, t].to(device)
            tok = torch.where(done, torch.full_like(tok, pad_id), tok)
            if targets is not None:
                lp = logits.float().log_softmax(-1).gather(-1, tok[:, None])[:, 0]
                nll -= float(lp[~done].sum())
                n_real += int((~done).sum())
            out.append(tok)
            done |= tok == eos_id if eos_id is not None else torch.zeros_like(done)
            if bool(done.all()) or t == n_new - 1:  # the last token is never fed back
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = pos[:, -1:] + 1
            logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, cache=cache,
                           use_cache=True).logits[:, -1]
            steps += 1
        decode_s = time.perf_counter() - t0
        kept, full = kv_entries(model, cache, mask.shape[1])
    tokens = torch.stack(out, 1) if out else ids.new_zeros(len(prompts), 0)
    completions = [[t for t in row.tolist() if t not in (pad_id, eos_id)] for row in tokens]
    return {"completions": completions, "tokens": tokens, "decode_s_per_token": decode_s / max(1, steps),
            "kv_kept_fraction": kept / max(1, full), "nll": nll / max(1, n_real)}


class RLKVEvalModule(RLModule):
    """Greedy exact match on held-out problems under a press (``model/press=head_mixed`` or a token scorer)."""

    def __init__(self, backbone: Mapping[str, Any], press: Press | None = None, **kwargs):
        super().__init__(backbone, **kwargs)
        if press is not None and not isinstance(press, Press):
            raise ValueError(f"model.press={press!r} is not a press: choose one with model/press=<name>")
        self.press = press
        self.hparams["press"] = press.spec() if press is not None else None
        self.results: dict = {}
        self._kv = []

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if hasattr(self.press, "check"):  # e.g. a missing gates file: fail before the backbone loads
            self.press.check()

    def on_validation_epoch_start(self):
        super().on_validation_epoch_start()
        self._kv = []

    @torch.no_grad()
    def validation_step(self, batch, batch_idx):
        tok = self.get_tokenizer()
        gen = press_generate(self.model, self.press, batch["prompt_ids"], self.val_max_new_tokens, tok.eos_token_id,
                             tok.pad_token_id)
        completions = tok.batch_decode(gen["completions"], skip_special_tokens=True)
        r = self.reward(batch["prompt"], completions, batch["answer"], device=self.device).float()
        self._eval += torch.tensor([float(r.sum()), float(len(r))], dtype=torch.float64, device=self.device)
        self._kv.append((gen["kv_kept_fraction"], gen["decode_s_per_token"]))

    def _eval_end(self, prefix: str):
        super()._eval_end(prefix)
        if self._kv:
            kept, dt = (sum(x) / len(self._kv) for x in zip(*self._kv))
            self.log_dict({f"{prefix}/kv_kept_fraction": kept, f"{prefix}/decode_ms_per_token": 1e3 * dt})
            self.results.update({"kv_kept_fraction": kept, "press": self.hparams["press"]})
