"""DLLMQuant (arXiv 2508.14090): post-training quantization for diffusion LMs — TMAS calibration (``tmas``), CGQ
token weights on the shared GPTQ driver (``cgq``), IA-AQ value quantization (``iaaq``), AWQ (``awq``) and the
module (``module.DLLMQuantModule``)."""
from lightning_modules.dllmquant.awq import AWQ

__all__ = ["AWQ"]
