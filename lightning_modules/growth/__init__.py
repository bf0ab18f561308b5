"""Orthogonal growth of MoE checkpoints ("Beyond Sunk Costs", arXiv 2510.08008); see ``module.py``."""
from lightning_modules.growth.module import GrowthModule, chinchilla_flops

__all__ = ["GrowthModule", "chinchilla_flops"]
