"""LLR: heavy-tail guided layer-wise learning rates (AdamW and Muon).

He, Wang, Yin, Liu, Tu, "One LR Doesn't Fit All: Heavy-Tail Guided Layerwise Learning Rates for LLMs",
ICML 2026, arXiv 2605.22297; released code github.com/hed-ucas/Layer-wise-Learning-Rate (spec:
../shared/papers/llr.md). LLR only changes the optimizer's parameter groups and their rates:

- ``LLRModule`` (this file) overrides one hook of the LM base module, :meth:`param_groups`: one group per
  ``nn.Linear`` / ``nn.Embedding`` module (q/k/v/o, gate/up/down, embed_tokens, lm_head) and one "untuned" group
  for the rest (RMSNorm gains). Any other module can do the same with ``llr_groups``.
- ``llr_optimizer`` (``optim.py``): AdamW over those groups (the released code: eps 1e-8, wd 0.1;
  ``betas_source: spec`` (0.9, 0.95) by default, ``release`` = torch's (0.9, 0.999), which is what the released
  code trains with), or ``optimizer=muon``: ``torch.optim.Muon`` on the 2-D hidden matrices and AdamW on
  embeddings, head and norms (``MuonWithAdamW``). **The Muon path follows the paper, not the code**: the released
  ``build_optimizer_LLR`` has no Muon branch; the per-layer ratios scale each group's own base rate (``muon_lr``
  for Muon matrices, ``lr`` for the AdamW groups, so embed/head get r_max·lr as in the code's ``LRUnbalance`` Muon
  branch). Muon defaults (lr 0.02, momentum 0.95, Nesterov, wd 0, ``adjust_lr_fn: original``) are [INF].
- The main table's baseline arms (``baselines.py``): ``optimizer=lars|lamb|sharpness`` over the same groups at
  uniform rates (Sharpness: fixed block multiples), as the release trains them; the LLR callback refuses them.
- The rates (``spectra.py``, ``rates.py``), recomputed by the ``lightning_modules.llr.callback.LLR`` callback:

  1. λ = σ(W)² (``torch.linalg.svdvals``, no 1/N normalisation; ``esd_dtype`` float32 as released, or float64).
  2. Hill / continuous power-law MLE with xmin at the median: i = ⌊N/2⌋, n = N − i,
     α̂ = 1 + n / Σ_{k≥i} ln(λ_k / λ_i)  (``hill_alpha``).
  3. Modules with fewer than ``min_eigs`` (50) eigenvalues are dropped and join the untuned group (as released).
     Modules whose name contains ``embed`` or ``head`` (and any ``nn.Embedding``) get the largest α of the
     others: of the kept layers (``edge_alpha: kept``, ours) or, in the release's order, of all layers before the
     small ones are dropped (``edge_alpha: all``), where a dropped layer can set the maximum and squeeze every
     kept layer's rate. LLaMA has no such layer, so the two agree there.
  4. η_l = η·[r_min + (r_max − r_min)·(α_l − α_min)/(α_max − α_min)] (``lr_ratios``; r_min 1, r_max 5).
  5. At step 1 and every ``every`` (100) steps while step ≤ ``ratio``·total (0.2): a linear ramp over
     ``ramp_steps`` (50) to η_l^new·f(s+L), then the schedule continues from η_l^new; frozen afterwards
     (``RateSchedule``; where we differ from the release at the 20% point, and why, is documented there).
"""
from __future__ import annotations

from lightning_modules.common.lm import CausalLMModule
from lightning_modules.llr.optim import llr_groups


class LLRModule(CausalLMModule):
    """The LM base module with per-module parameter groups (for ``llr_optimizer`` and the ``LLR`` callback).
    Without the callback it is the uniform baseline over the very same groups and optimizer."""

    def param_groups(self) -> list[dict]:
        return llr_groups(super().param_groups(), self)
