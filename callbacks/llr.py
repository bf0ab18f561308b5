"""LLR: heavy-tail guided layer-wise learning rates (AdamW and Muon).

He, Wang, Yin, Liu, Tu, "One LR Doesn't Fit All: Heavy-Tail Guided Layerwise Learning Rates for LLMs",
ICML 2026, arXiv 2605.22297; released code github.com/hed-ucas/Layer-wise-Learning-Rate (spec:
../shared/papers/llr.md). LLR only changes the optimizer's parameter groups and their rates, so it is two
pieces any module built on ``CausalLMModule`` can use:

- ``llr_optimizer`` (a ``_partial_`` optimizer factory): one parameter group per ``nn.Linear`` /
  ``nn.Embedding`` module (q/k/v/o, gate/up/down, embed_tokens, lm_head) and one "untuned" group per parent
  group for the rest (RMSNorm gains), each group remembering its module (``llr_module``) and its uniform rate
  (``llr_base_lr``). ``optimizer=adamw`` (the released code: AdamW, betas (0.9, 0.95), eps 1e-8, wd 0.1) or
  ``optimizer=muon``: ``torch.optim.Muon`` on the 2-D hidden matrices and AdamW on embeddings, head and norms,
  in one optimizer (``MuonWithAdamW``). **The Muon path follows the paper, not the code**: the released
  ``build_optimizer_LLR`` has no Muon branch; we apply the same per-layer ratios to each group's own base rate
  (``muon_lr`` for Muon matrices, ``lr`` for the AdamW groups, so embed/head get r_max·lr as in the code's
  ``LRUnbalance`` Muon branch). Muon defaults (lr 0.02, momentum 0.95, Nesterov, wd 0, Keller Jordan's
  ``sqrt(max(1, rows/cols))`` scaling = ``adjust_lr_fn: original``) are [INF]: the paper does not state them.
- ``LLR`` (a callback) recomputes the rates from the weights' empirical spectral densities:

  1. λ = σ(W)² (``torch.linalg.svdvals``, no 1/N normalisation; ``esd_dtype`` float32 as released, or float64).
  2. Hill / continuous power-law MLE with xmin at the median: i = ⌊N/2⌋, n = N − i,
     α̂ = 1 + n / Σ_{k≥i} ln(λ_k / λ_i)  (``hill_alpha``).
  3. Modules whose name contains ``embed`` or ``head`` (and any ``nn.Embedding``) get the largest α of the
     others; modules with fewer than ``min_eigs`` (50) eigenvalues are dropped and keep the base rate [INF:
     the code drops them from the α list; what rate they then keep is not stated].
  4. η_l = η·[r_min + (r_max − r_min)·(α_l − α_min)/(α_max − α_min)] (``lr_ratios``; r_min 1, r_max 5).
  5. At step 1 and every ``every`` (100) steps while step ≤ ``ratio``·total (0.2): each group's rate ramps
     linearly over ``ramp_steps`` (50) from its current value to η_l^new·f(s+L), f the LambdaLR schedule
     (warmup + cosine to 0.1×), then the schedule continues from the new initial rate; the untuned group ramps to
     the smallest target, then returns to η·f. After the last recompute the rates are frozen.

Every rank computes the spectra from the full weight (FSDP2 ``DTensor.full_tensor()``, DeepSpeed ZeRO-3
``GatheredParameters``; collective, so all ranks take part) on the device the weight lives on, then rank 0's
α are broadcast so every rank uses identical rates. The released code has ``.cuda()`` calls here; ours does not.
The callback's state (ramp, current initial rates, α) is checkpointed; with the optimizer's and scheduler's
own state, a resumed run continues with exactly the same per-group rates.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterable, Mapping

import lightning as L
import torch
from torch import nn

# ---------------------------------------------------------------------------------------------------------
# Spectra and the tail exponent
# ---------------------------------------------------------------------------------------------------------


def esd(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Eigenvalues of WᵀW (squared singular values, ascending), computed where the weight lives."""
    if weight.ndim != 2:
        raise ValueError(f"esd needs a 2-D weight, got shape {tuple(weight.shape)}")
    return torch.linalg.svdvals(weight.detach().to(dtype)).square().sort().values


def hill_alpha(eigs) -> float:
    """Median-xmin Hill estimate: α̂ = 1 + n / Σ_{k≥i} ln(λ_k/λ_i), i = ⌊N/2⌋, n = N − i (λ ascending).

    Returns nan when the tail is degenerate (xmin = 0, or all tail eigenvalues equal)."""
    lam = torch.as_tensor(eigs).detach().to(torch.float64).flatten().sort().values
    if lam.numel() < 2:
        raise ValueError(f"hill_alpha needs at least 2 eigenvalues, got {lam.numel()}")
    i = lam.numel() // 2
    tail = lam[i:]
    denom = float(torch.log(tail / lam[i]).sum())
    if not math.isfinite(denom) or denom <= 0:
        return float("nan")
    return 1.0 + tail.numel() / denom


def lr_ratios(alphas: Mapping[str, float], r_min: float = 1.0, r_max: float = 5.0) -> dict[str, float]:
    """Per-module rate multipliers: the linear map of α from [α_min, α_max] onto [r_min, r_max].

    Non-finite α (dropped layers) keep the base rate (1.0); with no α spread every module gets r_min."""
    finite = [a for a in alphas.values() if math.isfinite(a)]
    if not finite:
        return {k: 1.0 for k in alphas}
    lo, hi = min(finite), max(finite)
    out = {}
    for name, a in alphas.items():
        if not math.isfinite(a):
            out[name] = 1.0
        elif hi == lo:
            out[name] = float(r_min)
        else:
            out[name] = float(r_min + (r_max - r_min) * (a - lo) / (hi - lo))
    return out


def is_edge(name: str, module: nn.Module | None = None) -> bool:
    """Embedding or LM head: the released code matches 'embed' / 'head' in the module's name."""
    leaf = name.rsplit(".", 1)[-1]
    return "embed" in leaf or "head" in leaf or isinstance(module, nn.Embedding)


@contextmanager
def full_weight(weight: torch.Tensor):
    """The whole matrix of a (possibly sharded) weight: DeepSpeed ZeRO-3 gathers it, FSDP2 DTensors are
    gathered with ``full_tensor()``; both are collectives, so every rank must enter."""
    if hasattr(weight, "ds_id"):  # DeepSpeed ZeRO-3 partitioned parameter
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
            yield weight.data
        return
    if hasattr(weight, "full_tensor"):  # torch.distributed DTensor (FSDP2)
        yield weight.full_tensor()
        return
    yield weight


@contextmanager
def cpu_threads(n: int | None):
    """Run the CPU SVDs on ``n`` threads: LAPACK's SVD gains little from threads at these sizes, and on a
    busy machine its OpenMP spin-waits make a 2-thread SVD 100-400x slower than a 1-thread one."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def module_alphas(weights: Mapping[str, tuple[torch.Tensor, bool]], min_eigs: int = 50,
                  esd_dtype: torch.dtype = torch.float32, svd_threads: int | None = 1) -> dict[str, float]:
    """α per module from ``{name: (weight, is_edge)}``: edges get the largest α of the others (their spectra
    are not needed, so not computed); modules with fewer than ``min_eigs`` eigenvalues get nan (dropped).
    ``svd_threads`` caps the CPU threads during the SVDs (None: leave torch's setting)."""
    alphas: dict[str, float] = {}
    for name, (weight, edge) in weights.items():
        if edge:
            continue
        with full_weight(weight) as w:
            if min(w.shape) < min_eigs:
                alphas[name] = float("nan")
                continue
            with cpu_threads(svd_threads if w.device.type == "cpu" else None):
                alphas[name] = hill_alpha(esd(w, esd_dtype))
    finite = [a for a in alphas.values() if math.isfinite(a)]
    top = max(finite) if finite else float("nan")
    for name, (_, edge) in weights.items():
        if edge:
            alphas[name] = top
    return {name: alphas[name] for name in weights}


# ---------------------------------------------------------------------------------------------------------
# Parameter groups and the optimizer factory
# ---------------------------------------------------------------------------------------------------------


def llr_groups(params: Iterable[dict], module: nn.Module) -> list[dict]:
    """Split the module's parameter groups: one group per Linear/Embedding module (per parent group), then one
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
        raise ValueError("llr_optimizer found no nn.Linear / nn.Embedding parameters in the module's param_groups()")
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


def llr_optimizer(params: Iterable[dict], module: nn.Module, optimizer: str = "adamw", lr: float = 5e-4,
                  betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float | None = 0.1,
                  muon_lr: float = 0.02, muon_momentum: float = 0.95, muon_nesterov: bool = True,
                  muon_ns_steps: int = 5, muon_weight_decay: float = 0.0,
                  muon_adjust_lr_fn: str | None = "original") -> torch.optim.Optimizer:
    """The LLR optimizer over per-module groups (see the module docstring).

    Args:
        params: the module's ``param_groups()`` (split further by module here).
        module: the LightningModule (names the parameters and says which are Linear/Embedding).
        optimizer: ``adamw`` (released code) or ``muon`` (paper; Muon on hidden matrices, AdamW elsewhere).
        lr: the uniform (AdamW) base rate η.
        weight_decay: applied to every AdamW group, norms included, as the released code's AdamW does;
            ``None`` keeps each parent group's own value (the base module: matrices only).
        muon_*: Muon's base rate and hyperparameters for the hidden matrices.
    """
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"llr_optimizer(optimizer={optimizer!r}): choose adamw or muon")
    groups = llr_groups(params, module)
    use_muon = optimizer == "muon"
    for g in groups:
        g["use_muon"] = bool(use_muon and g["llr_module"] and not g["llr_edge"] and all(p.ndim == 2 for p in g["params"]))
        base = muon_lr if g["use_muon"] else lr
        g["lr"] = g["llr_base_lr"] = float(base)
        if g["use_muon"]:
            g["weight_decay"] = float(muon_weight_decay)
        elif weight_decay is not None:
            g["weight_decay"] = float(weight_decay)
    adamw = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=0.1 if weight_decay is None else weight_decay)
    if not use_muon:
        return torch.optim.AdamW(groups, **adamw)
    muon = dict(lr=muon_lr, momentum=muon_momentum, nesterov=muon_nesterov, ns_steps=muon_ns_steps,
                weight_decay=muon_weight_decay, adjust_lr_fn=muon_adjust_lr_fn)
    return MuonWithAdamW(groups, muon=muon, adamw=adamw)


llr_optimizer.needs_module = True  # CausalLMModule.configure_optimizers passes module=self to such factories


# ---------------------------------------------------------------------------------------------------------
# The callback: recompute α, ramp, freeze
# ---------------------------------------------------------------------------------------------------------


class LLR(L.Callback):
    """Layer-wise rates from heavy-tailed self-regularization (see the module docstring for the procedure).

    Args:
        every: recompute interval in optimizer steps (released: 100); also recomputed at step 1.
        ramp_steps: L, the linear ramp to the new rate (released: 50).
        ratio: recompute only while step ≤ ratio·total_steps (released LLR_ratio: 0.2); then rates are frozen.
        r_min, r_max: the rate range as multiples of the base rate (released: 1 and 5; variants 3 and 4).
        total_steps: the schedule's length (stop_at); default ``trainer.max_steps``.
        min_eigs: modules with fewer eigenvalues are dropped (base rate).
        esd_dtype: float32 (released) or float64 for the SVD.
        svd_threads: CPU threads for the SVDs (1; None leaves torch's setting); GPU weights are unaffected.
    """

    def __init__(self, every: int = 100, ramp_steps: int = 50, ratio: float = 0.2, r_min: float = 1.0,
                 r_max: float = 5.0, total_steps: int | None = None, min_eigs: int = 50, esd_dtype: str = "float32",
                 svd_threads: int | None = 1):
        if every < 1 or ramp_steps < 0 or not 0 <= ratio <= 1 or r_max < r_min:
            raise ValueError(f"LLR(every={every}, ramp_steps={ramp_steps}, ratio={ratio}, r_min={r_min}, r_max={r_max}): "
                             "need every >= 1, ramp_steps >= 0, 0 <= ratio <= 1, r_max >= r_min")
        if esd_dtype not in ("float32", "float64"):
            raise ValueError(f"LLR(esd_dtype={esd_dtype!r}): choose float32 or float64")
        self.every, self.ramp_steps, self.ratio = int(every), int(ramp_steps), float(ratio)
        self.r_min, self.r_max, self.total_steps = float(r_min), float(r_max), total_steps
        self.min_eigs, self.esd_dtype, self.svd_threads = int(min_eigs), getattr(torch, esd_dtype), svd_threads
        self.ramp: dict | None = None      # {"start", "end", "from", "to"} in trainer.global_step units
        self.alphas: dict[str, float] = {}
        self.ratios: dict[str, float] = {}
        self._history: list[tuple[int, dict, dict]] = []
        self.recompute_steps: list[int] = []

    # --- pure scheduling (also driven directly by tests) ---------------------------------------------
    def due(self, global_step: int, total: int) -> bool:
        """Recompute before optimizer step t = global_step + 1 when t == 1 or t % every == 0, and t <= ratio·total."""
        t = global_step + 1
        return (t == 1 or t % self.every == 0) and t <= self.ratio * total and \
            (not self.recompute_steps or self.recompute_steps[-1] != t)

    def recompute(self, global_step: int, optimizer, scheduler, weights: Mapping[str, tuple[torch.Tensor, bool]],
                  broadcast=None) -> None:
        """New α → new initial rates; start the ramp from each group's current rate to η_new·f(s+L)."""
        alphas = module_alphas(weights, self.min_eigs, self.esd_dtype, self.svd_threads)
        if broadcast is not None:
            alphas = broadcast(alphas)
        ratios = lr_ratios(alphas, self.r_min, self.r_max)
        groups = optimizer.param_groups
        k, L_ = global_step, self.ramp_steps
        new_initial = [g["llr_base_lr"] * (ratios[g["llr_module"]] if g["llr_module"] else 1.0) for g in groups]
        targets = [new_initial[i] * _factor(scheduler, i, k + L_) for i in range(len(groups))]
        tuned = [t for g, t in zip(groups, targets) if g["llr_module"]]
        targets = [t if g["llr_module"] else min(tuned) for g, t in zip(groups, targets)]
        for i, g in enumerate(groups):
            g["initial_lr"] = new_initial[i]
            if scheduler is not None:
                scheduler.base_lrs[i] = new_initial[i]
        self.ramp = {"start": k, "end": k + L_, "from": [float(g["lr"]) for g in groups], "to": [float(t) for t in targets]}
        self.alphas, self.ratios = alphas, ratios
        self.recompute_steps.append(k + 1)

    def apply_ramp(self, global_step: int, optimizer) -> None:
        """During a ramp, each group's rate is linear in the step from its rate at s to its target at s+L."""
        r = self.ramp
        if r is None or not r["start"] <= global_step <= r["end"]:
            return
        frac = 1.0 if r["end"] == r["start"] else (global_step - r["start"]) / (r["end"] - r["start"])
        for g, a, b in zip(optimizer.param_groups, r["from"], r["to"]):
            g["lr"] = a + (b - a) * frac

    # --- Lightning hooks -----------------------------------------------------------------------------
    def _total(self, trainer) -> int:
        total = self.total_steps or trainer.max_steps
        if not total or total <= 0:
            raise ValueError("LLR needs the schedule's length: set trainer.max_steps or callbacks.llr.total_steps")
        return int(total)

    def on_fit_start(self, trainer, pl_module) -> None:
        if len(trainer.optimizers) != 1 or not all("llr_module" in g for g in trainer.optimizers[0].param_groups):
            raise ValueError("the LLR callback needs the LLR optimizer: set model.optimizer._target_=callbacks.llr.llr_optimizer")
        self._total(trainer)
        _scheduler(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        optimizer, scheduler, k = trainer.optimizers[0], _scheduler(trainer), trainer.global_step
        if self.due(k, self._total(trainer)):
            weights = {}
            for g in optimizer.param_groups:
                name = g["llr_module"]
                if name and name not in weights:
                    weights[name] = (pl_module.get_submodule(name).weight, bool(g["llr_edge"]))
            self.recompute(k, optimizer, scheduler, weights,
                           broadcast=lambda obj: trainer.strategy.broadcast(obj, src=0))
            finite = [a for a in self.alphas.values() if math.isfinite(a)]
            if finite:
                pl_module.log_dict({"llr/alpha_min": min(finite), "llr/alpha_max": max(finite),
                                    "llr/alpha_mean": sum(finite) / len(finite)}, on_step=True, on_epoch=False)
            self._history.append((k, dict(self.alphas), dict(self.ratios)))  # for the dashboard at fit end
            results = getattr(pl_module, "results", None) or {}
            results["llr"] = {"alphas": dict(self.alphas), "lr_ratio": dict(self.ratios),
                              "recompute_steps": list(self.recompute_steps)}
            pl_module.results = results
        self.apply_ramp(k, optimizer)

    def on_fit_end(self, trainer, pl_module) -> None:
        """Per-layer α and LR multiplier over the recompute steps (of this process: not kept across a resume)."""
        from lightning_modules.common.dashboard import heatmap, log_table

        if not self._history:
            return
        log_table("llr/recomputes", [{"step": k, "module": m, "alpha": a[m], "lr_ratio": r.get(m)}
                                     for k, a, r in self._history for m in a], trainer.loggers)
        modules, steps = list(self._history[-1][1]), [k for k, _, _ in self._history]
        for key, idx in (("alpha", 1), ("lr_ratio", 2)):
            values = [[h[idx].get(m, float("nan")) for h in self._history] for m in modules]
            heatmap(f"llr/{key}", values, trainer.loggers, xlabel="recompute step", ylabel="module",
                    xticks=steps, yticks=modules)

    def state_dict(self) -> dict:
        return {"ramp": self.ramp, "alphas": self.alphas, "ratios": self.ratios, "recompute_steps": self.recompute_steps}

    def load_state_dict(self, state_dict: dict) -> None:
        self.ramp = state_dict.get("ramp")
        self.alphas = dict(state_dict.get("alphas", {}))
        self.ratios = dict(state_dict.get("ratios", {}))
        self.recompute_steps = list(state_dict.get("recompute_steps", []))


def _scheduler(trainer):
    configs = trainer.lr_scheduler_configs
    if not configs:
        return None
    sched = configs[0].scheduler
    if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        raise ValueError(f"the LLR callback needs a LambdaLR schedule (e.g. lightning_modules.common.lm.warmup_cosine) "
                         f"or none, got {type(sched).__name__}")
    return sched


def _factor(scheduler, index: int, step: int) -> float:
    """The schedule's multiplier f(step) for one group (1 without a scheduler)."""
    return 1.0 if scheduler is None else float(scheduler.lr_lambdas[index](step))
