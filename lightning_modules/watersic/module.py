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
Not implemented (spec §4.3 extras): residual compensation, attention-weighted QKV statistics, the joint ε search,
``--zero_out_rows`` and WaterSIC-FT.
"""
from __future__ import annotations

from lightning_modules.common.quantize.module import QuantizeLMModule
from lightning_modules.watersic.quantizer import WaterSIC


class WaterSICModule(QuantizeLMModule):
    """``QuantizeLMModule`` whose default quantizer is WaterSIC (``model/quantizer=…`` runs a baseline instead)."""

    @staticmethod
    def default_quantizer() -> WaterSIC:
        return WaterSIC()
