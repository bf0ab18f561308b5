"""Per-module parameter groups and the LLR optimizer: AdamW (released) or Muon + AdamW (paper) (spec 2.3), and the
main table's baseline arms LARS, LAMB and Sharpness (``baselines.py``)."""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch
from torch import nn

from lightning_modules.llr.baselines import LARS, SHARPNESS_RATIOS, Lamb, sharpness_block
from lightning_modules.llr.spectra import is_edge

# The baseline arms of the main table: uniform schedules only, the LLR callback refuses them.
BASELINES = ("lars", "lamb", "sharpness")

# A paper/code disagreement: the spec gives (0.9, 0.95); the released build_optimizer_LLR passes only the weight
# decay, so the released runs train with torch's default (0.9, 0.999).
BETAS = {"spec": (0.9, 0.95), "release": (0.9, 0.999)}


def llr_groups(params: Iterable[dict], module: nn.Module) -> list[dict]:
    """Split parameter groups: one group per Linear/Embedding module of ``module`` (per parent group), then one
    untuned group per parent group for everything else. Each group records ``llr_module`` ('' when untuned) and
    ``llr_edge``; parent keys (weight_decay, ...) are kept."""
    owner: dict[int, tuple[str, bool]] = {}
    for name, mod in module.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            for p in mod.parameters(recurse=False):
                owner.setdefault(id(p), (name, is_edge(name, mod)))
    groups: list[dict] = []
    for parent in params:
        parent = dict(parent) if isinstance(parent, Mapping) else {"params": list(parent)}
        plist = parent.pop("params")
        plist = [plist] if isinstance(plist, torch.Tensor) else list(plist)
        tuned: dict[str, dict] = {}
        rest: list[torch.Tensor] = []
        for p in plist:
            if id(p) in owner:
                name, edge = owner[id(p)]
                tuned.setdefault(name, {**parent, "params": [], "llr_module": name, "llr_edge": edge})["params"].append(p)
            else:
                rest.append(p)
        groups.extend(tuned.values())
        if rest:
            groups.append({**parent, "params": rest, "llr_module": "", "llr_edge": False})
    if not any(g["llr_module"] for g in groups):
        raise ValueError(f"LLR found no nn.Linear / nn.Embedding parameters in {type(module).__name__}'s parameter groups")
    return groups


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer: ``torch.optim.Muon`` steps the groups with ``use_muon=True``, ``torch.optim.AdamW`` the
    rest. Groups and state are shared with the two inner optimizers, so schedulers, ``state_dict`` and
    checkpoints see one ordinary optimizer."""

    def __init__(self, groups: list[dict], muon: Mapping[str, Any], adamw: Mapping[str, Any]):
        muon_groups = [g for g in groups if g["use_muon"]]
        adam_groups = [g for g in groups if not g["use_muon"]]
        # The inner constructors fill each group's defaults in place; the outer optimizer then holds the same dicts.
        self._muon = torch.optim.Muon(muon_groups, **muon) if muon_groups else None
        self._adamw = torch.optim.AdamW(adam_groups, **adamw) if adam_groups else None
        super().__init__(groups, defaults={})
        self._link()

    def _link(self) -> None:
        for opt, flag in ((self._muon, True), (self._adamw, False)):
            if opt is not None:
                opt.param_groups = [g for g in self.param_groups if bool(g["use_muon"]) == flag]
                opt.state = self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in (self._muon, self._adamw):
            if opt is not None:
                opt.step()
        return loss


def llr_optimizer(params: Iterable[dict], optimizer: str = "adamw", lr: float = 5e-4, betas_source: str = "spec",
                  eps: float = 1e-8, weight_decay: float | None = 0.1, muon_lr: float = 0.02,
                  muon_momentum: float = 0.95, muon_nesterov: bool = True, muon_ns_steps: int = 5,
                  muon_weight_decay: float = 0.0, muon_adjust_lr_fn: str | None = "original",
                  lars_momentum: float = 0.9, lars_eps: float = 1e-6, lamb_eps: float = 1e-6,
                  lamb_clamp: float = 10.0, sharpness_ratios: Mapping[str, float] | None = None) -> torch.optim.Optimizer:
    """The LLR optimizer over per-module groups (``LLRModule.param_groups``, or any groups ``llr_groups`` made).

    Args:
        params: per-module groups carrying ``llr_module`` / ``llr_edge``.
        optimizer: ``adamw`` (released code) or ``muon`` (paper; Muon on hidden matrices, AdamW elsewhere), or a
            baseline arm of the main table (``baselines.py``; uniform rates, no LLR callback): ``lars``, ``lamb``,
            ``sharpness`` (AdamW at ``SHARPNESS_RATIOS`` x lr per block).
        lr: the uniform base rate η (released 1B: AdamW 5e-4, LARS 1e-3, LAMB 1e-2, Sharpness 1e-4).
        betas_source: AdamW's (and LAMB's, Sharpness's) betas. ``spec`` (default): (0.9, 0.95), what the spec states; ``release``: torch's
            default (0.9, 0.999), what the released code actually trains with (its builder passes no betas).
        weight_decay: applied to every AdamW group, norms included, as the released code's AdamW does;
            ``None`` keeps each parent group's own value (the base module: matrices only).
        muon_*: Muon's base rate and hyperparameters for the hidden matrices.
        lars_momentum, lars_eps: LARS's μ and trust-ratio ε (released 0.9, 1e-6); LARS takes ``weight_decay`` as
            its L2 β (released 1B script: 1e-6).
        lamb_eps, lamb_clamp: LAMB's ε and weight-norm clamp (torch_optimizer's 1e-6, 10).
        sharpness_ratios: per-block multipliers overriding ``SHARPNESS_RATIOS`` (keys norm, qk, vo, mlp, edge, other).
    """
    if optimizer not in ("adamw", "muon", *BASELINES):
        raise ValueError(f"llr_optimizer(optimizer={optimizer!r}): choose adamw or muon (LLR), or a baseline arm: "
                         f"{', '.join(BASELINES)}")
    ratios = {**SHARPNESS_RATIOS, **(sharpness_ratios or {})}
    if set(ratios) != set(SHARPNESS_RATIOS):
        raise ValueError(f"llr_optimizer(sharpness_ratios={dict(sharpness_ratios)}): keys must be among "
                         f"{sorted(SHARPNESS_RATIOS)}")
    if betas_source not in BETAS:
        raise ValueError(f"llr_optimizer(betas_source={betas_source!r}): choose spec (0.9, 0.95) or release (0.9, 0.999)")
    groups = [dict(g) for g in params]
    if not groups or not all("llr_module" in g for g in groups):
        raise ValueError("llr_optimizer needs per-module groups: use model=llr (lightning_modules.llr.LLRModule), "
                         "or override param_groups() with lightning_modules.llr.llr_groups")
    use_muon = optimizer == "muon"
    for g in groups:
        g["use_muon"] = bool(use_muon and g["llr_module"] and not g["llr_edge"] and all(p.ndim == 2 for p in g["params"]))
        g["llr_arm"] = optimizer
        base = muon_lr if g["use_muon"] else lr
        if optimizer == "sharpness":  # the untuned group holds the norms (block "norm", ratio 1 as released)
            base = lr * ratios["edge" if g["llr_edge"] else sharpness_block(g["llr_module"] or "norm")]
        g["lr"] = g["llr_base_lr"] = float(base)
        if g["use_muon"]:
            g["weight_decay"] = float(muon_weight_decay)
        elif weight_decay is not None:
            g["weight_decay"] = float(weight_decay)
    adamw = dict(lr=lr, betas=BETAS[betas_source], eps=eps, weight_decay=0.1 if weight_decay is None else weight_decay)
    if optimizer == "lars":
        return LARS(groups, lr=lr, momentum=lars_momentum, weight_decay=adamw["weight_decay"], eps=lars_eps)
    if optimizer == "lamb":
        return Lamb(groups, lr=lr, betas=adamw["betas"], eps=lamb_eps, weight_decay=adamw["weight_decay"],
                    clamp_value=lamb_clamp)
    if not use_muon:
        return torch.optim.AdamW(groups, **adamw)
    muon = dict(lr=muon_lr, momentum=muon_momentum, nesterov=muon_nesterov, ns_steps=muon_ns_steps,
                weight_decay=muon_weight_decay, adjust_lr_fn=muon_adjust_lr_fn)
    return MuonWithAdamW(groups, muon=muon, adamw=adamw)
