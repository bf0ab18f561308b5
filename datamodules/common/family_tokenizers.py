"""Stand-in tokenizers for the model families of ``conf/backbone``: the project's BPE with each family's special
tokens and chat template (``debug=dryrun``: a run shaped like the real one, with no hub).

A hub checkpoint's tokenizer cannot be downloaded here, but what a run does with it depends on little more than its
special tokens (which of BOS / EOS / PAD / UNK / MASK exist and what they are called), whether it prepends BOS,
and its chat template. A :class:`Flavour` records exactly that for one family; :func:`family_tokenizer` puts it on
the embedded-corpus BPE (``datamodules.common.tokenizer.corpus_tokenizer``, 2048 pieces) and saves the result,
cached by flavour, as a transformers tokenizer directory. The chat templates are our own Jinja, written to produce
the same strings as the families' released templates for plain ``{role, content}`` turns (no tools, no default
system prompts beyond Qwen2-VL's); base checkpoints that ship no template get none, as on the hub, and LLaDA's
``<|mdm_mask|>`` is a plain special token, not the declared mask token, as in its release.

:func:`flavour_of` picks the flavour from a hub id (``Qwen/Qwen2.5-7B-Instruct``) or, without one, the family.
"""
from __future__ import annotations

from dataclasses import dataclass
import shutil
from pathlib import Path

from datamodules.common.cache import cache_root, stable_hash

# --- chat templates (Jinja; our own) -----------------------------------------------------------------------------
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")

LLAMA2 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = '<<SYS>>\\n' + messages[0]['content'] | trim + '\\n<</SYS>>\\n\\n' %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'user' %}"
    "{{- bos_token + '[INST] ' + (system if loop.first else '') + message['content'] | trim + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] | trim + ' ' + eos_token }}{%- endif %}"
    "{%- endfor %}")


def _chatml(default_system: str | None = None, generation_suffix: str = "", images: bool = False) -> str:
    """ChatML (Qwen): ``<|im_start|>role\\ncontent<|im_end|>``; Qwen2-VL's image items as vision pads."""
    content = ("{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
               "{%- for item in message['content'] %}{%- if item['type'] == 'image' %}"
               "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif item['type'] == 'text' %}"
               "{{- item['text'] }}{%- endif %}{%- endfor %}{%- endif %}") if images else "{{- message['content'] }}"
    system = ("{%- if messages[0]['role'] != 'system' %}"
              f"{{{{- '<|im_start|>system\\n{default_system}<|im_end|>\\n' }}}}{{%- endif %}}") if default_system else ""
    return (system + "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}" + content
            + "{{- '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}" + generation_suffix + "{%- endif %}")


QWEN3_HYBRID = ("{%- if enable_thinking is defined and enable_thinking is false %}"
                "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")  # Qwen3-8B: thinking unless switched off


def _gemma(system_allowed: bool) -> str:
    """Gemma: ``<start_of_turn>user|model``; Gemma-3 folds a system turn into the first user turn, Gemma-2 refuses it."""
    head = ("{%- if messages[0]['role'] == 'system' %}"
            + ("{%- set prefix = messages[0]['content'] | trim + '\\n\\n' %}{%- set turns = messages[1:] %}"
               if system_allowed else "{{- raise_exception('System role not supported') }}")
            + "{%- else %}{%- set prefix = '' %}{%- set turns = messages %}{%- endif %}")
    return ("{{- bos_token }}" + head + "{%- for message in turns %}"
            "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
            "{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}"
            "{%- if message['content'] is string %}{{- message['content'] | trim }}{%- else %}"
            "{%- for item in message['content'] %}{%- if item['type'] == 'image' %}{{- '<start_of_image>' }}"
            "{%- elif item['type'] == 'text' %}{{- item['text'] | trim }}{%- endif %}{%- endfor %}{%- endif %}"
            "{{- '<end_of_turn>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")


MISTRAL = (  # Ministral-8B-Instruct-2410 (v3 Tekken): no spaces around [INST]; the system text opens the last user turn
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- set turns = messages %}{%- endif %}"
    "{%- for message in turns %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST]' + ((system + '\\n\\n') if system is not none and loop.last else '') + message['content'] + '[/INST]' }}"
    "{%- else %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}")

R1_DISTILL = (  # DeepSeek-R1 distills: <｜User｜> / <｜Assistant｜>, earlier answers without their reasoning
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] }}"
    "{%- elif message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- else %}{%- set content = message['content'].split('</think>')[-1] %}"
    "{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{%- endif %}")

LLAVA = (  # llava-hf's LLaVA-1.5: "USER: <image>\n... ASSISTANT:"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] + ' ' }}{%- else %}"
    "{{- message['role'] | upper + ': ' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for item in message['content'] %}{%- if item['type'] == 'image' %}{{- '<image>\\n' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- ' ' if message['role'] == 'user' else eos_token }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}")


@dataclass(frozen=True)
class Flavour:
    """One family's tokenizer conventions: the special tokens (None: the family has none), whether BOS is prepended
    to every encoding, other special tokens, and the chat template of its instruct checkpoints (None: none ships).
    ``chat_eos``: the end-of-turn token instruct checkpoints declare as EOS (Llama-3-Instruct's ``<|eot_id|>``)."""
    name: str
    eos: str
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None
    mask: str | None = None          # declared as the tokenizer's mask token
    extra: tuple[str, ...] = ()      # other special tokens (chat markers, image placeholders, LLaDA's <|mdm_mask|>)
    add_bos: bool = False
    template: str | None = None
    chat_eos: str | None = None


_CHATML = ("<|im_start|>", "<|im_end|>")
_LLAMA3 = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_GEMMA = ("<start_of_turn>", "<end_of_turn>")

FLAVOURS = {f.name: f for f in (
    Flavour("llama2", eos="</s>", bos="<s>", unk="<unk>", extra=("[INST]", "[/INST]"), add_bos=True, template=LLAMA2),
    Flavour("llama3", eos="<|end_of_text|>", bos="<|begin_of_text|>", extra=_LLAMA3, add_bos=True, template=LLAMA3,
            chat_eos="<|eot_id|>"),
    Flavour("qwen2", eos="<|endoftext|>", pad="<|endoftext|>", extra=_CHATML, template=_chatml(), chat_eos="<|im_end|>"),
    Flavour("qwen3", eos="<|endoftext|>", pad="<|endoftext|>", extra=(*_CHATML, "<think>", "</think>"),
            template=_chatml(generation_suffix=QWEN3_HYBRID), chat_eos="<|im_end|>"),
    Flavour("qwen3_thinking", eos="<|endoftext|>", pad="<|endoftext|>", extra=(*_CHATML, "<think>", "</think>"),
            template=_chatml(generation_suffix="{{- '<think>\\n' }}"), chat_eos="<|im_end|>"),
    Flavour("qwen2_vl", eos="<|endoftext|>", pad="<|endoftext|>",
            extra=(*_CHATML, "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
            template=_chatml("You are a helpful assistant.", images=True), chat_eos="<|im_end|>"),
    Flavour("gemma2", eos="<eos>", bos="<bos>", pad="<pad>", unk="<unk>", extra=_GEMMA, add_bos=True,
            template=_gemma(system_allowed=False)),
    Flavour("gemma3", eos="<eos>", bos="<bos>", pad="<pad>", unk="<unk>",
            extra=(*_GEMMA, "<start_of_image>", "<end_of_image>", "<image_soft_token>"), add_bos=True,
            template=_gemma(system_allowed=True)),
    Flavour("mistral", eos="</s>", bos="<s>", unk="<unk>", extra=("[INST]", "[/INST]"), add_bos=True, template=MISTRAL),
    Flavour("r1_distill", eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>",
            extra=("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"), add_bos=True, template=R1_DISTILL),
    Flavour("llada", eos="<|endoftext|>", bos="<|startoftext|>", extra=(*_LLAMA3, "<|mdm_mask|>"),
            template=LLAMA3, chat_eos="<|eot_id|>"),
    Flavour("dream", eos="<|endoftext|>", bos="<|beginoftext|>", pad="<|endoftext|>", mask="<|mask|>", extra=_CHATML,
            template=_chatml(), chat_eos="<|im_end|>"),
    Flavour("llava", eos="</s>", bos="<s>", pad="<pad>", unk="<unk>", extra=("<image>",), add_bos=True, template=LLAVA),
    Flavour("gpt2", eos="<|endoftext|>", bos="<|endoftext|>", unk="<|endoftext|>"),
    Flavour("gpt_neox", eos="<|endoftext|>", bos="<|endoftext|>", unk="<|endoftext|>", extra=("<|padding|>",)),
    Flavour("olmoe", eos="<|endoftext|>", pad="<|padding|>"),
    Flavour("t5", eos="</s>", pad="<pad>", unk="<unk>", extra=tuple(f"<extra_id_{i}>" for i in range(100))),
)}

# Hub-id markers, checked in order (lower case); then the family. (flavour, chat template shipped with the id?)
_BY_ID = (
    ("llada", "llada"), ("dream", "dream"), ("r1-distill", "r1_distill"), ("llava", "llava"), ("qwen2-vl", "qwen2_vl"),
    ("qwen3", "qwen3"), ("qwen", "qwen2"), ("gemma-3", "gemma3"), ("gemma-2", "gemma2"), ("mistral", "mistral"),
    ("llama-3", "llama3"), ("llama3", "llama3"), ("llama-2", "llama2"), ("llama2", "llama2"), ("vicuna", "llama2"),
    ("gpt2", "gpt2"), ("pythia", "gpt_neox"), ("gpt-neox", "gpt_neox"), ("olmoe", "olmoe"), ("t5", "t5"),
)
_BY_FAMILY = {"llama": "llama2", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3",
              "mistral": "mistral", "ministral": "mistral", "mixtral": "mistral", "gpt2": "gpt2",
              "gpt_neox": "gpt_neox", "olmoe": "olmoe", "qwen2_vl": "qwen2_vl", "llava": "llava"}
# Which released checkpoints ship a chat template: instruct / chat / -it ones, Qwen's (base ones too), the R1
# distills and the VLMs; LLaMA-2/3 base, Gemma base, Pythia, GPT-2, OLMoE and LLaDA/Dream base ship none.
_CHAT_MARKERS = ("instruct", "-chat", "-it", "thinking")
_ALWAYS_CHAT = ("qwen2", "qwen3", "qwen2_vl", "r1_distill", "llava")


def flavour_of(pretrained: str | None, family: str | None = None, diffusion: bool = False) -> tuple[str, bool]:
    """(flavour name, whether the checkpoint ships a chat template) of a hub id, else of a family.

    ``diffusion``: a masked diffusion backbone without a hub id takes LLaDA's (LLaMA) or Dream's (Qwen2) tokens."""
    hub = (pretrained or "").lower()
    for marker, name in _BY_ID:
        if marker in hub:
            if name == "qwen3" and "thinking" in hub:
                return "qwen3_thinking", True
            return name, name in _ALWAYS_CHAT or any(m in hub for m in _CHAT_MARKERS)
    if diffusion:
        return ("dream" if family == "qwen2" else "llada"), False
    if family not in _BY_FAMILY:
        raise ValueError(f"no tokenizer flavour for family {family!r} (pretrained {pretrained!r}): add one to "
                         "datamodules/common/family_tokenizers.py")
    return _BY_FAMILY[family], False


def build_family_tokenizer(flavour: str, chat: bool):
    """The embedded-corpus BPE with ``flavour``'s special tokens, BOS rule and (``chat``) its chat template."""
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from datamodules.common.tokenizer import corpus_tokenizer

    f = FLAVOURS[flavour]
    raw = Tokenizer.from_str(corpus_tokenizer(2048).backend_tokenizer.to_str())
    eos = f.chat_eos if chat and f.chat_eos else f.eos
    named = [t for t in (f.bos, f.eos, eos, f.pad, f.unk, f.mask) if t]
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys([*named, *f.extra])])
    if f.add_bos:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{f.bos} $A", pair=f"{f.bos} $A {f.bos} $B", special_tokens=[(f.bos, raw.token_to_id(f.bos))])
    else:
        raw.post_processor = None
    extra = [t for t in f.extra if t not in named]
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=f.bos, eos_token=eos, pad_token=f.pad,
                                  unk_token=f.unk, mask_token=f.mask, extra_special_tokens=extra)
    if chat and f.template:
        tok.chat_template = f.template
    return tok


def family_tokenizer_dir(flavour: str, chat: bool) -> Path:
    """A saved family tokenizer (built once, cached by flavour and this file's text)."""
    from filelock import FileLock

    from datamodules.common.corpus import corpus_key

    key = stable_hash(flavour, chat, Path(__file__).read_text(), corpus_key())
    out = cache_root() / "family_tokenizers" / f"{flavour}{'-chat' if chat else ''}-{key}"
    if (out / "tokenizer_config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if not (out / "tokenizer_config.json").exists():
            tmp = out.with_name(out.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)  # a build that crashed half way
            build_family_tokenizer(flavour, chat).save_pretrained(str(tmp))
            tmp.rename(out)
    return out
