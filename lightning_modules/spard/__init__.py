"""SPARD (Chen et al., ICML 2026, arXiv 2605.28030): harmful fine-tuning defence by RD-DPP safe-data selection
(``lightning_modules.spard.selection``) and the SPAG alternating loop (``module.py``, safety step in ``spag.py``)."""
from lightning_modules.spard.module import SPARDModule  # noqa: F401
