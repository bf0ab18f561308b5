"""PS-PPO (Hwang & Kim, arXiv 2606.29758) on the shared RL core (lightning_modules/common/rl)."""
from lightning_modules.ps_ppo.cutoffs import BetaFraction, GroupAdaptive, MixtureFull, Uniform, build_cutoff, prefix_weights
from lightning_modules.ps_ppo.module import PSPPOModule

__all__ = ["PSPPOModule", "Uniform", "MixtureFull", "BetaFraction", "GroupAdaptive", "build_cutoff", "prefix_weights"]
