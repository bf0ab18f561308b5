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
Not implemented: WaterSIC-FT (training t and g by KL distillation with Z frozen).
"""
from __future__ import annotations

from lightning_modules.common.quantize.module import QuantizeLMModule
from lightning_modules.watersic.quantizer import WaterSIC


class WaterSICModule(QuantizeLMModule):
    """``QuantizeLMModule`` whose default quantizer is WaterSIC (``model/quantizer=…`` runs a baseline instead)."""

    @staticmethod
    def default_quantizer() -> WaterSIC:
        return WaterSIC()
