"""Shared weight quantization: one calibrate-then-quantize driver, quantizers behind one interface, one rate
accounting, and the Gaussian rate-distortion limit.

- ``calibration.py``: input second moments with forward hooks (float64, streaming).
- ``driver.py``: ``quantize_model(model, quantizer, batches, rate, mode='plain'|'sequential', rate_control=...)``.
- ``rtn.py`` (``RTN``, the shared ``round_to_grid``), ``gptq.py`` (``GPTQ``, ``HuffmanGPTQ``), ``watersic.py`` (``WaterSIC``).
- ``rate.py``: entropy (pooled and per-column) + side information. ``limits.py``: R(D) by reverse waterfilling.
"""
from lightning_modules.common.quantize.base import LayerStats, QuantResult, Quantizer, dead_columns
from lightning_modules.common.quantize.gptq import GPTQ, HuffmanGPTQ
from lightning_modules.common.quantize.rate import RateReport, column_entropy_bits, entropy_bits
from lightning_modules.common.quantize.rtn import RTN, round_to_grid
from lightning_modules.common.quantize.watersic import WaterSIC

QUANTIZERS = {"rtn": RTN, "gptq": GPTQ, "huffman_gptq": HuffmanGPTQ, "watersic": WaterSIC}


def build_quantizer(method: str, **kwargs) -> Quantizer:
    """A quantizer by name (``rtn``, ``gptq``, ``huffman_gptq``, ``watersic``) with its keyword arguments."""
    if method not in QUANTIZERS:
        raise ValueError(f"quantizer method={method!r}: choose one of {', '.join(QUANTIZERS)}")
    return QUANTIZERS[method](**kwargs)


__all__ = ["QUANTIZERS", "build_quantizer", "LayerStats", "QuantResult", "Quantizer", "dead_columns", "GPTQ", "HuffmanGPTQ", "RateReport",
           "column_entropy_bits", "entropy_bits", "RTN", "round_to_grid", "WaterSIC"]
