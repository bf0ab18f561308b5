"""InfoLaw (Liu et al., arXiv 2605.02364): a causal LM trained on a quality-bucket mixture; see ``module.py``."""
from lightning_modules.infolaw.module import InfoLawModule

__all__ = ["InfoLawModule"]
