"""Contrastive answer decoding: RPGD (the paper's), CAD and VCD (peers), one logits processor with its own KV cache.

Formulas (../shared/papers/real_vqa.md §8.2; [INF] where the paper is silent):

- RPGD: d = z_piv − z_full; d⊥ = d − ⟨d, ẑ_full⟩ ẑ_full with ẑ = z/‖z‖ (the reviewers' Gram-Schmidt;
  ``orthogonalize: false`` keeps d); z = z_full + α·d⊥; then the plausibility cut.
- CAD (Shi et al. 2023): z = (1+α)·z_ctx − α·z_noctx (no cut, as published).
- VCD (Leng et al. 2024): z = (1+α)·z_clean − α·z_noised, then the cut.
- Plausibility cut (CD / VCD): tokens with p_full(v) < β·max p_full get −inf, so none of them can be chosen.
"""
from __future__ import annotations

import torch
from transformers import LogitsProcessor

DECODINGS = ("greedy", "rpgd", "cad", "vcd")


def check_alpha_beta(alpha: float, beta: float) -> None:
    if alpha < 0:
        raise ValueError(f"rpgd.alpha={alpha} must be >= 0 (0 is plain decoding)")
    if not 0 <= beta < 1:
        raise ValueError(f"rpgd.beta={beta} must be in [0, 1) (the plausibility cut keeps p >= beta * max p)")


def plausibility_cut(z: torch.Tensor, z_ref: torch.Tensor, beta: float) -> torch.Tensor:
    """``z`` with −inf wherever p_ref(v) < β·max p_ref (p_ref = softmax z_ref); β = 0 keeps everything."""
    if beta <= 0:
        return z
    p = torch.softmax(z_ref.float(), dim=-1)
    keep = p >= beta * p.max(dim=-1, keepdim=True).values
    return z.masked_fill(~keep, float("-inf"))


def orthogonal_part(d: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """d − ⟨d, ẑ⟩ ẑ over the last (vocabulary) axis: the part of d orthogonal to z."""
    zhat = z / z.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny)
    return d - (d * zhat).sum(-1, keepdim=True) * zhat


def rpgd_logits(z_full: torch.Tensor, z_piv: torch.Tensor, alpha: float = 1.0, beta: float = 0.1,
                orthogonalize: bool = True) -> torch.Tensor:
    d = z_piv - z_full
    if orthogonalize:
        d = orthogonal_part(d, z_full)
    return plausibility_cut(z_full + alpha * d, z_full, beta)


def cad_logits(z_ctx: torch.Tensor, z_noctx: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return (1 + alpha) * z_ctx - alpha * z_noctx


def vcd_logits(z_clean: torch.Tensor, z_noised: torch.Tensor, alpha: float = 1.0, beta: float = 0.1) -> torch.Tensor:
    return plausibility_cut((1 + alpha) * z_clean - alpha * z_noised, z_clean, beta)


def combine(mode: str, z: torch.Tensor, z_other: torch.Tensor, alpha: float, beta: float,
            orthogonalize: bool = True) -> torch.Tensor:
    if mode == "rpgd":
        return rpgd_logits(z, z_other, alpha, beta, orthogonalize)
    if mode == "cad":
        return cad_logits(z, z_other, alpha)
    if mode == "vcd":
        return vcd_logits(z, z_other, alpha, beta)
    raise ValueError(f"decoding={mode!r}: choose one of {', '.join(DECODINGS)}")


def _images(pixel_values) -> dict:
    # a bare causal LM takes no pixel_values argument at all
    return {} if pixel_values is None else {"pixel_values": pixel_values}


class ContrastProcessor(LogitsProcessor):
    """A ``LogitsProcessor`` that runs the second context (the pivot-masked / passage-free / noised-image prompt)
    alongside generation, with its own KV cache: the first call encodes ``contrast_ids`` plus the tokens generated
    so far, each later call feeds only the newest token. ``model`` is called as ``model(input_ids=...,
    attention_mask=..., pixel_values=..., past_key_values=..., use_cache=True)`` (a causal LM or a ``TinyVLM``).

    ``prompt_len``: how many leading tokens of the ``input_ids`` generation passes in are prompt (0 when
    generation runs from ``inputs_embeds`` and passes only the new tokens)."""

    def __init__(self, model, contrast_ids: torch.Tensor, mode: str, alpha: float = 1.0, beta: float = 0.1,
                 orthogonalize: bool = True, prompt_len: int = 0, pixel_values: torch.Tensor | None = None):
        check_alpha_beta(alpha, beta)
        if mode not in DECODINGS[1:]:
            raise ValueError(f"ContrastProcessor mode={mode!r}: choose one of {', '.join(DECODINGS[1:])}")
        self.model, self.ids, self.mode = model, contrast_ids, mode
        self.alpha, self.beta, self.orthogonalize = alpha, beta, orthogonalize
        self.prompt_len, self.pixel_values = prompt_len, pixel_values
        self.cache, self.fed = None, 0  # tokens of the generated suffix already in the cache

    @torch.no_grad()
    def contrast_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        new = input_ids[:, self.prompt_len:]
        if self.cache is None:
            ids = torch.cat([self.ids.to(new.device), new], dim=1)
            out = self.model(input_ids=ids, use_cache=True, **_images(self.pixel_values))
        else:
            out = self.model(input_ids=new[:, self.fed:], past_key_values=self.cache, use_cache=True)
        self.cache, self.fed = out.past_key_values, new.shape[1]
        return out.logits[:, -1].float()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return combine(self.mode, scores.float(), self.contrast_logits(input_ids), self.alpha, self.beta,
                       self.orthogonalize).to(scores.dtype)


@torch.no_grad()
def greedy_decode(model, input_ids: torch.Tensor, max_new_tokens: int, eos_id: int | None = None,
                  pixel_values: torch.Tensor | None = None, processor: ContrastProcessor | None = None,
                  stop: torch.Tensor | None = None) -> list[int]:
    """Greedy tokens after ``input_ids`` (one row) with a KV cache; ``processor`` rewrites each step's logits.
    Stops at ``eos_id`` or when the generated tail equals ``stop`` (a token sequence)."""
    out = model(input_ids=input_ids, use_cache=True, **_images(pixel_values))
    cache, logits, new = out.past_key_values, out.logits[:, -1].float(), []
    prompt_len = input_ids.shape[1]
    seq = input_ids
    for _ in range(max_new_tokens):
        if processor is not None:
            processor.prompt_len = prompt_len
            logits = processor(seq, logits)
        tok = int(logits.argmax(-1))
        new.append(tok)
        if tok == eos_id or (stop is not None and len(new) >= len(stop) and new[-len(stop):] == stop.tolist()):
            break
        seq = torch.cat([seq, seq.new_tensor([[tok]])], dim=1)
        out = model(input_ids=seq[:, -1:], past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].float()
    return new
