"""Backbones at two scales from one spec.

A backbone spec (``conf/backbone/*.yaml``) is plain data::

    family: llama                  # transformers model_type
    kind: causal_lm                # causal_lm | image_text_to_text (a hub VLM: Qwen2-VL, LLaVA)
    config: {hidden_size: 128, ...} # architecture numbers (kwargs of the transformers config class)
    pretrained: null               # hub id, local dir, ``tiny-lm`` (the project's cached tiny model) or null
    revision: null                 # a hub branch/tag/commit of ``pretrained`` (Pythia's ``step143000``); hub ids only
    dtype: float32                 # bf16 at paper scale
    attn_implementation: sdpa      # sdpa | eager | flash_attention_2
    gradient_checkpointing: false

``pretrained: null`` builds a randomly initialised model from ``config``; otherwise ``from_pretrained`` loads
it, and ``config`` stays the record of the architecture (tests build it on the meta device and check the
parameter count against the real model).
"""
from __future__ import annotations

from typing import Any, Mapping

# Resolving ``pretrained`` (a cached tiny model, a local dir, a hub id) belongs to the lowest layer, beside the cache.
from datamodules.common.errors import ConfigError, hub_loading
from datamodules.common.tiny_models import PretrainedNotFoundError, resolve_pretrained  # noqa: E402,F401


def _dtype(name: str | None):
    import torch

    if name is None:
        return None
    aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16"}
    return getattr(torch, aliases.get(name, name))


def build_config(spec: Mapping[str, Any]):
    """The transformers config of a spec, from its architecture numbers alone (no download)."""
    from transformers import AutoConfig

    kwargs = dict(spec.get("config") or {})
    return AutoConfig.for_model(spec["family"], **kwargs)


def check_revision(spec: Mapping[str, Any]) -> None:
    """``revision`` names a hub checkpoint; a local dir or a cached tiny model has none (one line, before loading)."""
    from datamodules.common.tiny_models import is_tiny_model

    revision, pretrained = spec.get("revision"), spec.get("pretrained")
    if revision is None:
        return
    if not pretrained or is_tiny_model(pretrained) or str(pretrained).startswith(("/", "./", "../", "~")):
        raise ConfigError(f"backbone.revision={revision!r} needs a hub id in backbone.pretrained (got {pretrained!r}): "
                          "a local dir or tiny model has no revisions — point backbone.pretrained at that "
                          "checkpoint's dir and set backbone.revision=null")


KINDS = ("causal_lm", "image_text_to_text")


def _auto_class(spec: Mapping[str, Any]):
    """The transformers auto class of a spec's ``kind`` (default ``causal_lm``)."""
    import transformers

    kind = spec.get("kind") or "causal_lm"
    if kind not in KINDS:
        raise ConfigError(f"backbone.kind={kind!r} is unknown: use one of {list(KINDS)}")
    return transformers.AutoModelForImageTextToText if kind == "image_text_to_text" else transformers.AutoModelForCausalLM


def build_backbone(spec: Mapping[str, Any], meta: bool = False):
    """A causal LM (or, with ``kind: image_text_to_text``, a hub VLM) from a spec: random init from ``config``
    (or on the meta device), or ``from_pretrained``."""
    import torch

    AutoModelForCausalLM = _auto_class(spec)  # noqa: N806 (the auto class of the spec's kind)
    dtype = _dtype(spec.get("dtype"))
    attn = spec.get("attn_implementation") or "sdpa"
    pretrained = spec.get("pretrained")
    check_revision(spec)
    if meta or not pretrained:
        config = build_config(spec)
        config._attn_implementation = attn
        ctx = torch.device("meta") if meta else torch.device("cpu")
        with ctx:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype) if dtype else AutoModelForCausalLM.from_config(config)
    else:
        location = resolve_pretrained(pretrained, revision=spec.get("revision"))
        extra = {"revision": spec["revision"]} if spec.get("revision") else {}
        with hub_loading(pretrained):
            model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, attn_implementation=attn, **extra,
                                                         trust_remote_code=bool(spec.get("trust_remote_code", False)))
    if spec.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def numel(p: torch.Tensor) -> int:
    """A parameter's element count, also once DeepSpeed ZeRO-3 has partitioned it (its local tensor is then empty and
    ``ds_numel`` holds the full count)."""
    return getattr(p, "ds_numel", None) or p.numel()


def shape(p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's full shape, also under ZeRO-3 partitioning (``ds_shape``)."""
    return tuple(getattr(p, "ds_shape", None) or p.shape)


def count_parameters(model, non_embedding: bool = False) -> int:
    """Parameters of a model; ``non_embedding`` leaves out token/position embeddings and an untied LM head,
    as scaling-law papers count N."""
    seen, total = set(), 0
    skip = set()
    if non_embedding:
        for mod in (model.get_input_embeddings(), model.get_output_embeddings()):
            if mod is not None:
                skip.update(id(p) for p in mod.parameters())
        for name, mod in model.named_modules():
            if name.endswith(("wpe", "embed_positions")):
                skip.update(id(p) for p in mod.parameters())
    for p in model.parameters():
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        total += numel(p)
    return total
