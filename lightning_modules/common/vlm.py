"""A tiny vision-language model on the project's causal LMs (real_vqa first; any paper with images next).

``TinyVLM`` = a randomly initialised SigLIP vision tower (``transformers.SiglipVisionModel`` from a config: by
default 32×32 images, patch 8, width 64, 2 layers) + a 2-layer MLP projector + a causal LM from ``build_backbone``
(``tiny-lm`` at tiny scale). The prompt holds one ``<image>`` placeholder token per image patch; those positions'
embeddings are replaced by the projected patch features and the LM runs on ``inputs_embeds``, so ``generate``,
KV caches and logits processors work as for the bare LM. A text-only call (no ``pixel_values``) passes
``input_ids`` to the LM untouched: its logits are the LM's, bit for bit.

The placeholder id is outside the LM's vocabulary (``len(tokenizer)`` after :func:`add_image_token`), so the LM's
embedding and head are not resized and can never emit it. Hub VLMs (Qwen2-VL, LLaVA) load through
``build_backbone`` with ``kind: image_text_to_text`` instead.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

IMAGE_TOKEN = "<image>"
VISION_DEFAULTS = {"image_size": 32, "patch_size": 8, "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 2, "intermediate_size": 128, "num_channels": 3}


def add_image_token(tokenizer) -> int:
    """Registers ``<image>`` as a special token of ``tokenizer`` (idempotent) and returns its id."""
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)


def num_patches(vision: Mapping[str, Any] | None = None) -> int:
    v = {**VISION_DEFAULTS, **dict(vision or {})}
    return (int(v["image_size"]) // int(v["patch_size"])) ** 2


def check_vision(vision: Mapping[str, Any]) -> dict:
    v = {**VISION_DEFAULTS, **dict(vision or {})}
    if int(v["image_size"]) % int(v["patch_size"]):
        raise ValueError(f"vision.image_size={v['image_size']} is not divisible by vision.patch_size={v['patch_size']}: "
                         "choose a patch size that tiles the image")
    return v


class TinyVLM(nn.Module):
    """Vision tower + projector + causal LM; ``image_token_id`` marks where patch features go."""

    def __init__(self, lm: nn.Module, image_token_id: int, vision: Mapping[str, Any] | None = None):
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        v = check_vision(vision or {})
        # patch features only: no pooling head (it would hold parameters no loss reaches)
        self.vision = SiglipVisionModel(SiglipVisionConfig(**v, vision_use_head=False))
        width = lm.get_input_embeddings().weight.shape[1]
        self.projector = nn.Sequential(nn.Linear(v["hidden_size"], width), nn.GELU(), nn.Linear(width, width))
        self.lm = lm
        self.image_token_id = int(image_token_id)
        self.num_patches = num_patches(v)
        self.config = lm.config  # what generation utilities and peft read

    def get_input_embeddings(self):
        return self.lm.get_input_embeddings()

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, num_patches, LM width) projected patch features."""
        return self.projector(self.vision(pixel_values=pixel_values).last_hidden_state)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        """The LM's input embeddings with each row's ``<image>`` positions replaced by its image's patch features."""
        where = input_ids == self.image_token_id
        counts = where.sum(1)
        if not bool((counts == self.num_patches).all()):
            raise ValueError(f"each row needs exactly {self.num_patches} {IMAGE_TOKEN} tokens (one per patch), got "
                             f"{counts.tolist()}: build prompts with datamodules.kivqa.image_prompt")
        embeds = self.lm.get_input_embeddings()(input_ids.masked_fill(where, 0))
        feats = self.image_features(pixel_values.to(embeds.dtype))
        return embeds.masked_scatter(where.unsqueeze(-1), feats.reshape(-1, feats.shape[-1]))

    def forward(self, input_ids=None, attention_mask=None, pixel_values=None, inputs_embeds=None, **kw):
        if pixel_values is not None and input_ids is not None and bool((input_ids == self.image_token_id).any()):
            return self.lm(inputs_embeds=self.embed(input_ids, pixel_values), attention_mask=attention_mask, **kw)
        if input_ids is not None and bool((input_ids == self.image_token_id).any()):
            raise ValueError(f"input has {IMAGE_TOKEN} tokens but no pixel_values: pass the images")
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kw)

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, pixel_values=None, **kw):
        """``lm.generate`` on the merged embeddings; returns only the new tokens when images are given (as
        transformers does for ``inputs_embeds``), the prompt plus new tokens otherwise."""
        if pixel_values is None:
            return self.lm.generate(input_ids=input_ids, attention_mask=attention_mask, **kw)
        return self.lm.generate(inputs_embeds=self.embed(input_ids, pixel_values), attention_mask=attention_mask, **kw)


def build_vlm(spec: Mapping[str, Any], image_token_id: int, vision: Mapping[str, Any] | None = None) -> TinyVLM:
    """A ``TinyVLM`` on the causal LM of a backbone spec (``kind: causal_lm``)."""
    from lightning_modules.common.backbone import build_backbone

    if (spec.get("kind") or "causal_lm") != "causal_lm":
        raise ValueError(f"TinyVLM wraps a causal LM; backbone.kind={spec.get('kind')!r} is already a VLM: set "
                         "model.vision=null to use it directly")
    return TinyVLM(build_backbone(spec), image_token_id, vision)
