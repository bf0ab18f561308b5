"""A tiny vision-language model on the project's causal LMs (real_vqa first; any paper with images next).

``TinyVLM`` = a randomly initialised SigLIP vision tower (``transformers.SiglipVisionModel`` from a config: by
default 32×32 images, patch 8, width 64, 2 layers) + a 2-layer MLP projector + a causal LM from ``build_backbone``
(``tiny-lm`` at tiny scale). The prompt holds one ``<image>`` placeholder token per image patch; those positions'
embeddings are replaced by the projected patch features and the LM runs on ``inputs_embeds``, so ``generate``,
KV caches and logits processors work as for the bare LM. A text-only call (no ``pixel_values``) passes
``input_ids`` to the LM untouched: its logits are the LM's, bit for bit.

The placeholder id is outside the LM's vocabulary (``len(tokenizer)`` after :func:`add_image_token`), so the LM's
embedding and head are not resized and can never emit it.

``HubVLM`` gives a hub VLM (LLaVA, Qwen2-VL: ``build_backbone`` with ``kind: image_text_to_text``, i.e.
``AutoModelForImageTextToText``, plus its ``AutoProcessor``) the same call interface: ``model(input_ids=...,
pixel_values=..., past_key_values=..., use_cache=...)``. Its prompts come from the processor (chat template, the
image placeholder expanded into the model's own image tokens) and its ``pixel_values`` are the image processor's
tensors (``pixel_values`` and, for Qwen2-VL, ``image_grid_thw``), so code written for TinyVLM (REALModule, the
contrastive decoders with their two KV caches) runs on it unchanged.
"""
from __future__ import annotations

import inspect
import weakref
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
                             f"{counts.tolist()}: build prompts with lightning_modules.real_vqa.data.image_prompt")
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

    def apply_lora(self, **lora) -> None:
        """LoRA on the LM (``common.lora.apply_lora``); the vision tower and projector keep training in full."""
        from lightning_modules.common.lora import apply_lora

        self.lm = apply_lora(self.lm, **lora)


def build_vlm(spec: Mapping[str, Any], image_token_id: int, vision: Mapping[str, Any] | None = None) -> TinyVLM:
    """A ``TinyVLM`` on the causal LM of a backbone spec (``kind: causal_lm``)."""
    from lightning_modules.common.backbone import build_backbone

    if (spec.get("kind") or "causal_lm") != "causal_lm":
        raise ValueError(f"TinyVLM wraps a causal LM; backbone.kind={spec.get('kind')!r} is already a VLM: set "
                         "model.vision=null to use it directly")
    return TinyVLM(build_backbone(spec), image_token_id, vision)


class HubVLM(nn.Module):
    """A hub image-text-to-text model and its processor behind TinyVLM's interface.

    - :meth:`prompt_ids` (text, image) → the processor's token ids: its chat template when it has one, the image
      placeholder expanded into as many image tokens as the model's vision tower yields for that image.
    - :meth:`image_inputs` (images) → the image processor's tensors; pass them as ``pixel_values`` (a mapping).
    - ``forward`` adds what the model needs beside the ids (``mm_token_type_ids`` for Qwen2-VL's M-RoPE) and keeps
      Qwen2-VL's position offset (``rope_deltas``, which transformers stores on the model after a prompt) with each
      KV cache, so two contexts decoded in turn (RPGD's full and pivot-masked prompts) do not share one.
    """

    def __init__(self, model: nn.Module, processor):
        super().__init__()
        self.hf, self.processor = model, processor
        self.config = model.config  # what generation utilities and peft read
        self.image_token_id = int(model.config.image_token_id)
        self.lm_name = next(n for n, m in model.named_modules() if m is model.get_decoder())
        self._needs_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters
        self._rope_owner = next((m for m in model.modules() if hasattr(m, "rope_deltas")), None)
        self._rope_of_cache = weakref.WeakKeyDictionary()

    def get_input_embeddings(self):
        return self.hf.get_input_embeddings()

    def get_output_embeddings(self):
        return self.hf.get_output_embeddings()

    def prompt_ids(self, text: str, image) -> list[int]:
        """Token ids of one image (an HxWx3 uint8 array or a PIL image) followed by ``text``."""
        p = self.processor
        if p.chat_template:
            text = p.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": text.lstrip()}]}],
                                         add_generation_prompt=True, tokenize=False)
        else:
            text = p.image_token + text
        return list(p(text=[text], images=[image])["input_ids"][0])

    def image_inputs(self, images: list, device=None) -> dict[str, torch.Tensor]:
        out = self.processor.image_processor(images=list(images), return_tensors="pt")
        return {k: v.to(device) for k, v in out.items()}

    def forward(self, input_ids=None, attention_mask=None, pixel_values=None, **kw):
        has_images = input_ids is not None and bool((input_ids == self.image_token_id).any())
        if has_images and pixel_values is None:
            raise ValueError("input has image tokens but no pixel_values: pass HubVLM.image_inputs(images)")
        if has_images:
            kw.update(pixel_values if isinstance(pixel_values, Mapping) else {"pixel_values": pixel_values})
            if self._needs_types:
                kw["mm_token_type_ids"] = (input_ids == self.image_token_id).long()
        cache = kw.get("past_key_values", kw.get("cache"))
        if self._rope_owner is not None:  # this context's offset (None: recompute from the ids, as for a prompt)
            self._rope_owner.rope_deltas = self._rope_of_cache.get(cache) if cache is not None else None
        out = self.hf(input_ids=input_ids, attention_mask=attention_mask, **kw)
        if self._rope_owner is not None and getattr(out, "past_key_values", None) is not None:
            self._rope_of_cache[out.past_key_values] = self._rope_owner.rope_deltas
        return out

    def apply_lora(self, **lora) -> None:
        """LoRA on the language model's ``targets`` only (``common.lora.apply_lora`` with ``within``); the vision
        tower and projector stay frozen, as in the paper-scale recipe."""
        from lightning_modules.common.lora import apply_lora

        self.hf = apply_lora(self.hf, within=self.lm_name, **lora)


def build_hub_vlm(spec: Mapping[str, Any]) -> HubVLM:
    """A ``HubVLM`` from a backbone spec with ``kind: image_text_to_text`` and ``pretrained`` (a hub id or a local
    dir holding the model and its processor). No remote code: the architectures must be transformers' own."""
    from transformers import AutoProcessor

    from datamodules.common.errors import ConfigError, MissingExtraError, hub_loading
    from lightning_modules.common.backbone import build_backbone, check_revision, resolve_pretrained

    if spec.get("kind") != "image_text_to_text":
        raise ConfigError(f"HubVLM wraps a hub VLM but backbone.kind={spec.get('kind')!r} — set backbone.kind="
                          "image_text_to_text, or model.vision for a TinyVLM on a causal LM")
    if not spec.get("pretrained"):
        raise ConfigError("a hub VLM needs backbone.pretrained (a hub id or local dir): its processor (image tokens, "
                          "resizing, chat template) comes with the checkpoint — set backbone.pretrained")
    check_revision(spec)
    extra = {"revision": spec["revision"]} if spec.get("revision") else {}
    location = resolve_pretrained(spec["pretrained"], revision=spec.get("revision"))
    try:  # the processor first: a missing checkpoint fails before the weights load
        with hub_loading(spec["pretrained"], what="processor"):
            processor = AutoProcessor.from_pretrained(location, **extra)
    except ImportError as err:  # Qwen2-VL's processor builds a video processor, which needs torchvision
        if "torchvision" not in str(err).lower():
            raise
        raise MissingExtraError(
            f"the processor of backbone.pretrained={spec['pretrained']!r} needs torchvision, which is not installed — "
            "pip install torchvision built for your torch (the gpu extra has it; on a CPU-only torch use "
            "--index-url https://download.pytorch.org/whl/cpu: the PyPI wheel needs CUDA torch)") from err
    return HubVLM(build_backbone(spec), processor)
