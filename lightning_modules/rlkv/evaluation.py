"""Greedy decoding under a KV press, and the evaluation module of RLKV's sparsity sweep.

``press_generate`` prefills a left-padded batch of prompts under the press (position ids from the mask, so every
row's prefill starts at position 0 and the press sees it as one) and decodes greedily one token at a time; it
returns the completions, the decode wall time per token and the KV entries kept at the end / the full cache's.
``RLKVEvalModule`` (``task: test``) scores those completions on held-out problems (``test/accuracy``) with
``test/kv_kept_fraction`` and ``test/decode_ms_per_token``. Its protocol is the release's by default
(``eval/bench/pred.py``: ``max_length`` 8,192 prompt + generated tokens, 16,384 for AIME24; the last
``decode_simulation`` = 50 prompt tokens decoded one at a time; early stop on ``repeat_window`` = 400 repetition;
EOS = any of the generation config's ids); ``max_length: null, decode_simulation: 0, repeat_window: 0`` is ours
before (``val_max_new_tokens`` for every row, the whole prompt prefilled).
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


def eos_set(eos_id) -> set[int]:
    """EOS ids as a set: one id, a list (a generation config's), or None (none)."""
    if eos_id is None:
        return set()
    return {int(e) for e in eos_id} if isinstance(eos_id, (list, tuple, set)) else {int(eos_id)}


@torch.no_grad()
def press_generate(model, press: Press | None, prompts: list[list[int]], max_new_tokens: int, eos_id, pad_id: int,
                   targets: torch.Tensor | None = None, max_length: int | None = None, decode_simulation: int = 0,
                   repeat_window: int = 0) -> dict[str, Any]:
    """Greedy decoding of a left-padded batch under ``press``; ``eos_id`` one id or a list (a row stops at any).

    The release's protocol (RLKV ``eval/bench/pred.py``), each part a switch:

    - ``max_length``: each row generates up to ``max_length`` - its prompt length tokens (8,192 for GSM8K / MATH500,
      16,384 for AIME24), instead of ``max_new_tokens`` for every row;
    - ``decode_simulation``: the last that many prompt tokens (50) are fed one at a time after prefilling the rest,
      so they already attend through the compressed cache (at most the shortest prompt - 1);
    - ``repeat_window``: a row stops when, at a multiple of ``repeat_window`` generated tokens past the first window,
      its last ``repeat_window`` tokens hold fewer than a tenth as many distinct ids (degenerate repetition).

    ``targets`` (B, T): feed these tokens instead of the argmax (teacher forcing through the pressed cache) and also
    return their mean log-likelihood per real token (``nll``)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    eos = eos_set(eos_id)
    ids, mask = left_pad(prompts, pad_id, device)
    lengths = mask.sum(-1)
    if targets is not None:
        budget = torch.full_like(lengths, targets.shape[1])
    elif max_length is not None:
        budget = (max_length - lengths).clamp_min(1)
    else:
        budget = torch.full_like(lengths, max_new_tokens)
    sim = max(0, min(int(decode_simulation), int(lengths.min()) - 1))
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    out, nll, n_real = [], 0.0, 0
    with press(model) if press is not None else contextlib.nullcontext():
        cut = ids.shape[1] - sim
        logits = model(input_ids=ids[:, :cut], attention_mask=mask[:, :cut], position_ids=pos[:, :cut], cache=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        for j in range(cut, ids.shape[1]):  # the simulated decoding of the prompt's tail
            logits = model(input_ids=ids[:, j:j + 1], attention_mask=mask[:, :j + 1], position_ids=pos[:, j:j + 1],
                           cache=cache, use_cache=True).logits[:, -1]
        pos = pos[:, -1:]
        t0, steps = time.perf_counter(), 0
        n_new = int(budget.max())
        for t in range(n_new):
            tok = logits.argmax(-1) if targets is None else targets[:, t].to(device)
            tok = torch.where(done, torch.full_like(tok, pad_id), tok)
            if targets is not None:
                lp = logits.float().log_softmax(-1).gather(-1, tok[:, None])[:, 0]
                nll -= float(lp[~done].sum())
                n_real += int((~done).sum())
            out.append(tok)
            done |= torch.isin(tok, torch.tensor(sorted(eos), dtype=tok.dtype, device=device)) | (t + 1 >= budget)
            if repeat_window and t + 1 > repeat_window and (t + 1) % repeat_window == 0:
                last = torch.stack(out[-repeat_window:], 1)
                distinct = torch.tensor([len(set(row.tolist())) for row in last], device=device)
                done |= distinct < 0.1 * repeat_window
            if bool(done.all()) or t == n_new - 1:  # the last token is never fed back
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            pos = pos + 1
            logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, cache=cache,
                           use_cache=True).logits[:, -1]
            steps += 1
        decode_s = time.perf_counter() - t0
        kept, full = kv_entries(model, cache, mask.shape[1])
    tokens = torch.stack(out, 1) if out else ids.new_zeros(len(prompts), 0)
    completions = [[t for t in row.tolist() if t != pad_id and t not in eos] for row in tokens]
    return {"completions": completions, "tokens": tokens, "decode_s_per_token": decode_s / max(1, steps),
            "kv_kept_fraction": kept / max(1, full), "nll": nll / max(1, n_real)}


class RLKVEvalModule(RLModule):
    """Greedy exact match on held-out problems under a press (``model/press=head_mixed`` or a token scorer)."""

    def __init__(self, backbone: Mapping[str, Any], press: Press | None = None, max_length: int | None = 8192,
                 decode_simulation: int = 50, repeat_window: int = 400, **kwargs):
        super().__init__(backbone, **kwargs)
        if max_length is not None and max_length < 2 or decode_simulation < 0 or repeat_window < 0:
            raise ValueError(f"model.max_length={max_length}, decode_simulation={decode_simulation}, repeat_window="
                             f"{repeat_window}: max_length >= 2 (or null), the others >= 0 (0 = off)")
        self.max_length, self.decode_simulation, self.repeat_window = max_length, decode_simulation, repeat_window
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

    def eos_ids(self) -> list[int]:
        """The tokenizer's EOS and every EOS of the model's generation config (R1 / Qwen3 list several)."""
        config = getattr(self.model, "generation_config", None)
        ids = eos_set(getattr(config, "eos_token_id", None)) | eos_set(self.get_tokenizer().eos_token_id)
        return sorted(ids)

    def on_validation_epoch_start(self):
        super().on_validation_epoch_start()
        self._kv = []

    @torch.no_grad()
    def validation_step(self, batch, batch_idx):
        tok = self.get_tokenizer()
        gen = press_generate(self.model, self.press, batch["prompt_ids"], self.val_max_new_tokens, self.eos_ids(),
                             tok.pad_token_id, max_length=self.max_length, decode_simulation=self.decode_simulation,
                             repeat_window=self.repeat_window)
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
