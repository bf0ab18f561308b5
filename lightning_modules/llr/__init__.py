"""LLR (He et al., arXiv 2605.22297): heavy-tail guided layer-wise learning rates; see ``module.py``."""
from lightning_modules.llr.baselines import LARS, SHARPNESS_RATIOS, Lamb, sharpness_block
from lightning_modules.llr.module import LLRModule
from lightning_modules.llr.optim import BASELINES, BETAS, MuonWithAdamW, llr_groups, llr_optimizer
from lightning_modules.llr.rates import RateSchedule, lr_ratios
from lightning_modules.llr.spectra import cpu_threads, esd, full_weight, hill_alpha, is_edge, module_alphas

__all__ = ["LLRModule", "BASELINES", "BETAS", "LARS", "Lamb", "SHARPNESS_RATIOS", "sharpness_block", "MuonWithAdamW", "llr_groups", "llr_optimizer", "RateSchedule", "lr_ratios",
           "cpu_threads", "esd", "full_weight", "hill_alpha", "is_edge", "module_alphas"]
