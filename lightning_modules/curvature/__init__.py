"""Representational curvature vs next-token entropy (arXiv 2604.23985): analysis, perturbations, regulariser."""
from lightning_modules.curvature.module import CurvatureLM

__all__ = ["CurvatureLM"]
