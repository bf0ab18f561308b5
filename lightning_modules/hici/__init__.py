"""HiCI (arXiv 2603.20843): hierarchical construction–integration attention, with LongLoRA's S²-Attn baseline."""
from lightning_modules.hici.hici_attention import (CAUSAL_MODES, GlobalIntegrator, HiCICore, LocalConstructor,
                                                   segment_attention, slot_statistics)
from lightning_modules.hici.module import HiCILongContextLM, attach_hici, clip_hici_gradients
from lightning_modules.hici.s2attn import LocalCore, S2Core, s2_attention

__all__ = ["CAUSAL_MODES", "GlobalIntegrator", "HiCICore", "HiCILongContextLM", "LocalConstructor", "LocalCore",
           "S2Core", "attach_hici", "clip_hici_gradients", "s2_attention", "segment_attention", "slot_statistics"]
