"""Shared weight quantization: one calibrate-then-quantize driver, quantizers behind one interface, one rate
accounting, and the Gaussian rate-distortion limit.

- ``base.py``: the ``Quantizer`` interface every method implements (a paper adds its own in its package).
- ``calibration.py``: input second moments with forward hooks (float64, streaming).
- ``driver.py``: ``quantize_model(model, quantizer, batches, rate, mode='plain'|'sequential', rate_control=...)``.
- ``rtn.py`` (``RTN``, the shared ``round_to_grid``), ``gptq.py`` (``GPTQ``, ``HuffmanGPTQ``): the common baselines.
- ``rate.py``: entropy (pooled and per-column) + side information. ``limits.py``: R(D) by reverse waterfilling.
- ``module.py``: ``QuantizeLMModule``, the Lightning module every quantization paper subclasses.
- ``export.py``: ``model.export_packed``: a quantized model packed to 4 bits (``callbacks/kernels/w4a16.py``), saved
  and reloaded (rtn, gptq, awq grids; not watersic's).

A quantizer is chosen by ``_target_`` in the config group ``conf/model/quantizer/`` (``model/quantizer=gptq``), so a
new method adds files and never edits this package.
"""
from lightning_modules.common.quantize.base import LayerStats, QuantResult, Quantizer, dead_columns
from lightning_modules.common.quantize.gptq import GPTQ, HuffmanGPTQ
from lightning_modules.common.quantize.rate import RateReport, column_entropy_bits, entropy_bits
from lightning_modules.common.quantize.rtn import RTN, round_to_grid

__all__ = ["LayerStats", "QuantResult", "Quantizer", "dead_columns", "GPTQ", "HuffmanGPTQ", "RateReport",
           "column_entropy_bits", "entropy_bits", "RTN", "round_to_grid"]
