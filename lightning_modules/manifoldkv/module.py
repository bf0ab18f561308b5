"""Evaluate a backbone under a KV-cache press on the RULER-style suite (ManifoldKV, arXiv 2602.08343).

The paper's procedure is an evaluation, so it runs as the module's test loop (``task: test``): for every sample the
context is prefilled under the press (compressed once), the question + answer prefix are appended after
compression and the answer is greedy-decoded (``kv_press.prefill_and_answer``). Scored by RULER's string match
(all references; any reference for ``qa_*`` tasks) after kvpress's clean-up of the prediction, reported x100 as
RULER does.

Logged: ``test/accuracy`` (mean over task x length cells), ``test/acc/<task>/<length>``, ``test/answer_nll``
(teacher-forced NLL per token of the first reference: a graded signal where a tiny model scores 0 on RULER),
``test/kv_kept_fraction`` (KV entries kept / context entries; for AdaKV the unmasked fraction),
``test/prefill_ms`` and ``test/decode_ms_per_token``. ``self.results`` holds the per-task table, the mean
per-(layer, head) retained fraction (the budgets AdaKV hands out) and a few predictions.

Switches (config groups, each press chosen by ``_target_``):
    model/press=manifoldkv | windowed_manifoldkv | keydiff | knorm | snapkv | streaming | random
        (conf/model/press/*.yaml; a paper adds its own file there). Every press takes ``compression_ratio``: the
        fraction of KV pairs removed (paper: 0.2 on RULER 4K-16K, 0.4/0.5 multi-key, 0.25 at 64K).
        ManifoldKV: ``window_size`` (null = global centroid; 4096 = WindowedManifoldKV), ``pre_rope`` (false =
        post-RoPE cache keys, the kvpress hook; true = the rotation undone), ``distance`` (l2, the method | l1 |
        linf | cosine: the paper's ablation, cosine 52.8, Linf 71.2, L1 78.5, L2 92.7). SnapKV: ``window_size``,
        ``kernel_size``. StreamingLLM: ``n_sink``.
    model/press_wrapper=adakv | block | null (conf/model/press_wrapper/*.yaml: a partial that takes the inner press;
        the paper's RULER numbers are with Ada-KV, ``alpha_safeguard`` 0.2; Block: ``block_size``).
Keys are the post-RoPE cached keys (the spec's [INF]; the sources are silent).
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable, Mapping

import torch

from lightning_modules.common.evaluation import string_match_all, string_match_part
from lightning_modules.common.kv_press import Press, prefill_and_answer
from lightning_modules.common.lm import CausalLMModule


class KVPressEvalModule(CausalLMModule):
    """A backbone evaluated on the RULER-style suite under one press and ratio.

    Args:
        backbone: backbone spec (paper scale: llama31_8b / qwen3_8b / ministral_8b / gemma3_12b; tiny: the cached
            tiny-lm).
        press: the press (``model/press``); ``None`` or ratio 0 = the uncompressed baseline.
        press_wrapper: a callable ``press_wrapper(press=press)`` returning the wrapped press (``model/press_wrapper``,
            a partial of AdaKV or Block), or ``None``.
        max_new_tokens: cap on generated tokens (each task has RULER's own budget; the smaller is used).
        n_predictions: how many predictions to keep in ``results`` for inspection.
    """

    def __init__(self, backbone: Mapping[str, Any], press: Press | None = None,
                 press_wrapper: Callable[..., Press] | None = None, max_new_tokens: int | None = None,
                 n_predictions: int = 8):
        super().__init__(backbone=backbone)
        if press is not None and not isinstance(press, Press):  # e.g. a leftover mapping without _target_
            raise ValueError(f"model.press={press!r} is not a press: choose one with model/press=<name> "
                             "(conf/model/press/*.yaml)")
        if press_wrapper is not None and press is None:
            raise ValueError("model/press_wrapper wraps a press: choose one with model/press=<name>, or "
                             "model/press_wrapper=null")
        self.press = press_wrapper(press=press) if press_wrapper is not None else press
        self.press_spec = self.press.spec() if self.press is not None else None
        self.hparams["press"] = self.press_spec  # plain data: what ran (the wrapper is folded in)
        self.hparams.pop("press_wrapper", None)
        self.max_new_tokens = max_new_tokens
        self.n_predictions = n_predictions
        self.rows: list[dict] = []
        self.results: dict = {}

    def _tokenizer(self):
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "tokenizer"):
            raise ValueError("KVPressEvalModule needs a datamodule with a tokenizer (data: ruler)")
        return dm.tokenizer

    def on_test_epoch_start(self):
        self.rows = []
        self.model.eval()

    def test_step(self, sample, batch_idx):
        tok = self._tokenizer()
        budget = int(sample["max_new_tokens"])
        if self.max_new_tokens:
            budget = min(budget, self.max_new_tokens)
        out = prefill_and_answer(self.model, self.press, sample["context_ids"], [sample["question_ids"]],
                                 max_new_tokens=budget, eos_token_id=tok.eos_token_id, gold=[sample["gold_ids"]])
        # kvpress's RULER scorer strips control characters before matching
        pred = re.sub(r"[\x00-\x1f]", "", tok.decode(out.answers[0], skip_special_tokens=True).strip()).strip()
        metric = string_match_part if sample["task"].startswith("qa") else string_match_all
        self.rows.append({
            "task": sample["task"], "length": int(sample["length"]), "score": 100.0 * metric(pred, sample["outputs"]),
            "answer_nll": out.answer_nll[0], "kv_kept_fraction": out.summary["kv_kept_fraction"],
            "kept_per_head": out.summary["kept_per_head"], "context_tokens": int(sample["context_ids"].numel()),
            "prefill_s": out.prefill_s, "decode_s": out.decode_s, "new_tokens": max(1, len(out.answers[0])),
            "prediction": pred, "outputs": list(sample["outputs"])})

    def on_test_epoch_end(self):
        rows = self.rows
        if not rows:
            return
        cells = defaultdict(list)
        for r in rows:
            cells[(r["task"], r["length"])].append(r["score"])
        per_cell = {f"{t}/{n}": sum(v) / len(v) for (t, n), v in sorted(cells.items())}
        for name, acc in per_cell.items():
            self.log(f"test/acc/{name}", acc)
        mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
        nlls = [r["answer_nll"] for r in rows if r["answer_nll"] is not None]
        self.log("test/accuracy", mean(list(per_cell.values())))
        self.log("test/answer_nll", mean(nlls))
        self.log("test/kv_kept_fraction", mean([r["kv_kept_fraction"] for r in rows]))
        self.log("test/prefill_ms", 1000 * mean([r["prefill_s"] for r in rows]))
        self.log("test/decode_ms_per_token", 1000 * sum(r["decode_s"] for r in rows) / sum(r["new_tokens"] for r in rows))
        budgets = {}
        for r in rows:
            length = r["context_tokens"]
            for layer, kept in r["kept_per_head"].items():
                budgets.setdefault(str(layer), []).append([k / length for k in kept])
        self.results = {
            "press": self.press_spec,
            "accuracy_per_task": per_cell,
            "retained_fraction_per_head": {layer: torch.tensor(v).mean(0).tolist() for layer, v in budgets.items()},
            "predictions": [{k: r[k] for k in ("task", "length", "context_tokens", "prediction", "outputs", "score")}
                            for r in rows[: self.n_predictions]],
        }
        from lightning_modules.common.dashboard import heatmap, log_table

        press = str(self.press_spec)  # the press and its ratio: a sweep's runs line up in W&B by this column
        log_table("kv/accuracy", [{"task": c.split("/")[0], "length": int(c.split("/")[1]), "press": press,
                                   "accuracy": a} for c, a in per_cell.items()], self.loggers)
        heads = self.results["retained_fraction_per_head"]
        heatmap("kv/retained_fraction_per_head", [heads[k] for k in heads], self.loggers, xlabel="KV head",
                ylabel="layer", yticks=list(heads))
