"""QAT scaling law for W4A4: train from scratch with fake quantization, paired with the full-precision twin.

Chen et al., "Scaling Law for Quantization-Aware Training" (arXiv 2505.14302). The law is
L_QAT(N, D, G) = A/N^α + B/D^β + E + δ_p(N, D, G), δ_p = k·D^γ_D·(log₂G)^γ_G / N^γ_N (fitted in ``sweeps/``).
This module produces one (N, D) cell of it: every variant below is trained from the same initial weights on
the same batches (one job, one data stream, same seed), and the test loop reports on the held-out split

    test/loss/<variant>   and   test/delta/<variant> = L_variant − L_fp,

with N the non-embedding parameter count and D the training tokens (``results.qat_law.rows``).

Variants (``precisions`` × ``group_sizes``):
- ``fp``: the full-precision twin (the backbone's dtype: BF16 at paper scale, fp32 in tiny runs) — the
  paper's "BF16" run; trained once per job, whatever the group sizes;
- ``w<b>a<b>`` (``w4a4``, ``w4a16`` = weight-only error δ_W, ``w16a4`` = activation-only error δ_A, any
  widths), each at every G of ``group_sizes``; a suffix ``_fc2a8`` keeps the FC2 (down-projection) input at
  8 bits (the paper's mixed-precision fix; the pattern is ``quant.fc2_pattern``); a suffix ``_g<G>`` pins
  one group size for that precision only.
``quant``: fields of ``QuantSpec`` shared by all variants (symmetric grids by default [INF: the paper does not
say]; ``clip_ratio`` 1.0, i.e. absmax / min–max scales). Embeddings and the LM head stay in full precision.

Training all variants in one job is exactly training them apart: parameters are disjoint, AdamW is
per-parameter and gradient clipping is applied per variant (``configure_gradient_clipping``). At paper scale
a sweep cell trains one precision per job (``precisions: [w4a4]`` or ``[fp]``); ``sweeps/collect.py`` pairs
rows by (N, D, seed) across jobs then.
"""
from __future__ import annotations

import copy
import re
from typing import Any, Callable, Mapping

import torch
from torch import nn

from lightning_modules.common.backbone import build_backbone, count_parameters
from lightning_modules.common.fake_quant import QuantSpec, quant_spec, quantize_model
from lightning_modules.common.lm import CausalLMModule

_PRECISION = re.compile(r"^w(\d+)a(\d+)(?:_fc2a(\d+))?(?:_g(\d+))?$")
FP = "fp"


def parse_variants(precisions: list[str], group_sizes: list[int]) -> list[dict[str, Any]]:
    """[{key, precision, w_bits, a_bits, fc2_a_bits, group_size}] for every variant a job trains."""
    out, seen = [], set()
    for p in precisions:
        if p == FP:
            v = [{"key": FP, "precision": FP, "w_bits": 16, "a_bits": 16, "fc2_a_bits": 16, "group_size": 0}]
        else:
            m = _PRECISION.match(p)
            if m is None:
                raise ValueError(f"model.precisions: {p!r} is not 'fp' or w<bits>a<bits>[_fc2a<bits>][_g<G>] "
                                 "(e.g. w4a4, w4a16, w16a4, w4a4_fc2a8, w4a16_g64)")
            wb, ab = int(m.group(1)), int(m.group(2))
            fc2 = int(m.group(3)) if m.group(3) else ab
            gs = [int(m.group(4))] if m.group(4) else list(group_sizes)
            name = p if not m.group(4) else p[: p.rindex("_g")]
            v = [{"key": f"{name}_g{g}", "precision": name, "w_bits": wb, "a_bits": ab, "fc2_a_bits": fc2,
                  "group_size": int(g)} for g in gs]
        for item in v:
            if item["key"] not in seen:
                seen.add(item["key"])
                out.append(item)
    if not out:
        raise ValueError("model.precisions is empty: list at least one of fp, w4a4, w4a16, w16a4, w4a4_fc2a8")
    return out


class QATLawModule(CausalLMModule):
    """Paired QAT / full-precision training of one backbone size on one token budget.

    Args (beyond ``CausalLMModule``'s):
        precisions: variants to train side by side (see the module docstring); ``fp`` gives the twin.
        group_sizes: G values for each quantized precision.
        quant: shared ``QuantSpec`` fields (w_symmetric, a_symmetric, clip_ratio, impl, skip ...), plus
            ``fc2_pattern`` (module-name pattern of the FC2 / down-projection, default ``*down_proj``).
    """

    def __init__(self, backbone: Mapping[str, Any], optimizer: Callable | None = None,
                 scheduler: Callable | None = None, weight_decay: float = 0.0,
                 precisions: list[str] = (FP, "w4a4"), group_sizes: list[int] = (128,),
                 quant: Mapping[str, Any] | None = None):
        super().__init__(backbone, optimizer, scheduler, weight_decay)
        self.precisions = list(precisions)
        self.group_sizes = [int(g) for g in group_sizes]
        quant = dict(quant or {})
        self.fc2_pattern = quant.pop("fc2_pattern", "*down_proj")
        self.quant = quant
        quant_spec(quant)  # unknown fields fail here, before any model is built
        self.variants = parse_variants(self.precisions, self.group_sizes)
        self.models: nn.ModuleDict | None = None
        self._tokens_per_batch = 0
        self._sums: dict[str, torch.Tensor] = {}

    # --- models ----------------------------------------------------------------------------------
    def spec_for(self, variant: Mapping[str, Any]) -> QuantSpec:
        overrides = dict(self.quant.get("overrides", {}))
        if variant["fc2_a_bits"] != variant["a_bits"]:
            overrides[self.fc2_pattern] = {"a_bits": variant["fc2_a_bits"]}
        fields = {**self.quant, "w_bits": variant["w_bits"], "a_bits": variant["a_bits"],
                  "group_size": variant["group_size"], "overrides": overrides}
        return quant_spec(fields)

    def configure_model(self) -> None:
        if self.models is not None:
            return
        base = build_backbone(self.backbone_spec)  # one initialisation, copied: every variant starts equal
        models = {}
        for v in self.variants:
            m = copy.deepcopy(base)
            if v["key"] != FP:
                quantize_model(m, self.spec_for(v))
            models[v["key"]] = m
        self.models = nn.ModuleDict(models)
        mesh = getattr(self, "device_mesh", None)
        if mesh is not None:  # FSDP2: shard each variant's blocks, then each variant
            from torch.distributed.fsdp import fully_shard

            sub = mesh["data_parallel"] if "data_parallel" in mesh.mesh_dim_names else mesh
            for m in self.models.values():
                for layer in self._layers(m):
                    fully_shard(layer, mesh=sub)
                fully_shard(m, mesh=sub)

    @staticmethod
    def _layers(model) -> list[nn.Module]:
        for mod in model.modules():
            if isinstance(mod, nn.ModuleList) and len(mod) > 0:
                return list(mod)
        return []

    def decoder_layers(self) -> list[nn.Module]:
        return [layer for m in (self.models or {}).values() for layer in self._layers(m)]

    def forward(self, input_ids, attention_mask=None, variant: str | None = None, **kw):
        key = variant or self.variants[0]["key"]
        return self.models[key](input_ids=input_ids, attention_mask=attention_mask, **kw)

    def parameter_counts(self) -> dict[str, int]:
        if self.models is None:
            return {}
        m = next(iter(self.models.values()))
        return {"params/total": count_parameters(m), "params/non_embedding": count_parameters(m, non_embedding=True),
                "params/trainable": sum(p.numel() for p in self.parameters() if p.requires_grad),
                "variants": len(self.models)}

    # --- training --------------------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        self._tokens_per_batch = int(batch["input_ids"].numel())
        total = 0.0
        bs = batch["input_ids"].shape[0]
        for key, model in self.models.items():
            loss = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                         labels=batch["labels"], use_cache=False).loss
            self.log(f"train/loss/{key}", loss, on_step=True, on_epoch=False, batch_size=bs)
            total = total + loss
        self.log("train/loss", total / len(self.models), prog_bar=True, on_step=True, on_epoch=False, batch_size=bs)
        return total  # disjoint parameters: each variant gets exactly its own gradient

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Clip each variant on its own, as if it were trained alone."""
        if not gradient_clip_val:
            return
        for model in self.models.values():
            params = [p for p in model.parameters() if p.grad is not None]
            if gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    # --- evaluation ------------------------------------------------------------------------------
    def _eval_start(self):
        self._sums = {k: torch.zeros(2, device=self.device, dtype=torch.float64) for k in self.models}

    def _eval_step(self, batch):
        labels = batch["labels"][:, 1:]
        mask = labels != -100
        for key, model in self.models.items():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            nll = -logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            self._sums[key] += torch.stack([(nll * mask).sum().double(), mask.sum().double()])

    def _eval_losses(self) -> dict[str, float]:
        out = {}
        for key, s in self._sums.items():
            if self.trainer.world_size > 1:
                s = self.trainer.strategy.reduce(s, reduce_op="sum")
            out[key] = float(s[0] / s[1].clamp_min(1))
        return out

    def on_validation_epoch_start(self):
        self._eval_start()

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch)

    def on_validation_epoch_end(self):
        losses = self._eval_losses()
        for key, loss in losses.items():
            self.log(f"val/loss/{key}", loss)
            if FP in losses and key != FP:
                self.log(f"val/delta/{key}", loss - losses[FP])
        # what the checkpoint callback monitors: the mean over variants
        self.log("val/loss", sum(losses.values()) / len(losses), prog_bar=True)

    def on_test_epoch_start(self):
        self._eval_start()

    def test_step(self, batch, batch_idx):
        self._eval_step(batch)

    def on_test_epoch_end(self):
        losses = self._eval_losses()
        trainer = self.trainer
        tokens = trainer.global_step * self._tokens_per_batch * trainer.accumulate_grad_batches * trainer.world_size
        counts = self.parameter_counts()
        rows = []
        for v in self.variants:
            key, loss = v["key"], losses[v["key"]]
            delta = loss - losses[FP] if FP in losses else None
            self.log(f"test/loss/{key}", loss)
            if delta is not None and key != FP:
                self.log(f"test/delta/{key}", delta)
            rows.append({**{k: v[k] for k in ("precision", "w_bits", "a_bits", "fc2_a_bits", "group_size")},
                         "variant": key, "loss": loss, "delta": delta if key != FP else 0.0})
        self.log("test/loss", sum(losses.values()) / len(losses))
        self.results = {"qat_law": {"N": counts.get("params/non_embedding"), "D": int(tokens),
                                    "N_total": counts.get("params/total"), "rows": rows}}
        from lightning_modules.common.dashboard import figure, log_figure, log_table

        log_table("qat/variants", [{"N": self.results["qat_law"]["N"], "D": int(tokens), **r} for r in rows], self.loggers)
        quant = [r for r in rows if r["variant"] != FP]
        if quant and any(self.loggers):  # the QAT loss gap δ of each variant over its full-precision twin
            fig, ax = figure(figsize=(max(4, 0.8 * len(quant)), 3.5))
            ax.bar([r["variant"] for r in quant], [r["delta"] or 0.0 for r in quant])
            ax.set(ylabel="δ = loss − loss(fp)", title=f"QAT gap at N={self.results['qat_law']['N']}, D={int(tokens)}")
            ax.tick_params(axis="x", rotation=45)
            fig.tight_layout()
            log_figure("qat/delta", fig, self.loggers)
