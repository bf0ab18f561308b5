"""Same-family shrunk twins of paper-scale backbones (``debug=dryrun``).

A backbone spec (``conf/backbone/*.yaml``) names a transformers family and its architecture numbers. Its twin is a
random-init checkpoint of the same transformers class and config family, shrunk for a CPU: 2 layers (one of each
attention type where the family mixes sliding-window and global layers: Gemma, Ministral), 16-wide heads with the
head count cut while the GQA ratio (query heads per KV head) is kept, ``head_dim`` explicit where the spec gives it,
the FFN's ratio to the hidden size kept, fewer experts with top-k kept <= the experts (routing options as given),
the vision tower shrunk to 2 layers and a few patches, and everything else (qk-norm, tied embeddings, rope type
and scaling, soft-capping, norm epsilons) as the spec says. Its tokenizer is the family's stand-in
(``datamodules.common.family_tokenizers``: special tokens, BOS rule, chat template); the vocabulary is the
tokenizer's length and the config's special-token ids are the tokenizer's.

:func:`shrunk_spec` is the twin's spec (``config`` and ``diffusion.mask_token_id`` rewritten; ``pretrained`` left as
it was); :func:`twin_dir` builds the checkpoint once (``save_pretrained`` + tokenizer, + processor for VLMs; LLaDA's
safetensors in LLaDA's own key names, so they load through ``weight_map: llada`` as the release does) and caches it
under ``$PAPERLAB_CACHE/twins/`` keyed by the spec, this file and the library versions.
"""
from __future__ import annotations

import copy
import json
import shutil
from importlib.metadata import version
from pathlib import Path
from typing import Any, Mapping

from datamodules.common.cache import cache_root, stable_hash
from datamodules.common.family_tokenizers import FLAVOURS, family_tokenizer_dir, flavour_of

LAYERS = 2
HEAD_DIM = 16
MAX_EXPERTS = 4
SLIDING_WINDOW = 32  # below the dry run's sequence lengths, so the window really slides
VISION = {"layers": 2, "hidden": 32, "heads": 2, "patches_per_side": 2}

# config attribute -> the special token whose id it holds, by flavour (VLM image placeholders, Gemma-3's markers)
_TOKEN_IDS = {
    "image_token_index": {"llava": "<image>", "gemma3": "<image_soft_token>"},
    "image_token_id": {"llava": "<image>", "gemma3": "<image_soft_token>", "qwen2_vl": "<|image_pad|>"},
    "video_token_id": {"qwen2_vl": "<|video_pad|>"},
    "vision_start_token_id": {"qwen2_vl": "<|vision_start|>"},
    "vision_end_token_id": {"qwen2_vl": "<|vision_end|>"},
    "boi_token_index": {"gemma3": "<start_of_image>"},
    "eoi_token_index": {"gemma3": "<end_of_image>"},
}
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
_FFN = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "n_inner")


def spec_flavour(spec: Mapping[str, Any]) -> tuple[str, bool]:
    """(tokenizer flavour, ships a chat template) of a backbone spec."""
    return flavour_of(spec.get("pretrained"), spec.get("family"), diffusion=bool(spec.get("diffusion")))


def _key(cfg, name: str) -> str:
    """The spelling a config class takes ``name`` in (GPT-2: hidden_size -> n_embd)."""
    return getattr(cfg, "attribute_map", {}).get(name, name)


def _heads(heads: int, kv: int) -> tuple[int, int]:
    """Few heads with the same GQA ratio: ratio r = heads / kv kept, kv cut to max(1, 4 // r)."""
    if not kv or heads % kv:
        return 4, 4
    ratio = heads // kv
    new_kv = max(1, 4 // ratio) if ratio <= 4 else 1
    return ratio * new_kv, new_kv


def _shrink_text(given: Mapping[str, Any], full, tok, flavour: str) -> dict:
    """The text model's kwargs: ``given`` (the spec's) with every size shrunk and the vocabulary the tokenizer's."""
    out = {k: v for k, v in given.items()}
    heads = full.num_attention_heads
    kv = getattr(full, "num_key_value_heads", None) or heads
    new_heads, new_kv = _heads(heads, kv)
    explicit_head_dim = "head_dim" in given
    old_hidden = full.hidden_size
    hidden = new_heads * HEAD_DIM
    if explicit_head_dim:  # keep the ratio of the hidden size to the query width (Gemma-3: 3840 / (16 x 256))
        hidden = max(1, round(hidden * old_hidden / (heads * full.head_dim) / new_heads)) * new_heads
    out[_key(full, "hidden_size")] = hidden
    out[_key(full, "num_attention_heads")] = new_heads
    if hasattr(full, "num_key_value_heads") and getattr(full, "num_key_value_heads", None) is not None:
        out["num_key_value_heads"] = new_kv
    if explicit_head_dim:
        out["head_dim"] = HEAD_DIM
    if "query_pre_attn_scalar" in given:  # Gemma scales queries by head_dim ** -0.5 through this number
        out["query_pre_attn_scalar"] = HEAD_DIM
    for name in _FFN:
        value = getattr(full, name, None)
        if isinstance(value, int) and value > 0:
            out[name] = max(8, round(value / old_hidden * hidden / 8) * 8)
    layer_types = getattr(full, "layer_types", None)
    kinds = list(dict.fromkeys(layer_types or []))
    n_layers = max(LAYERS, len(kinds))
    out[_key(full, "num_hidden_layers")] = n_layers
    if layer_types:
        out["layer_types"] = (kinds + kinds[-1:] * n_layers)[:n_layers]
    if getattr(full, "sliding_window", None):
        out["sliding_window"] = min(int(full.sliding_window), SLIDING_WINDOW)
    for name in _EXPERTS:
        if isinstance(getattr(full, name, None), int) and name in given:
            experts = min(getattr(full, name), MAX_EXPERTS)
            out[name] = experts
            if isinstance(getattr(full, "num_experts_per_tok", None), int):
                out["num_experts_per_tok"] = min(full.num_experts_per_tok, max(1, experts // 2))
    rope = given.get("rope_parameters")
    if isinstance(rope, Mapping) and "mrope_section" in rope:  # Qwen2-VL: sections of head_dim / 2 rotary pairs
        old = list(rope["mrope_section"])
        sections = [max(1, round(s * (HEAD_DIM // 2) / sum(old))) for s in old]
        sections[0] += HEAD_DIM // 2 - sum(sections)
        out["rope_parameters"] = {**rope, "mrope_section": sections}
    out[_key(full, "vocab_size")] = len(tok)
    for name, token in (("bos_token_id", tok.bos_token), ("eos_token_id", tok.eos_token),
                        ("pad_token_id", tok.pad_token)):
        if name in given or getattr(full, name, None) is not None:
            out[name] = tok.convert_tokens_to_ids(token) if token is not None else None
    return out


def _shrink_vision(given: Mapping[str, Any], full, text_hidden: int) -> dict:
    """A vision tower of 2 layers, width 32, 2 heads and a 2 x 2 patch grid (Qwen2-VL: 2 x 2 merged patches)."""
    out = dict(given)
    if getattr(full, "model_type", "") == "qwen2_vl":  # its hidden_size is the merger's output: the LM's width
        out.update(depth=VISION["layers"], embed_dim=VISION["hidden"], num_heads=VISION["heads"],
                   hidden_size=text_hidden)
        return out
    patch = full.patch_size
    old_hidden = full.hidden_size
    out.update(num_hidden_layers=VISION["layers"], hidden_size=VISION["hidden"], num_attention_heads=VISION["heads"],
               image_size=patch * VISION["patches_per_side"])
    if getattr(full, "intermediate_size", None):
        out["intermediate_size"] = round(full.intermediate_size / old_hidden * VISION["hidden"])
    if "projection_dim" in given:
        out["projection_dim"] = VISION["hidden"]
    return out


def shrunk_spec(spec: Mapping[str, Any], flavour: tuple[str, bool] | None = None) -> dict:
    """The twin's spec: ``spec`` with ``config`` shrunk (see the module docstring) and the diffusion mask id mapped
    onto the family tokenizer; ``pretrained`` and every other key as they were. ``flavour``: the tokenizer's
    (flavour, chat) when it is not the spec's own (a from-scratch model trained with another family's tokenizer)."""
    from transformers import AutoTokenizer

    from lightning_modules.common.backbone import build_config

    flavour, chat = flavour or spec_flavour(spec)
    tok = AutoTokenizer.from_pretrained(str(family_tokenizer_dir(flavour, chat)))
    given = dict(spec.get("config") or {})
    full = build_config({**spec, "config": {k: v for k, v in given.items() if not _unresolved(v)}})
    out = copy.deepcopy(dict(spec))
    if "text_config" in given or "vision_config" in given:
        cfg = dict(given)
        text = _shrink_text(dict(given.get("text_config") or {}), full.get_text_config(), tok, flavour)
        cfg["text_config"] = text
        if "vision_config" in given:
            hidden = text.get("hidden_size") or full.get_text_config().hidden_size
            cfg["vision_config"] = _shrink_vision(dict(given["vision_config"]), full.vision_config, hidden)
        if "mm_tokens_per_image" in given:  # Gemma-3 pools the patch grid to a square of tokens: 1 x 1 here
            cfg["mm_tokens_per_image"] = 1
        for name, by_flavour in _TOKEN_IDS.items():
            if hasattr(full, name) and flavour in by_flavour:
                cfg[name] = tok.convert_tokens_to_ids(by_flavour[flavour])
    else:
        cfg = _shrink_text(given, full, tok, flavour)
    out["config"] = cfg
    if spec.get("diffusion"):
        mask = FLAVOURS[flavour].mask or "<|mdm_mask|>"
        out["diffusion"] = {**dict(spec["diffusion"]), "mask_token_id": tok.convert_tokens_to_ids(mask)}
    return out


def _unresolved(value) -> bool:
    return isinstance(value, str) and "${" in value


def twin_key(spec: Mapping[str, Any]) -> str:
    return stable_hash(dict(spec), Path(__file__).read_text(),
                       {lib: version(lib) for lib in ("torch", "transformers", "tokenizers")})


def twin_dir(spec: Mapping[str, Any]) -> Path:
    """The twin checkpoint of ``spec``, built once: a dir ``backbone.pretrained`` and ``data.tokenizer`` can load."""
    from filelock import FileLock

    name = str(spec.get("pretrained") or spec.get("family")).replace("/", "--").replace("${", "").replace("}", "")
    out = cache_root() / "twins" / f"{name}-{twin_key(spec)}"
    if (out / "twin_spec.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "twin_spec.json").exists():
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)  # a build that crashed half way
            _build(spec, tmp, out)
            tmp.rename(out)
    return out


def twin_spec(spec: Mapping[str, Any]) -> dict:
    """The shrunk spec of ``spec``'s built twin (read back from its dir)."""
    return json.loads((twin_dir(spec) / "twin_spec.json").read_text())


def _build(spec: Mapping[str, Any], out: Path, final: Path) -> None:
    """Write the twin into ``out`` (renamed to ``final`` once complete)."""
    import torch
    from transformers import AutoTokenizer

    from lightning_modules.common.backbone import _auto_class, _dtype, build_config

    small = shrunk_spec(spec)
    flavour, chat = spec_flavour(spec)
    tok = AutoTokenizer.from_pretrained(str(family_tokenizer_dir(flavour, chat)))
    config = build_config(small)
    torch.manual_seed(0)
    model = _auto_class(small).from_config(config)
    dtype = _dtype(spec.get("dtype"))
    if dtype is not None:
        model = model.to(dtype)
    out.mkdir(parents=True)
    if spec.get("weight_map") == "llada":  # LLaDA's own key names: loaded through the checked key map as released
        from safetensors.torch import save_file

        from lightning_modules.common.diffusion import llada_key_map

        inverse = {dst: src for src, dst in llada_key_map(config.num_hidden_layers).items()}
        state = {inverse[k]: v.contiguous() for k, v in model.state_dict().items() if k in inverse}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(out))
    else:
        model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    if (spec.get("kind") or "causal_lm") == "image_text_to_text":
        _save_processor(small, tok, out)
    (out / "twin_spec.json").write_text(json.dumps({**small, "pretrained": str(final) if spec.get("pretrained") else None},
                                                   indent=2))


def _save_processor(small: Mapping[str, Any], tok, out: Path) -> None:
    """The VLM's processor at the twin's image size (LLaVA: CLIP's; Qwen2-VL: its own, which needs torchvision)."""
    family, vision = small["family"], small["config"]["vision_config"]
    if family == "llava":
        from transformers import CLIPImageProcessor, LlavaProcessor

        side = vision["image_size"]
        images = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=vision["patch_size"],
                       vision_feature_select_strategy="default", num_additional_image_tokens=1,
                       chat_template=tok.chat_template).save_pretrained(str(out))
    elif family == "qwen2_vl":
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor

        side = 14 * 2 * 2  # a 4 x 4 patch grid: 2 x 2 merged image tokens
        images = Qwen2VLImageProcessor(min_pixels=side * side, max_pixels=side * side)
        try:
            processor = Qwen2VLProcessor(image_processor=images, tokenizer=tok, chat_template=tok.chat_template)
        except Exception as err:  # noqa: BLE001 - its video processor needs torchvision (not on CPU-only machines)
            (out / "processor_missing.txt").write_text(f"Qwen2VLProcessor: {type(err).__name__}: {err}\n")
            images.save_pretrained(str(out))
            return
        processor.save_pretrained(str(out))
