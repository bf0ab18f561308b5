"""REAL (issue 23): reasoning-pivot alignment for knowledge-intensive VQA — RPA-SFT, then pivot-guided decoding.

- **Model** (``build_model``): with ``vision`` set, a ``TinyVLM`` (``lightning_modules.real_vqa.vlm``) on the
  backbone's causal LM; ``lora`` wraps the LM only, so the vision tower and projector train in full. With
  ``vision: null`` and a ``kind: image_text_to_text`` backbone (LLaVA, Qwen2-VL), a ``HubVLM``: the same calls, its
  prompts and image tensors from the checkpoint's processor; ``lora`` goes on its language model only.
- **RPA-SFT** (``compute_loss``): the target's segments (``target.py``) weighted λ_p·CE(pivots) + λ_c·CE(conflict)
  + λ_a·CE(answer), each CE the token mean over its segment in the batch; the prompt (image, passages, question)
  is never a label. ``sft.target``: rpa | conflict_only | answer_only.
- **Evaluation** (validation and test, one item at a time): greedy generation of the target gives the
  discriminator's verdict (``discriminator: model``; or ``keyword_mismatch``, Figure 1's baseline); the answer is
  then decoded after ``<answer>`` by ``decoding``: ``greedy``; ``rpgd`` (when the discriminator says conflict, or
  ``rpgd.trigger: always``) against the prompt with the conflicting pivot spans masked (``rpgd.contrast:
  mask_pivot_spans``; the values the discriminator named, else the words the passages disagree on) or only the
  pivot-consistent passages (``pivot_consistent``); ``cad`` against the prompt without passages; ``vcd`` against the
  image mixed with Gaussian noise (``eval.vcd_noise``). The second context runs in a ``ContrastProcessor`` with
  its own KV cache.
- **Metrics**: ``answer_accuracy`` overall (the answer or one of its ``answers`` aliases, exact match) and per kind
  (``acc_clean``, ``acc_true``, ``acc_false``, ``acc_patch_shuffle``) and per benchmark for file items
  (``acc_<dataset>``; the conflict of an item without pivot annotations is unlabelled and not scored); the
  discriminator's ``conflict_accuracy``, ``conflict_f1`` and false-positive rates on
  non-pivot changes (``fpr_false_seen``, ``fpr_false_held_out``); ``malformed`` (unparseable conflict blocks).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import torch

from lightning_modules.common.eval_hooks import TestIsValidation
from lightning_modules.common.lm import CausalLMModule, _plain
from lightning_modules.real_vqa.decoding import DECODINGS, ContrastProcessor, check_alpha_beta, greedy_decode
from lightning_modules.real_vqa.target import (ANSWER_OPEN, SEGMENTS, TARGETS, consistent_passages, keyword_mismatch,
                                               mask_spans, parse_output, prompt_text, target_segments)

CONTRASTS = ("mask_pivot_spans", "pivot_consistent")
TRIGGERS = ("discriminator", "always")
DISCRIMINATORS = ("model", "keyword_mismatch")
SFT_DEFAULTS = {"target": "rpa", "lambda_p": 1.0, "lambda_c": 1.0, "lambda_a": 1.0}
RPGD_DEFAULTS = {"alpha": 1.0, "beta": 0.1, "orthogonalize": True, "trigger": "discriminator",
                 "contrast": "mask_pivot_spans"}
EVAL_DEFAULTS = {"max_new_tokens": 48, "answer_tokens": 12, "vcd_noise": 0.5}


class REALModule(TestIsValidation, CausalLMModule):
    def __init__(self, backbone: Mapping[str, Any], optimizer: Callable | None = None, scheduler: Callable | None = None,
                 weight_decay: float = 0.0, vision: Mapping | None = None, sft: Mapping | None = None,
                 rpgd: Mapping | None = None, decoding: str = "rpgd", discriminator: str = "model",
                 lora: Mapping | None = None, max_length: int | None = 512, eval: Mapping | None = None, seed: int = 0):
        super().__init__(backbone, optimizer, scheduler, weight_decay)
        self.sft = {**SFT_DEFAULTS, **_plain(sft or {})}
        self.rpgd = {**RPGD_DEFAULTS, **_plain(rpgd or {})}
        self.eval_cfg = {**EVAL_DEFAULTS, **_plain(eval or {})}
        for name, value, allowed in (("model.decoding", decoding, DECODINGS), ("model.sft.target", self.sft["target"], TARGETS),
                                     ("model.rpgd.contrast", self.rpgd["contrast"], CONTRASTS),
                                     ("model.rpgd.trigger", self.rpgd["trigger"], TRIGGERS),
                                     ("model.discriminator", discriminator, DISCRIMINATORS)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: choose one of {', '.join(allowed)}")
        check_alpha_beta(float(self.rpgd["alpha"]), float(self.rpgd["beta"]))
        self.vision = _plain(vision) if vision else None
        if self.vision is not None:
            from lightning_modules.real_vqa.vlm import check_vision

            self.vision = check_vision(self.vision)
        kind = self.backbone_spec.get("kind") or "causal_lm"
        if self.vision is None and kind == "causal_lm":
            if decoding == "vcd":
                raise ValueError("model.decoding=vcd contrasts images but the model is text-only: set model.vision "
                                 "(TinyVLM) or an image_text_to_text backbone")
        if self.sft["target"] == "answer_only" and discriminator == "model" and (
                decoding == "rpgd" and self.rpgd["trigger"] == "discriminator"):
            raise ValueError("sft.target=answer_only trains no conflict discriminator: set model.discriminator="
                             "keyword_mismatch or model.rpgd.trigger=always")
        self.decoding, self.discriminator = decoding, discriminator
        self.lora, self.max_length, self.seed = (_plain(lora) if lora else None), max_length, seed
        self.hparams["lora"] = self.lora
        self.tokenizer = None
        self.image_token_id = None
        self._eval: dict[str, list[float]] = {}
        self.results: dict[str, Any] = {}

    # --- model ------------------------------------------------------------------------------------
    @property
    def hub(self) -> bool:
        """A hub VLM backbone (``HubVLM``) rather than TinyVLM on a causal LM."""
        return self.vision is None and (self.backbone_spec.get("kind") or "causal_lm") == "image_text_to_text"

    def setup(self, stage: str) -> None:
        """The first hook of a run, before any weight loads."""
        if self.vision is None and not self.hub:
            raise ValueError("REALModule needs a VLM: set model.vision (TinyVLM on this causal LM) or a backbone with "
                             "kind: image_text_to_text (a text-only model has no image to read)")

    def get_tokenizer(self):
        if self.tokenizer is None:
            dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
            if dm is None or not hasattr(dm, "tokenizer"):
                raise ValueError("REAL needs a datamodule with .tokenizer (data=kivqa)")
            self.set_tokenizer(dm.tokenizer)
        return self.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        from lightning_modules.real_vqa.vlm import add_image_token

        self.tokenizer = tokenizer
        self.image_token_id = add_image_token(tokenizer) if self.vision is not None else None

    def build_model(self):
        from lightning_modules.real_vqa.vlm import build_hub_vlm, build_vlm

        if self.hub:
            model = build_hub_vlm(self.backbone_spec)
        else:
            if self.image_token_id is None:
                self.get_tokenizer()
            model = build_vlm(self.backbone_spec, self.image_token_id, self.vision)
            if model.image_token_id < model.lm.config.vocab_size:
                raise ValueError(f"<image> id {model.image_token_id} is inside the LM's vocabulary "
                                 f"({model.lm.config.vocab_size}): the tokenizer and backbone disagree")
        if self.lora:
            model.apply_lora(**self.lora)
        return model

    def forward(self, input_ids, attention_mask=None, **kw):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kw)

    # --- batches ----------------------------------------------------------------------------------
    def prompt_ids(self, item: dict, passages: list[str] | None = None) -> list[int]:
        """The image's tokens, then passages and question (a hub VLM: through its processor)."""
        text = prompt_text(item, "", passages)
        if self.hub:
            return self.model.prompt_ids(text, item["image"])
        tok = self.get_tokenizer()
        return [self.image_token_id] * self.model.num_patches + tok(text, add_special_tokens=False)["input_ids"]

    def pixels(self, items: list[dict]) -> torch.Tensor | dict[str, torch.Tensor]:
        """The images as the model takes them: a (B, 3, H, W) tensor (TinyVLM) or the image processor's tensors."""
        if self.hub:
            return self.model.image_inputs([it["image"] for it in items], self.device)
        from lightning_modules.real_vqa.data import to_pixels

        return torch.stack([to_pixels(it["image"]) for it in items]).to(self.device)

    def sft_batch(self, items: list[dict]) -> dict:
        """Right-padded prompt + target + EOS rows; ``segments`` holds each label's segment index (−1: none)."""
        tok = self.get_tokenizer()
        rows, segs = [], []
        for it in items:
            ids = self.prompt_ids(it)
            seg = [-1] * len(ids)
            parts = target_segments(it, self.sft["target"])
            for j, (name, text) in enumerate(parts):
                piece = tok(text, add_special_tokens=False)["input_ids"]
                if j == len(parts) - 1:
                    piece = piece + [tok.eos_token_id]
                ids, seg = ids + piece, seg + [SEGMENTS.index(name)] * len(piece)
            if self.max_length is not None and len(ids) > self.max_length:
                raise ValueError(f"an example has {len(ids)} tokens > model.max_length={self.max_length}: raise it "
                                 "(data.seq_len)")
            rows.append(ids)
            segs.append(seg)
        width = max(map(len, rows))
        pad = tok.pad_token_id
        return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows], device=self.device),
                "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device),
                "segments": torch.tensor([s + [-1] * (width - len(s)) for s in segs], device=self.device),
                "pixel_values": self.pixels(items)}

    def segment_losses(self, batch: dict) -> dict[str, torch.Tensor]:
        """Token-mean next-token CE of each segment present in the batch."""
        kw = {"pixel_values": batch["pixel_values"]} if batch.get("pixel_values") is not None else {}
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                            **kw).logits[:, :-1].float()
        target, seg = batch["input_ids"][:, 1:], batch["segments"][:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target.clamp_max(logits.shape[-1] - 1),
                                                reduction="none")
        out = {}
        for i, name in enumerate(SEGMENTS):
            m = seg == i
            if m.any():
                out[name] = (nll * m).sum() / m.sum()
        return out

    def compute_loss(self, batch) -> torch.Tensor:
        if isinstance(batch, list):
            batch = self.sft_batch(batch)
        parts = self.segment_losses(batch)
        weight = {"pivots": self.sft["lambda_p"], "conflict": self.sft["lambda_c"], "answer": self.sft["lambda_a"]}
        for name, v in parts.items():
            self.log(f"train/ce_{name}", v.detach(), on_step=True, on_epoch=False, batch_size=batch["input_ids"].shape[0])
        return sum(float(weight[n]) * v for n, v in parts.items())

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=len(batch))
        return loss

    # --- decoding ---------------------------------------------------------------------------------
    def contrast_inputs(self, item: dict, verdict: dict, pixels) -> tuple[list[int], torch.Tensor | None]:
        """The second context of ``decoding`` (prompt ids without the target prefix, and its image)."""
        if self.decoding == "cad":
            return self.prompt_ids(item, []), pixels
        if self.decoding == "vcd":
            from datamodules.common.splits import unit_hash

            # the same noise for an item in every run (str hash() is salted per process)
            g = torch.Generator().manual_seed(self.seed * 7919 + int(unit_hash(item["key"]) * 2**31))
            clean = pixels["pixel_values"] if self.hub else pixels  # noise in the model's normalised pixel space
            noise = torch.randn(clean.shape, generator=g).to(clean)
            gamma = float(self.eval_cfg["vcd_noise"])
            noised = (1 - gamma) * clean + gamma * noise
            return self.prompt_ids(item), ({**pixels, "pixel_values": noised} if self.hub else noised)
        values = verdict.get("values") or differing_words(item["passages"])
        if self.rpgd["contrast"] == "pivot_consistent":
            return self.prompt_ids(item, consistent_passages(item["passages"], values)), pixels
        return self.prompt_ids(item, mask_spans(item["passages"], values)), pixels

    @torch.no_grad()
    def answer(self, item: dict) -> dict:
        """Discriminator verdict, whether the contrast ran, and the decoded answer of one item."""
        tok = self.get_tokenizer()
        pixels = self.pixels([item])
        prompt = self.prompt_ids(item)
        ids = torch.tensor([prompt], device=self.device)
        verdict, prefix = {"conflict": False, "values": [], "malformed": False}, ANSWER_OPEN
        first = None
        if self.sft["target"] != "answer_only":
            gen = greedy_decode(self.model, ids, int(self.eval_cfg["max_new_tokens"]), tok.eos_token_id, pixels)
            first = tok.decode(gen, skip_special_tokens=True)
            verdict = parse_output(first)
            cut = first.find(ANSWER_OPEN)
            prefix = first[:cut + len(ANSWER_OPEN)] if cut >= 0 else first + ANSWER_OPEN
        if self.discriminator == "keyword_mismatch":
            verdict = {**verdict, "conflict": keyword_mismatch(item["passages"]), "values": []}
        contrast = self.decoding in ("cad", "vcd") or (
            self.decoding == "rpgd" and (self.rpgd["trigger"] == "always" or verdict["conflict"]))
        if not contrast and first is not None and first.find(ANSWER_OPEN) >= 0:
            text = first[first.find(ANSWER_OPEN):]  # greedy: the first pass already decoded the answer
        else:
            pre = tok(prefix, add_special_tokens=False)["input_ids"]
            processor = None
            if contrast:
                c_ids, c_pix = self.contrast_inputs(item, verdict, pixels)
                processor = ContrastProcessor(self.model, torch.tensor([c_ids + pre], device=self.device), self.decoding,
                                              float(self.rpgd["alpha"]), float(self.rpgd["beta"]),
                                              bool(self.rpgd["orthogonalize"]), pixel_values=c_pix)
            full = torch.tensor([prompt + pre], device=self.device)
            gen = greedy_decode(self.model, full, int(self.eval_cfg["answer_tokens"]), tok.eos_token_id, pixels, processor)
            text = ANSWER_OPEN + tok.decode(gen, skip_special_tokens=True)
        return {**verdict, "contrast": contrast, "answer": parse_output(text)["answer"], "raw": first}

    # --- evaluation -------------------------------------------------------------------------------
    def on_validation_epoch_start(self):
        self._eval = {}

    def _add(self, key: str, value: float):
        s = self._eval.setdefault(key, [0.0, 0.0])
        s[0] += value
        s[1] += 1

    def validation_step(self, batch: list[dict], batch_idx):
        was = self.model.training
        self.model.eval()
        for it in batch:
            out = self.answer(it)
            correct = float(out["answer"] is not None and out["answer"] in it.get("answers", [it["answer"]]))
            self._add("answer_accuracy", correct)
            self._add(f"acc_{it['kind']}", correct)
            if it.get("dataset") not in (None, it["kind"]):  # an annotated file item: its benchmark's accuracy too
                self._add(f"acc_{it['dataset']}", correct)
            self._add("contrast_rate", float(out["contrast"]))
            if it["conflict"] is None or (self.sft["target"] == "answer_only" and self.discriminator == "model"):
                continue  # no gold conflict label (a plain file item) or no discriminator to score
            pred, gold = bool(out["conflict"]), bool(it["conflict"])
            self._add("conflict_accuracy", float(pred == gold))
            for name, hit in (("tp", pred and gold), ("fp", pred and not gold), ("fn", gold and not pred)):
                self._add(name, float(hit))
            if self.discriminator == "model":
                self._add("malformed", float(out["malformed"]))
            if it["kind"] == "false":
                self._add("fpr_false_held_out" if it.get("held_out") else "fpr_false_seen", float(pred))
        self.model.train(was)

    def _eval_end(self, prefix: str):
        keys = sorted(self._eval)
        if not keys:
            return
        tot = torch.tensor([self._eval[k] for k in keys], dtype=torch.float64, device=self.device)
        if self.trainer.world_size > 1:
            tot = self.trainer.strategy.reduce(tot, reduce_op="sum")
        sums = {k: (float(t[0]), float(t[1])) for k, t in zip(keys, tot)}
        rates = {k: s / max(n, 1) for k, (s, n) in sums.items() if k not in ("tp", "fp", "fn")}
        if "tp" in sums:
            tp, fp, fn = sums["tp"][0], sums["fp"][0], sums["fn"][0]
            rates["conflict_f1"] = 2 * tp / max(2 * tp + fp + fn, 1)
        for k, v in rates.items():
            self.log(f"{prefix}/{k}", v, prog_bar=k == "answer_accuracy", sync_dist=False)
        self.results[prefix] = rates


def differing_words(passages: list[str]) -> list[str]:
    """The words not shared by every passage (what to mask when the discriminator named no values)."""
    sets = [set(re.findall(r"[A-Za-z]+", p)) for p in passages]
    return sorted(set.union(*sets) - set.intersection(*sets)) if sets else []
