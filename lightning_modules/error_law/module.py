"""Accuracy against complexity on repetitive deterministic tasks, and the two-parameter law (arXiv 2601.14175).

The law (``sweeps/laws.py``, the spec's [INF] derivation): the error accumulated over n tokens is a q-dimensional
isotropic walk; the answer is right while its norm stays under the logit margin, so Acc(n) = P(q/2, 1/(r n)) with P
the regularised lower incomplete gamma and r = 2σ²/τ² (``shape: q_half``; ``q`` puts q itself in the shape slot).

The evaluation runs as the test loop: every (task, format, n) cell of the datamodule's grid gets ``samples_per_n``
instances, each scored by exact match of the greedy answer (markers and delimiters stripped); the counts k of m per
cell are fitted at the end by binomial maximum likelihood with the gamma law (both shape conventions), the
exponential (1 − p)^n and a logistic in log n, each also refitted without the largest n and scored on it
(``law.error_report``). Backends:

- ``local``: any backbone (the tiny char-level LLaMA trained here by ``fit``, or ``qwen3_8b``), greedy decoding
  through ``lightning_modules.common.evaluation.greedy_generate``.
- ``endpoint``: an OpenAI-compatible chat endpoint through ``lightning_modules.common.endpoint.EndpointClient``
  (``model.endpoint``: url and model from ``conf/local/``, the key from the environment variable it names; one
  probe request before the grid; responses cached on disk).

Logged: ``test/accuracy`` (mean over cells), per group ``<task>/<format>``: ``test/acc/<group>/<n>``,
``test/r/<group>``, ``test/q/<group>``, ``test/deviance/<group>``, ``test/heldout_abs_err/<group>`` (the main law),
and the mean held-out error of every law ``test/heldout_abs_err/<law>``. ``results.error_law``: ``rows`` (task,
format, n, k, m, acc, ``outcomes``: one 0/1 per instance in index order), ``fits`` (the full report) and a few
predictions; ``law.error_table`` reads the rows.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Mapping

import torch

from lightning_modules.error_law.data import canonical
from lightning_modules.common.evaluation import exact_match, greedy_generate
from lightning_modules.common.lm import CausalLMModule

SHAPES = {"q_half": "error_gamma", "q": "error_gamma_q"}
BACKENDS = ("local", "endpoint")


class ErrorLawModule(CausalLMModule):
    """Trains a backbone on the task stream (``fit``) and measures the accuracy law (``test``).

    Args:
        backbone: the backbone spec (backend=local); ignored for an endpoint.
        backend: ``local`` | ``endpoint``.
        endpoint: ``EndpointClient`` arguments (url, model, api_key_env, cache_dir, max_retries, backoff,
            timeout, params) for backend=endpoint.
        prompt: ``compact`` (``rev:123=``, for models trained here) | ``chat`` (the problem in words through the
            tokenizer's chat template, for instruction-tuned local models); an endpoint always gets ``chat``.
        shape: ``q_half`` | ``q``: which law's (r, q) are logged as the main ones (both are always fitted).
        max_new_tokens: generation budget; None: the longest gold answer of the batch + 2.
        concurrency: endpoint requests in flight at once (within a batch of ``data.eval_batch_size``).
        n_predictions: predictions kept in ``results`` for inspection.
    """

    @classmethod
    def preflight_model(cls, model_cfg: Mapping[str, Any], backbone):
        """No local model behind an endpoint (``common/preflight.py``); else the backbone."""
        from lightning_modules.common.preflight import Trained, default_trained

        if model_cfg.get("backend") == "endpoint":
            return Trained(None, notes=[f"backend=endpoint: the model is {model_cfg['endpoint'].get('model')} behind "
                                        f"{model_cfg['endpoint'].get('url')} (no local weights)"])
        return default_trained(model_cfg, backbone)

    def __init__(self, backbone: Mapping[str, Any] | None = None, optimizer: Callable | None = None,
                 scheduler: Callable | None = None, weight_decay: float = 0.0, backend: str = "local",
                 endpoint: Mapping[str, Any] | None = None, prompt: str = "compact", shape: str = "q_half",
                 max_new_tokens: int | None = None, concurrency: int = 8, n_predictions: int = 16):
        if backend not in BACKENDS:
            raise ValueError(f"model.backend={backend!r}: choose local or endpoint")
        if shape not in SHAPES:
            raise ValueError(f"model.shape={shape!r}: choose q_half (Acc = P(q/2, 1/(r n))) or q (P(q, 1/(r n)))")
        if prompt not in ("compact", "chat"):
            raise ValueError(f"model.prompt={prompt!r}: choose compact or chat")
        if backend == "local" and not backbone:
            raise ValueError("model.backend=local needs a backbone (backbone=...)")
        super().__init__(backbone=backbone or {}, optimizer=optimizer, scheduler=scheduler, weight_decay=weight_decay)
        self.prompt = prompt
        self.backend, self.shape, self.main_law = backend, shape, SHAPES[shape]
        self.max_new_tokens, self.n_predictions, self.concurrency = max_new_tokens, n_predictions, max(1, concurrency)
        self.client = None
        if backend == "endpoint":
            from lightning_modules.common.endpoint import EndpointClient

            self.client = EndpointClient.from_spec(endpoint)  # a missing url or model fails here, before anything runs
        self.records: list[dict] = []
        self.results: dict = {}

    def configure_model(self) -> None:
        if self.backend == "local":
            super().configure_model()

    def _tokenizer(self):
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or getattr(dm, "tokenizer", None) is None:
            raise ValueError("backend=local needs a datamodule with a tokenizer (data: error_law with data.tokenizer)")
        return dm.tokenizer

    def on_test_start(self):
        if self.client is not None:
            self.client.check()  # one probe: a missing key or a wrong url fails before the grid

    def on_test_epoch_start(self):
        self.records = []
        if self.model is not None:
            self.model.eval()

    def answers(self, batch: list[dict]) -> list[str]:
        if self.client is not None:  # requests in flight at once: an API's latency, not its compute, sets the pace
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
                return list(pool.map(self.client.chat, [b["chat"] for b in batch]))
        tok = self._tokenizer()
        budget = self.max_new_tokens or max(len(b["gold"]) for b in batch) + 2
        prompts = [b["prompt"] for b in batch] if self.prompt == "compact" else [
            tok.apply_chat_template([{"role": "user", "content": b["chat"]}], tokenize=False, add_generation_prompt=True)
            for b in batch]
        return greedy_generate(self.model, tok, prompts, max_new_tokens=budget)

    def test_step(self, batch, batch_idx):
        for b, pred in zip(batch, self.answers(batch)):
            ok = exact_match(canonical(pred, b["format"]), b["answer"])
            self.records.append({k: b[k] for k in ("task", "format", "n", "index", "answer")} |
                                {"prediction": pred, "correct": ok})

    def on_test_epoch_end(self):
        import pandas as pd

        from .law import ERROR_LAWS, error_report

        if not self.records:
            return
        cells = defaultdict(dict)
        for r in self.records:
            cells[(r["task"], r["format"], r["n"])][r["index"]] = r["correct"]
        # outcomes: one 0/1 per instance in index order (split-half and bootstrap checks need them)
        rows = [{"task": t, "format": f, "n": n, "k": int(sum(v.values())), "m": len(v), "acc": sum(v.values()) / len(v),
                 "outcomes": "".join(str(int(v[i])) for i in sorted(v))} for (t, f, n), v in sorted(cells.items())]
        with torch.inference_mode(False), torch.enable_grad():  # the test loop runs without autograd; the fit needs it
            report = error_report(pd.DataFrame(rows), ERROR_LAWS)
        self.log("test/accuracy", sum(r["acc"] for r in rows) / len(rows))
        for r in rows:
            self.log(f"test/acc/{r['task']}/{r['format']}/{r['n']}", r["acc"])
        for label, g in report["groups"].items():
            main = g["laws"].get(self.main_law)
            if main is None:
                continue
            self.log(f"test/r/{label}", main["constants"]["r"])
            self.log(f"test/q/{label}", main["constants"]["q"])
            self.log(f"test/deviance/{label}", main["deviance"])
            if "heldout_abs_err" in main:
                self.log(f"test/heldout_abs_err/{label}", main["heldout_abs_err"])
        for law in ERROR_LAWS:
            errs = [g["laws"][law]["heldout_abs_err"] for g in report["groups"].values()
                    if "heldout_abs_err" in g["laws"].get(law, {})]
            if errs:
                self.log(f"test/heldout_abs_err/{law}", sum(errs) / len(errs))
        self.results = {"error_law": {
            "rows": rows, "fits": report, "shape": self.shape, "backend": self.backend,
            "model": self.client.model if self.client is not None else self.backbone_spec.get("pretrained"),
            "endpoint_stats": dict(self.client.stats) if self.client is not None else None,
            "predictions": self.records[: self.n_predictions]}}
        from lightning_modules.common.dashboard import log_table

        log_table("error_law/accuracy", rows, self.loggers)

    def configure_optimizers(self):
        if self.backend == "endpoint":
            raise ValueError("backend=endpoint only evaluates: run it with task=test")
        return super().configure_optimizers()
