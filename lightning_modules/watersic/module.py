"""WaterSIC: information-theoretically (near) optimal linear layer quantization.
Lifar, Savkin, Ordentlich, Polyanskiy; ICML 2026; arXiv 2603.04956 (spec: ../shared/papers/watersic.md).

The paper's own method is ``quantizer.py`` (the per-layer algorithm: waterfilling steps α_j = c/L_jj, SIC with
integer codes and LMMSE gains, dead columns, diagonal rescalers, secant rate targeting). Everything around it is
shared with the baselines it is compared with, in ``lightning_modules/common/quantize/``:
- ``driver.py``: layer-by-layer plain or sequential (Qronos) statistics and the global rate control;
- ``rate.py``: entropy + side information (pooled = the authors' figure, default; per-column = the figure the
  0.255-bit guarantee assumes); ``limits.py``: Gaussian R(D) by reverse waterfilling;
- ``module.py``: ``QuantizeLMModule``, calibrate-then-quantize as a test loop.

Switches (conf/model/watersic.yaml, conf/model/quantizer/watersic.yaml): ``mode`` plain | sequential (paper's best
runs use sequential, ``--qronos``); ``rate_control`` (on, ``--rate_control``); ``quantizer.accounting`` pooled |
column; ``quantizer.rescalers``; ``quantizer.target_rate`` (``--zsic_binary_search``); ``quantizer.percdamp`` (1e-4).
Pipeline extras (spec §4.3, ``driver.py``; sequential mode; off by default as in the release's CLI, on in the
paper-scale experiments' ``base/watersic_paper.yaml`` as in the paper's best runs): ``residual_compensation``
(``--residual_compensation``), ``attn_weighted_qkv`` = ε (``--attn_weighted_qkv``, paper 0.01), ``eps_search``
(``--attn_weighted_adapt_eps_joint`` / ``--qronos_adapt``) and ``zero_out_rows`` (``--zero_out_rows``).
WaterSIC-FT (``finetune``: {epochs, lr, lr_min, batch_size, max_sequences}; null = off): after quantization, train only every
layer's rescalers t and g (codes frozen) by KL distillation to the full-precision copy on the whole training split
(``finetune.py``; paper: 10 epochs, lr 5e-4 cosine to 5e-6, batch 8, seq 2048; 70B: lr 5e-5, 4 epochs).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from lightning_modules.common.quantize.module import QuantizeLMModule
from lightning_modules.watersic.finetune import finetune_rescalers
from lightning_modules.watersic.quantizer import WaterSIC


# the release's (Meta Llama) matrix names -> the transformers layer names (Llama, Qwen3)
META_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
              "w1": "mlp.gate_proj", "w3": "mlp.up_proj", "w2": "mlp.down_proj"}
_ROWS_ENTRY = re.compile(r"^(\d+)\.(\w+):(\d+(?:,\d+)*)$")


def parse_zero_out_rows(spec: str) -> dict[str, list[int]]:
    """The release's ``--zero_out_rows`` string, ``"<block>.<matrix>:<row>,<row>;..."`` with Meta's matrix names
    (``"6.w1:5723,8518; 6.w3:5723,8518"``), as the driver's {layer-name substring: [rows]}:
    ``{"layers.6.mlp.gate_proj": [5723, 8518], "layers.6.mlp.up_proj": [5723, 8518]}``."""
    out: dict[str, list[int]] = {}
    for entry in filter(None, (e.replace(" ", "") for e in spec.split(";"))):
        m = _ROWS_ENTRY.match(entry)
        if m is None or m.group(2) not in META_NAMES:
            raise ValueError(f"model.zero_out_rows entry {entry!r}: write <block>.<matrix>:<row>,<row> with a matrix of "
                             f"{', '.join(META_NAMES)} (the release's format), e.g. 6.w1:5723,8518")
        out.setdefault(f"layers.{m.group(1)}.{META_NAMES[m.group(2)]}", []).extend(int(r) for r in m.group(3).split(","))
    return out


class WaterSICModule(QuantizeLMModule):
    """``QuantizeLMModule`` whose default quantizer is WaterSIC (``model/quantizer=…`` runs a baseline instead), with
    WaterSIC-FT as the ``finetune`` switch. ``zero_out_rows`` may also be the release's string
    (:func:`parse_zero_out_rows`)."""

    def __init__(self, *args, finetune: Mapping[str, Any] | None = None, **kwargs):
        if isinstance(kwargs.get("zero_out_rows"), str):
            kwargs["zero_out_rows"] = parse_zero_out_rows(kwargs["zero_out_rows"])
        super().__init__(*args, **kwargs)
        self.finetune = dict(finetune) if finetune else None
        if self.finetune is not None:
            unknown = set(self.finetune) - {"epochs", "lr", "lr_min", "batch_size", "seed", "max_sequences"}
            if unknown:
                raise ValueError(f"model.finetune has unknown keys {sorted(unknown)}: use epochs, lr, lr_min, batch_size, "
                                 "max_sequences")
            if not isinstance(self.quantizer, WaterSIC):
                raise ValueError("model.finetune (WaterSIC-FT) trains WaterSIC's rescalers: use model/quantizer=watersic")
            if not self.kl and self.mode != "sequential":
                raise ValueError("model.finetune distils to the full-precision copy: set model.kl=true")
            if self.offload:
                raise ValueError("model.finetune with model.offload=true: WaterSIC-FT trains through the whole model on "
                                 "the GPU; run it without offload, or set model.finetune=null")

    def quantize(self, batches: list[dict]) -> dict:
        report = super().quantize(batches)
        if self.finetune is not None:
            ft = dict(self.finetune)
            data = self.trainer.datamodule.train_set
            n = min(len(data), ft.pop("max_sequences", None) or len(data))  # null: the whole split (the paper)
            seqs = torch.stack([data[i]["input_ids"] for i in range(n)])
            hist = finetune_rescalers(self.model, self.reference, report["factors"], seqs, **ft)
            self.results["finetune"] = {"kl_nats_per_epoch": hist, **self.finetune}
        return report

    @staticmethod
    def default_quantizer() -> WaterSIC:
        return WaterSIC()
