"""Calibrate-then-quantize as a Lightning test loop, for any ``Quantizer``: the module every quantization paper
subclasses. The quantizer is an object (Hydra builds it from ``conf/model/quantizer/<name>.yaml``'s ``_target_``);
without one the module runs the common GPTQ baseline.

``on_test_start``: draw ``n_calib`` calibration sequences from the datamodule's training split (seeded; null = all
of it, the WaterSIC release's default ``nsamples=None``), run the
driver (``driver.quantize_model``) on the backbone in place, and keep a full-precision copy as the reference.
``test_step``: token NLL of the quantized model (``test/ppl``), of the reference (``test/ppl_fp``) and
KL(P_fp ‖ P_q) in bits per token (``test/kl_bits``, ``evaluation.kl_bits_per_token``), token-weighted over the
split. Rates go to ``quant/*`` and the per-layer table to ``metrics.json['results']``.
Perplexity is exp of the mean NLL over fixed-length non-overlapping sequences, as the paper evaluates.
"""
from __future__ import annotations

import copy
import inspect
import math
from typing import Any, Mapping

import torch

from lightning_modules.common.lm import CausalLMModule
from lightning_modules.common.quantize.base import Quantizer
from lightning_modules.common.quantize.driver import quantize_model
from lightning_modules.common.quantize.gptq import GPTQ


class QuantizeLMModule(CausalLMModule):
    """Args:
        backbone: backbone spec (a pretrained one: ``tiny-lm`` or a hub id / local dir).
        quantizer: a ``Quantizer`` (config group ``model/quantizer``: rtn | gptq | huffman_gptq | watersic | a
            paper's own); None = ``default_quantizer()``, GPTQ for this base class.
        rate: target bits per quantized weight (entropy + side information; log2 levels for RTN/GPTQ).
        mode: ``plain`` (Σ from the full-precision model) or ``sequential`` (Qronos statistics).
        rate_control: one global budget over all layers (fractional-rate methods only).
        n_calib / calib_batch_size / calib_seed: calibration sequences from the training split (None: all of it).
        kl: also evaluate the full-precision reference (``test/ppl_fp``, ``test/kl_bits``).
        stats_device: where plain mode keeps all layers' Σ (``cpu`` at paper scale); null = the model's device.
        with_limit: compute each layer's Gaussian R(D) at its achieved distortion (``quant/rd_limit``).
        eval_sets: held-out texts, name -> {files, text_field ('text'), join, max_documents, max_windows}: each
            reports ``eval/<name>/ppl``, ``…/ppl_fp`` and ``…/kl_bits`` over non-overlapping ``eval_seq_len``
            windows. ``join``: a string (WikiText-2's standard "\n\n": every row of the split, empty lines
            included, as one text tokenized once) or null (non-empty documents, each followed by EOS);
            ``max_documents`` / ``max_windows`` cut the split (C4 validation: GPTQ's 1100 documents, 256 windows).
        residual_compensation / attn_weighted_qkv (ε, null = off) / zero_out_rows ({name substring: [rows]}) /
            eps_search, eps_steps: WaterSIC's pipeline extras (``driver.py``; sequential mode; off by default as in
            the release's CLI, on in the paper-scale experiments).
        export_packed: a directory (e.g. ``${paths.output_dir}/packed``): after quantization every quantized linear
            is packed to 4 bits in place (``export.py``: rtn, gptq, awq; WaterSIC cannot) and the checkpoint written
            there; the test loop then runs the packed model, and ``quant/bytes_*`` report its size. null = off.
        offload: keep the backbone and its reference in host memory and bring one block at a time to the GPU: the
            driver quantizes block by block from carried hidden states and the evaluation streams the blocks
            (``offload.py``), so a model larger than one GPU runs on one (Llama-3-70B on an 80 GB card). Off by
            default: a model that fits runs faster on the GPU whole.
        method: removed (the old string registry); set, it fails with one line naming ``model/quantizer=<name>``.
    """

    def __init__(self, backbone: Mapping[str, Any], quantizer: Quantizer | None = None,
                 rate: float = 3.0, mode: str = "plain", rate_control: bool = True, n_calib: int | None = 32,
                 calib_batch_size: int = 8, calib_seed: int = 0, kl: bool = True, with_limit: bool = True,
                 eval_sets: Mapping[str, Mapping[str, Any]] | None = None, eval_seq_len: int = 2048,
                 eval_batch_size: int = 4, stats_device: str | None = None, residual_compensation: bool = False,
                 attn_weighted_qkv: float | None = None, zero_out_rows: Mapping[str, list[int]] | None = None,
                 eps_search: bool = False, eps_steps: int = 10, export_packed: str | None = None, optimizer=None,
                 scheduler=None, weight_decay: float = 0.0, offload: bool = False, method: str | None = None):
        if method is not None:
            raise ValueError(f"model.method={method} is gone: choose the quantizer with model/quantizer={method}")
        quantizer = self.default_quantizer() if quantizer is None else quantizer
        if not isinstance(quantizer, Quantizer):
            raise ValueError(f"model.quantizer must build a Quantizer (a _target_ in conf/model/quantizer/), "
                             f"got {type(quantizer).__name__}")
        super().__init__(backbone, optimizer=optimizer, scheduler=scheduler, weight_decay=weight_decay)
        self.quantizer = quantizer
        self.hparams["quantizer"] = quantizer_spec(quantizer)  # plain data, for hparams.yaml and checkpoints
        self.method, self.rate, self.mode, self.rate_control = quantizer.name, rate, mode, rate_control
        self.n_calib, self.calib_batch_size, self.calib_seed = n_calib, calib_batch_size, calib_seed
        self.kl, self.with_limit = kl, with_limit
        self.eval_sets = {k: eval_set(k, **v) for k, v in (eval_sets or {}).items()}
        self.eval_seq_len, self.eval_batch_size = eval_seq_len, eval_batch_size
        self.stats_device = stats_device
        self.extras = {"residual_compensation": residual_compensation, "attn_weighted_qkv": attn_weighted_qkv,
                       "zero_out_rows": dict(zero_out_rows or {}), "eps_search": eps_search, "eps_steps": eps_steps}
        if mode != "sequential" and (residual_compensation or attn_weighted_qkv is not None or eps_search):
            raise ValueError("model.residual_compensation / attn_weighted_qkv / eps_search need model.mode=sequential")
        if export_packed and quantizer.no_grid_reason:
            raise ValueError(f"model.export_packed: {quantizer.name} cannot be packed to 4 bits: "
                             f"{quantizer.no_grid_reason}; use model/quantizer=rtn|gptq, or unset export_packed")
        self.export_packed = export_packed
        self.offload = offload
        self._reference: list = []  # a list, so the copy is not registered as a submodule (or checkpointed)
        self.quantized = False
        self.results: dict = {}

    def configure_model(self) -> None:
        if not self.offload or self.model is not None:
            return super().configure_model()
        # kept out of the module tree, so Lightning's move to the GPU leaves it in host memory (``offload``)
        object.__setattr__(self, "model", self.build_model().eval())

    @staticmethod
    def default_quantizer() -> Quantizer:
        """The method a subclass runs when the config names none (each paper overrides this with its own)."""
        return GPTQ()

    @classmethod
    def preflight_model(cls, model_cfg: Mapping[str, Any], backbone):
        """The model quantized in place, and its full-precision reference copy when ``kl`` or ``mode: sequential``
        keeps one (``common/preflight.py``)."""
        from lightning_modules.common.preflight import default_trained

        trained = default_trained(model_cfg, backbone)
        if model_cfg.get("kl", True) or model_cfg.get("mode") == "sequential":
            trained.copies = 1
            trained.notes.append("a full-precision reference copy is held beside the quantized model")
        if model_cfg.get("offload"):
            trained.offload_blocks = True
            trained.notes.append("model.offload: the blocks stay in host memory; one (and its reference) on the GPU "
                                 "at a time, plus the calibration hidden states in host memory")
        return trained

    @property
    def reference(self):
        return self._reference[0] if self._reference else None

    def calibration_batches(self) -> list[dict]:
        dm = self.trainer.datamodule if self._trainer is not None else None
        dataset = getattr(dm, "train_set", None)
        if dataset is None:
            raise ValueError("quantization needs calibration data: the datamodule must provide train_set (data=corpus)")
        n = len(dataset) if self.n_calib is None else self.n_calib
        if len(dataset) < n or n == 0:
            raise ValueError(f"model.n_calib={self.n_calib} but the training split holds {len(dataset)} sequences")
        idx = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(self.calib_seed))[:n]
        seqs = [dataset[int(i)]["input_ids"] for i in idx]
        return [{"input_ids": torch.stack(seqs[i:i + self.calib_batch_size])}
                for i in range(0, len(seqs), self.calib_batch_size)]

    def quantize(self, batches: list[dict]) -> dict:
        if self.kl or self.mode == "sequential":
            self._reference = [copy.deepcopy(self.model).eval().requires_grad_(False)]
        report = quantize_model(self.model, self.quantizer, batches, self.rate,
                                mode=self.mode, rate_control=self.rate_control, reference=self.reference,
                                with_limit=self.with_limit, stats_device=self.stats_device,
                                offload=str(self.device) if self.offload else None, **self.extras)
        if self.offload:  # evaluation forwards: each block visits the GPU in turn
            from lightning_modules.common.quantize.offload import stream_blocks

            for m in filter(None, (self.model, self.reference)):
                stream_blocks(m, self.device)
        self.quantized = True
        self.results = {"quantization": {"method": self.method, "mode": self.mode, "target_rate": self.rate,
                                         **report["summary"]}, "layers": report["layers"]}
        return report

    def on_test_start(self):
        if not self.quantized:
            report = self.quantize(self.calibration_batches())
            if self.export_packed:
                self.results["packed"] = self.export(report)

    def quantized_backbone(self):
        """The module the driver quantized (its layer names are the report's)."""
        return self.model

    def export(self, report: dict) -> dict:
        """Pack every quantized linear to 4 bits in place and write the checkpoint to ``export_packed``; returns
        the bytes in memory before and after and on disk."""
        from lightning_modules.common.quantize.export import pack_model, save_packed, storage_bytes

        backbone = self.quantized_backbone()
        before = storage_bytes(backbone)
        names = pack_model(backbone, report["grids"], report["input_scales"], quantizer=self.quantizer)
        path = save_packed(backbone, self.export_packed, names)
        return {"dir": str(path), "layers": len(names), "bytes_memory_fp": before,
                "bytes_memory": storage_bytes(backbone), "bytes_disk": sum(f.stat().st_size for f in path.iterdir())}

    def on_test_epoch_start(self):
        super().on_test_epoch_start()
        self._fp_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self._kl_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self._kl_pos = torch.zeros((), device=self.device, dtype=torch.float64)

    def test_step(self, batch, batch_idx):
        ref = self.reference
        if ref is None or not self.kl:
            return super().test_step(batch, batch_idx)
        nll_q, nll_fp, kl_sum, n_tok, n_pos = nll_and_kl(self.model, ref, batch)
        self._val_sum += nll_q
        self._val_count += n_tok
        self._fp_sum += nll_fp
        self._kl_sum += kl_sum
        self._kl_pos += n_pos

    def on_test_epoch_end(self):
        super().on_test_epoch_end()
        if self.reference is not None and self.kl:
            self.log("test/ppl_fp", torch.exp(self._fp_sum / self._val_count.clamp_min(1)).float())
            self.log("test/kl_bits", (self._kl_sum / self._kl_pos.clamp_min(1)).float())
        for name, spec in self.eval_sets.items():
            for k, v in self.evaluate_text(name, spec).items():
                self.log(k, v)
        for key in ("bits", "bits_pooled", "bits_column", "bits_cardinality", "rd_limit", "rel_mse"):
            val = self.results.get("quantization", {}).get(key)
            if val is not None:
                self.log(f"quant/{key}", float(val))
        for key in ("bytes_memory_fp", "bytes_memory", "bytes_disk"):
            if key in self.results.get("packed", {}):
                self.log(f"quant/{key}", float(self.results["packed"][key]))
        self.dashboard(self.results.get("layers") or [])

    def dashboard(self, layers: list[dict]) -> None:
        """Rate and distortion per layer, and each layer's rate against the Gaussian R(D) limit at its distortion."""
        from lightning_modules.common.dashboard import curve, log_table

        log_table("quant/layers", layers, self.loggers)
        layers = sorted((r for r in layers if r.get("rd_limit") is not None), key=lambda r: r["rel_mse"])
        if layers:
            x = [r["rel_mse"] for r in layers]
            curve("quant/rate_vs_limit", {self.method: (x, [r["bits"] for r in layers]),
                                          "R(D) limit": (x, [r["rd_limit"] for r in layers])},
                  self.loggers, xlabel="relative output MSE per layer", ylabel="bits per weight", logx=True)

    @torch.no_grad()
    def evaluate_text(self, name: str, spec: dict) -> dict[str, float]:
        """Perplexity of the quantized model and its reference, and their KL, on one held-out set (``eval_sets``)."""
        tokens = eval_tokens(spec, self.trainer.datamodule.tokenizer)
        n = len(tokens) // self.eval_seq_len
        if spec["max_windows"] is not None:
            n = min(n, spec["max_windows"])
        if n == 0:
            raise ValueError(f"model.eval_sets.{name} holds fewer than eval_seq_len={self.eval_seq_len} tokens")
        chunks = torch.as_tensor(tokens[: n * self.eval_seq_len], dtype=torch.int64).view(n, self.eval_seq_len)
        tot = torch.zeros(5, dtype=torch.float64, device=self.device)
        ref = self.reference if self.reference is not None else self.model
        for i in range(0, n, self.eval_batch_size):
            out = nll_and_kl(self.model, ref, {"input_ids": chunks[i:i + self.eval_batch_size].to(self.device)})
            tot += torch.stack([v.to(tot) for v in out])
        nll_q, nll_fp, kl, n_tok, n_pos = tot.tolist()
        return {f"eval/{name}/ppl": math.exp(nll_q / n_tok), f"eval/{name}/ppl_fp": math.exp(nll_fp / n_tok),
                f"eval/{name}/kl_bits": kl / n_pos}


def eval_set(name: str, files: str | None = None, text_field: str = "text", join: str | None = "\n\n",
             max_documents: int | None = None, max_windows: int | None = None) -> dict:
    """One ``model.eval_sets`` entry, checked before any work (a missing ``files`` names the key)."""
    if not files:
        raise ValueError(f"model.eval_sets.{name}.files is not set: give the held-out text file(s)")
    return {"files": files, "text_field": text_field, "join": join, "max_documents": max_documents,
            "max_windows": max_windows}


def eval_tokens(spec: dict, tokenizer):
    """The token stream of one eval set: joined as one text (``join``) or documents each followed by EOS."""
    from datamodules.common.loaders import load_local, local_documents
    from datamodules.text import tokenize_documents

    if spec["join"] is None:
        docs = local_documents(spec["files"], spec["text_field"])[: spec["max_documents"]]
        return tokenize_documents(docs, tokenizer)
    rows = [t if isinstance(t, str) else "" for t in load_local(spec["files"], field=spec["text_field"])[spec["text_field"]]]
    return tokenizer(spec["join"].join(rows[: spec["max_documents"]]))["input_ids"]


def quantizer_spec(quantizer: Quantizer) -> dict:
    """The quantizer as plain data that rebuilds it: its class as ``_target_`` and its constructor's settings."""
    cls = type(quantizer)
    args = inspect.signature(cls).parameters
    return {"_target_": f"{cls.__module__}.{cls.__qualname__}",
            **{k: v for k, v in vars(quantizer).items() if k in args and isinstance(v, (bool, int, float, str, type(None)))}}


@torch.no_grad()
def nll_and_kl(model, reference, batch) -> tuple[torch.Tensor, ...]:
    """One forward pass of each model: summed next-token NLL of both, summed KL(P_ref ‖ P_model) in bits over all
    positions, and the token / position counts. The KL is ``evaluation.kl_bits_per_token`` times the positions
    (tests check the two agree); computing it here saves two forward passes per batch."""
    from lightning_modules.common.evaluation import LN2

    x = batch["input_ids"]
    lq = torch.log_softmax(model(input_ids=x, use_cache=False).logits.float(), -1)
    lp = torch.log_softmax(reference(input_ids=x, use_cache=False).logits.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).double().sum() / LN2
    labels = batch.get("labels", x)[:, 1:]
    mask = labels != -100
    idx = labels.clamp_min(0).unsqueeze(-1)
    nll_q = -(lq[:, :-1].gather(-1, idx).squeeze(-1).double() * mask).sum()
    nll_fp = -(lp[:, :-1].gather(-1, idx).squeeze(-1).double() * mask).sum()
    return nll_q, nll_fp, kl, mask.sum().double(), torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
