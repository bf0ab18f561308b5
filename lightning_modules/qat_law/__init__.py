"""QAT scaling law (Chen et al., arXiv 2505.14302): paired QAT / full-precision training; laws in ``sweeps/``."""
from lightning_modules.qat_law.module import QATLawModule, parse_variants

__all__ = ["QATLawModule", "parse_variants"]
