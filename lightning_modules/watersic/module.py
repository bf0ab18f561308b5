"""WaterSIC: information-theoretically (near) optimal linear layer quantization.
Lifar, Savkin, Ordentlich, Polyanskiy; ICML 2026; arXiv 2603.04956 (spec: ../shared/papers/watersic.md).

The method lives in the shared quantization package, next to the baselines it is compared with:
- ``lightning_modules/common/quantize/watersic.py``: the per-layer algorithm (waterfilling steps α_j = c/L_jj,
  SIC with integer codes and LMMSE gains, dead columns, diagonal rescalers, secant rate targeting);
- ``driver.py``: layer-by-layer plain or sequential (Qronos) statistics and the global rate control;
- ``rate.py``: entropy + side information (pooled = the authors' figure, default; per-column = the figure the
  0.255-bit guarantee assumes); ``limits.py``: Gaussian R(D) by reverse waterfilling.

Switches (conf/model/watersic.yaml): ``mode`` plain | sequential (paper's best runs use sequential, ``--qronos``);
``rate_control`` (on, ``--rate_control``); ``quantizer.accounting`` pooled | column; ``quantizer.rescalers``;
``quantizer.target_rate`` (``--zsic_binary_search``); ``quantizer.percdamp`` (1e-4).
Not implemented (spec §4.3 extras): residual compensation, attention-weighted QKV statistics, the joint ε search,
``--zero_out_rows`` and WaterSIC-FT.
"""
from __future__ import annotations

from lightning_modules.common.quantize.module import QuantizeLMModule


class WaterSICModule(QuantizeLMModule):
    """``QuantizeLMModule`` with WaterSIC as the quantizer (the same module runs the RTN/GPTQ baselines)."""

    def __init__(self, backbone, method: str = "watersic", **kwargs):
        super().__init__(backbone, method=method, **kwargs)
