"""The shared calibrate-then-quantize driver: every linear layer of every block, in order, one quantizer.

Modes (WaterSIC spec §4.2-4.3):
- ``plain``: one calibration pass over the full-precision model collects Σ = E[xxᵀ] for every layer (float64,
  streaming); each layer is then quantized from its own Σ.
- ``sequential`` (the spec's Qronos mode): layers are quantized in order, and each group of layers that reads
  the same input (q/k/v; gate/up; ...) gets Σ_X̂ from the *already-quantized* model, Σ_{XX̂} = E[x x̂ᵀ] against the
  full-precision model's inputs of the same tokens and Σ_X; the quantizer then minimises E‖Wx − Ŵx̂‖². Each group
  costs one (early-stopped) forward pass of each model over the calibration set.

Only the ``nn.Linear`` layers inside the repeated blocks are quantized: embeddings and the LM head stay in full
precision and are excluded from the rate. ``rate_control`` (spec §4.3) spreads one global budget over the layers in
order: each layer's target is remaining bits / remaining weights, clamped to [0.05, 16], and its actual rate is
charged back. The returned report holds a row per layer and the weight-averaged rates.
"""
from __future__ import annotations

import copy
import time
from typing import Iterable

import torch

from lightning_modules.common.quantize.base import LayerStats, Quantizer
from lightning_modules.common.quantize.calibration import MomentCollector, capture_inputs, eval_mode, run_batch
from lightning_modules.common.quantize.limits import layer_limit

MODES = ("plain", "sequential")


def blocks(model) -> list[torch.nn.Module]:
    """The repeated transformer blocks: the first non-empty ModuleList."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            return list(mod)
    raise ValueError(f"{type(model).__name__} has no ModuleList of blocks to quantize")


@torch.no_grad()
def linear_groups(model, batch: dict, exclude: Iterable[str] = ()) -> list[list[tuple[str, torch.nn.Linear]]]:
    """The quantizable linears, in forward order, grouped by the input tensor they share (found by one probe pass)."""
    names = {id(m): n for n, m in model.named_modules()}
    linears = [(names[id(m)], m) for blk in blocks(model) for m in blk.modules() if isinstance(m, torch.nn.Linear)]
    linears = [(n, m) for n, m in linears if not any(e in n for e in exclude)]
    seen: list[tuple[str, torch.nn.Module, torch.Tensor]] = []  # holding the inputs keeps their identity unique
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.append((n, mod, args[0])))
             for n, m in linears]
    try:
        run_batch(model, {k: v[:1] for k, v in batch.items() if torch.is_tensor(v)})
    finally:
        for h in hooks:
            h.remove()
    groups, ptrs, done = [], [], set()
    for n, m, x in seen:
        if n in done:
            continue
        done.add(n)
        if groups and ptrs[-1] is x:
            groups[-1].append((n, m))
        else:
            groups.append([(n, m)])
            ptrs.append(x)
    return groups


def _summary(rows: list[dict]) -> dict:
    total = sum(r["rows"] * r["cols"] for r in rows)
    out = {"n_weights": total, "n_layers": len(rows)}
    for key in ("bits", "bits_pooled", "bits_column", "bits_cardinality", "rd_limit", "rel_mse"):
        vals = [(r[key], r["rows"] * r["cols"]) for r in rows if r.get(key) is not None]
        if vals and len(vals) == len(rows):
            out[key] = sum(v * w for v, w in vals) / total
    out["time_s"] = sum(r["time_s"] for r in rows)
    return out


@torch.no_grad()
def quantize_model(model, quantizer: Quantizer, batches: list[dict], rate: float, mode: str = "plain",
                   rate_control: bool = False, reference=None, exclude: Iterable[str] = (),
                   with_limit: bool = True, stats_device: str | None = None, log=print) -> dict:
    """Quantize ``model`` in place; returns {"layers": [...], "summary": {...}}.

    ``stats_device``: where plain mode keeps its float64 Σ accumulators (e.g. ``cpu`` when all layers' Σ do not fit
    beside the model); each layer's Σ is moved to the weight's device when it is quantized."""
    if mode not in MODES:
        raise ValueError(f"quantize mode={mode!r}: use one of {MODES}")
    if not batches:
        raise ValueError("no calibration batches: raise the number of calibration sequences")
    with eval_mode(model):
        groups = linear_groups(model, batches[0], exclude)
        total = sum(m.weight.numel() for g in groups for _, m in g)
        budget_bits, budget_weights = rate * total, total
        budgeted = rate_control and quantizer.fractional_rate
        rows: list[dict] = []
        plain_stats = {}
        if mode == "plain":
            with MomentCollector({g[0][0]: g[0][1] for g in groups}, device=stats_device) as col:
                for b in batches:
                    run_batch(model, b)
            plain_stats = {k: LayerStats(v, tokens=col.counts[k]) for k, v in col.moments().items()}
        else:
            reference = reference if reference is not None else copy.deepcopy(model)
            ref_modules = dict(reference.named_modules())
        for group in groups:
            key = group[0][0]
            if mode == "plain":
                dev = group[0][1].weight.device
                stats = LayerStats(plain_stats.pop(key).sigma.to(dev), tokens=0)
            else:
                stats = _sequential_stats(model, reference, ref_modules, group, batches)
            for name, mod in group:
                target = rate
                if budgeted:
                    target = min(16.0, max(0.05, budget_bits / budget_weights))
                t0 = time.time()
                w = mod.weight.detach().double()
                res = quantizer.quantize(w, stats, target, rate_control=budgeted)
                mod.weight.copy_(res.weight.to(mod.weight.dtype))
                mse = stats.output_error(w, res.weight)
                row = {"layer": name, "rows": w.shape[0], "cols": w.shape[1], "target": target,
                       "bits": res.rate.bits, "bits_pooled": res.rate.bits_pooled, "bits_column": res.rate.bits_column,
                       "bits_cardinality": res.rate.bits_cardinality, "mse": mse,
                       "rel_mse": mse / max(stats.signal_power(w), 1e-300), "time_s": time.time() - t0}
                if with_limit:
                    row["rd_limit"] = layer_limit(w, stats.sigma, mse)
                rows.append(row)
                budget_bits -= res.rate.bits * w.numel()
                budget_weights -= w.numel()
                if log:
                    log(f"[quantize] {name}: {row['bits']:.3f} bits, rel. output MSE {row['rel_mse']:.4g}")
    return {"layers": rows, "summary": _summary(rows)}


def _sequential_stats(model, reference, ref_modules, group, batches) -> LayerStats:
    name, mod = group[0]
    ref_mod = ref_modules[name]
    sig_h = cross = sig_x = None
    count = 0
    with eval_mode(reference):
        for b in batches:
            x = capture_inputs(reference, ref_mod, b)
            xh = capture_inputs(model, mod, b)
            x = x.reshape(-1, x.shape[-1]).double()
            xh = xh.reshape(-1, xh.shape[-1]).double().to(x.device)
            if b.get("attention_mask") is not None:
                keep = b["attention_mask"].reshape(-1).bool().to(x.device)
                x, xh = x[keep], xh[keep]
            upd = (xh.T @ xh, x.T @ xh, x.T @ x)
            if sig_h is None:
                sig_h, cross, sig_x = upd
            else:
                sig_h += upd[0]
                cross += upd[1]
                sig_x += upd[2]
            count += x.shape[0]
    return LayerStats(sig_h / count, cross / count, sig_x / count, tokens=count)
