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

WaterSIC pipeline extras (spec §4.3; off by default as in the release's CLI, on in the paper-scale experiments, which
reproduce the paper's best runs):
- ``residual_compensation`` (``--residual_compensation``, sequential mode): for the layers whose output is added to
  the residual stream (``o_proj``, ``down_proj``) the statistics also carry Σ_{ΔR,X̂} = E[(R − R̂) x̂ᵀ], R the residual
  this layer's output is added to (the input of the block's ``input_layernorm`` / ``post_attention_layernorm``, HF
  Llama / Qwen naming, ``RESIDUAL_SOURCES``) in the full-precision and quantized models; the layer then minimises
  E‖Wx + R − Ŵx̂ − R̂‖², cancelling the error already in the residual stream.
- ``attn_weighted_qkv`` = ε (``--attn_weighted_qkv``, the "BOS fix", sequential mode; paper 0.01): the q/k/v input
  statistics weight each token by the attention mass it receives in the full-precision model (summed over queries,
  mean over heads, normalised to mean 1), mixed (1 − ε)·weighted + ε·unweighted. [silent] in the spec: the exact
  importance; ours is the attention received, the quantity that makes the attention-sink (BOS) token matter.
- ``zero_out_rows`` (``--zero_out_rows``, the Qwen3-8B 2.125-bit headline): {layer-name substring: [rows]}; those
  output rows are set to zero and not coded (the rest of the matrix is quantized alone; the layer is charged the
  rest's bits over all its weights). The release's Qwen3-8B rows (its README's string format) are parsed by
  ``lightning_modules.watersic.module.parse_zero_out_rows``.
- ``eps_search`` (``--attn_weighted_adapt_eps_joint`` / ``--qronos_adapt``): per q/k/v group, golden-section search
  (``eps_steps`` = 10 each) over q_eps (statistics (1 − q)·Qronos + q·plain) and then a_eps (the ε above), each
  minimising the relative MSE at the block's ``o_proj`` input over the calibration batches.

``offload`` (a device, e.g. ``cuda``; null = off): the model and its reference stay in host memory and one block at
a time is quantized on that device from hidden states carried block by block (``offload.py``), so a model larger
than the GPU (Llama-3-70B on one 80 GB card) runs; same groups, statistics and budget as the in-memory path.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from typing import Iterable

import torch

from lightning_modules.common.quantize.base import LayerStats, Quantizer
from lightning_modules.common.quantize.calibration import (MomentCollector, capture_inputs, eval_mode, run_batch,
                                                           stop_at)
from lightning_modules.common.quantize.limits import layer_limit
from lightning_modules.common.quantize.offload import BlockwiseRunner, blocks  # noqa: F401 (blocks: imported from here)

MODES = ("plain", "sequential")
# a residual-writing layer -> the module whose input is the residual its output is added to (HF Llama / Qwen / Mistral)
RESIDUAL_SOURCES = {"o_proj": "input_layernorm", "down_proj": "post_attention_layernorm"}
QKV = ("q_proj", "k_proj", "v_proj")
ATTN_OUT = "o_proj"


class WholeModelRunner:
    """The in-memory path's captures: the whole model (or its reference) runs up to the module and stops there.
    ``BlockwiseRunner`` (``offload.py``) gives the same answers from one block at a time."""

    def __init__(self, model, reference, batches: list[dict]):
        self.model, self.sides, self.batches = model, {"model": model, "reference": reference}, batches

    def capture(self, side: str, module, i: int) -> torch.Tensor:
        return capture_inputs(self.sides[side], module, self.batches[i])

    def attention_probs(self, attn, i: int) -> torch.Tensor:
        return _attention_probs(self.sides["reference"], attn, self.batches[i])


def _block_linears(model, within, exclude) -> list[tuple[str, torch.nn.Linear]]:
    names = {id(m): n for n, m in model.named_modules()}
    linears = [(names[id(m)], m) for blk in within for m in blk.modules() if isinstance(m, torch.nn.Linear)]
    return [(n, m) for n, m in linears if not any(e in n for e in exclude)]


@torch.no_grad()
def linear_groups(model, batch: dict, exclude: Iterable[str] = (), within=None, probe=None
                  ) -> list[list[tuple[str, torch.nn.Linear]]]:
    """The quantizable linears, in forward order, grouped by the input tensor they share (found by one probe pass).
    ``within`` (blocks) and ``probe`` (a call that runs them) limit it to some blocks; default: every block, and the
    whole model on the batch's first row."""
    linears = _block_linears(model, blocks(model) if within is None else within, exclude)
    seen: list[tuple[str, torch.nn.Module, torch.Tensor]] = []  # holding the inputs keeps their identity unique
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.append((n, mod, args[0])))
             for n, m in linears]
    try:
        if probe is None:
            run_batch(model, {k: v[:1] for k, v in batch.items() if torch.is_tensor(v)})
        else:
            probe()
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
                   with_limit: bool = True, stats_device: str | None = None, residual_compensation: bool = False,
                   attn_weighted_qkv: float | None = None, zero_out_rows: dict | None = None, eps_search: bool = False,
                   eps_steps: int = 10, offload: str | None = None, log=print) -> dict:
    """Quantize ``model`` in place; returns {"layers": [...], "summary": {...}, "factors": {name: (t, g)}} (the
    diagonal factors of each factored Ŵ = diag(t)·A·diag(g), WaterSIC's, for WaterSIC-FT), "input_scales"
    {name: s} (AWQ's per-input-channel scales, for an activation quantizer that must see x/s) and "grids"
    {name: AffineGrid} (each layer's uniform grid, from quantizers that report one: what ``export.py`` packs).
    A batch may carry ``token_weight`` (B×S, c_j ≥ 0): every Σ is then Σ_j c_j x_j x_jᵀ / Σ_j c_j (dllmquant's CGQ).

    ``stats_device``: where plain mode keeps its float64 Σ accumulators (e.g. ``cpu`` when all layers' Σ do not fit
    beside the model); each layer's Σ is moved to the weight's device when it is quantized. ``offload``: a device;
    the models stay in host memory and each block is quantized there in turn (module doc)."""
    if mode not in MODES:
        raise ValueError(f"quantize mode={mode!r}: use one of {MODES}")
    if not batches:
        raise ValueError("no calibration batches: raise the number of calibration sequences")
    if mode != "sequential" and (residual_compensation or attn_weighted_qkv is not None or eps_search):
        raise ValueError("residual_compensation, attn_weighted_qkv and eps_search need the quantized model's inputs: "
                         "set model.mode=sequential")
    if attn_weighted_qkv is not None and not 0.0 <= attn_weighted_qkv <= 1.0:
        raise ValueError(f"attn_weighted_qkv={attn_weighted_qkv}: ε mixes weighted and plain statistics, use 0..1")
    zero_out_rows = dict(zero_out_rows or {})
    sequential = mode == "sequential"
    if sequential and reference is None:
        reference = copy.deepcopy(model)
    ref_modules = dict(reference.named_modules()) if reference is not None else {}
    with eval_mode(model, *([reference] if reference is not None else [])):
        if offload is None:
            runner = WholeModelRunner(model, reference, batches)
            groups = linear_groups(model, batches[0], exclude)
            total = sum(m.weight.numel() for g in groups for _, m in g)
            stages = [groups]
        else:
            runner = BlockwiseRunner(model, reference, batches, offload, sequential, attn_weighted_qkv is not None)
            total = sum(m.weight.numel() for _, m in _block_linears(model, blocks(model), exclude))
            stages = _block_stages(model, runner, exclude)
        budget_bits, budget_weights = rate * total, total
        budgeted = rate_control and quantizer.fractional_rate
        rows: list[dict] = []
        eps, factors, input_scales, grids = {}, {}, {}, {}
        for groups in stages:
            plain_stats = {}
            if not sequential:
                keys = {g[0][0]: g[0][1] for g in groups}
                weights = [b.get("token_weight") for b in batches]  # per-token c_j (dllmquant's CGQ), None = all 1
                if offload is None:
                    with MomentCollector(keys, device=stats_device) as col:
                        for b, w in zip(batches, weights):
                            col.weight = w
                            run_batch(model, b)
                    moments, counts = col.moments(), col.counts
                else:
                    moments, counts = runner.plain_moments(keys, stats_device, weights)
                plain_stats = {k: LayerStats(v, tokens=counts[k]) for k, v in moments.items()}
            for group in groups:
                key = group[0][0]
                if not sequential:
                    dev = group[0][1].weight.device
                    stats = LayerStats(plain_stats.pop(key).sigma.to(dev), tokens=0)
                else:
                    extras = {"residual": residual_compensation, "a_eps": attn_weighted_qkv}
                    if eps_search and _is_qkv(group):
                        now = min(16.0, max(0.05, budget_bits / budget_weights)) if budgeted else rate
                        extras = _search_eps(runner, ref_modules, group, batches, quantizer, now, extras, eps_steps,
                                             log)
                    stats = _sequential_stats(runner, ref_modules, group, batches, **extras)
                    eps = {k: extras[k] for k in ("q_eps", "a_eps") if extras.get(k) is not None and _is_qkv(group)}
                for name, mod in group:
                    target = rate
                    if budgeted:
                        target = min(16.0, max(0.05, budget_bits / budget_weights))
                    t0 = time.time()
                    w = mod.weight.detach().double()
                    zero = sorted({int(i) for k, v in zero_out_rows.items() if k in name for i in v})
                    w_hat, rep = quantize_rows(quantizer, w, stats, target, budgeted, zero)
                    if "factors" in rep:
                        factors[name] = rep.pop("factors")
                    if "input_scale" in rep:
                        input_scales[name] = rep.pop("input_scale")
                    if "grid" in rep:
                        grids[name] = rep.pop("grid")
                    mod.weight.copy_(w_hat.to(mod.weight.dtype))
                    mse = stats.output_error(w, w_hat)
                    row = {"layer": name, "rows": w.shape[0], "cols": w.shape[1], "target": target,
                           "zeroed_rows": len(zero), **rep, **eps, "mse": mse,
                           "rel_mse": mse / max(stats.signal_power(w), 1e-300), "time_s": time.time() - t0}
                    if with_limit:
                        row["rd_limit"] = layer_limit(w, stats.sigma, mse)
                    rows.append(row)
                    budget_bits -= row["bits"] * w.numel()
                    budget_weights -= w.numel()
                    if log:
                        log(f"[quantize] {name}: {row['bits']:.3f} bits, rel. output MSE {row['rel_mse']:.4g}")
    return {"layers": rows, "summary": _summary(rows), "factors": factors, "input_scales": input_scales,
            "grids": grids}


def _block_stages(model, runner: BlockwiseRunner, exclude):
    """The offloaded path's stages: per block (on the device for the stage), its groups found by running it alone."""
    for index in runner.stages():
        block = runner.layers["model"][index]
        yield linear_groups(model, {}, exclude, within=[block], probe=lambda: runner._run("model", 0))


def quantize_rows(quantizer: Quantizer, w: torch.Tensor, stats: LayerStats, rate: float, rate_control: bool,
                  zero_rows: list[int]) -> tuple[torch.Tensor, dict]:
    """Quantize ``w`` except the rows in ``zero_rows`` (set to zero, not coded); returns Ŵ and the layer's rates
    (bits per weight of the whole layer: the coded rows' bits spread over all rows)."""
    keep = torch.ones(w.shape[0], dtype=torch.bool, device=w.device)
    if zero_rows:
        if max(zero_rows) >= w.shape[0]:
            raise ValueError(f"zero_out_rows: row {max(zero_rows)} is outside a layer of {w.shape[0]} rows")
        keep[zero_rows] = False
    sub = stats if stats.residual_cross is None else dataclasses.replace(stats, residual_cross=stats.residual_cross[keep])
    res = quantizer.quantize(w[keep], sub, rate, rate_control=rate_control)
    w_hat = torch.zeros_like(w)
    w_hat[keep] = res.weight.to(w)
    frac = float(keep.float().mean())
    r = res.rate
    rep = {k: (None if v is None else v * frac) for k, v in (("bits", r.bits), ("bits_pooled", r.bits_pooled),
                                                            ("bits_column", r.bits_column),
                                                            ("bits_cardinality", r.bits_cardinality))}
    if "t" in res.info:  # row factors of a factored Ŵ (WaterSIC), zero on the zeroed rows
        t = torch.zeros(w.shape[0], dtype=res.info["t"].dtype, device=w.device)
        t[keep] = res.info["t"]
        rep["factors"] = (t, res.info["g"])
    if "input_scale" in res.info:  # per-input-channel scale s (AWQ): Ŵ = Q(W·diag s)·diag(1/s)
        rep["input_scale"] = res.info["input_scale"]
    if "grid" in res.info:  # the zeroed rows get scale 0: every code decodes to 0 there
        g = res.info["grid"]
        scale = torch.zeros(w.shape[0], g.scale.shape[1], dtype=g.scale.dtype)
        zero = torch.zeros_like(scale)
        scale[keep.cpu()], zero[keep.cpu()] = g.scale, g.zero
        rep["grid"] = dataclasses.replace(g, scale=scale, zero=zero)
    return w_hat, rep


def _is_qkv(group) -> bool:
    return any(name.endswith(QKV) for name, _ in group)


def _block_prefix(name: str) -> str:
    """``model.layers.3.self_attn.q_proj`` -> ``model.layers.3`` (the block holding a layer)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit():
            return ".".join(parts[:i + 1])
    raise ValueError(f"{name}: no block index in the layer name")


def attention_token_weights(model, block_prefix: str, batch: dict) -> torch.Tensor:
    """Per-token attention importance in one block (B×S): the attention mass each token receives, summed over
    queries and averaged over heads, normalised to mean 1 over the (unpadded) tokens. Runs the attention in
    ``eager`` mode (the one that returns its probabilities) and stops the forward after that block's attention."""
    attn = dict(model.named_modules())[block_prefix + ".self_attn"]
    return token_weights(_attention_probs(model, attn, batch), batch.get("attention_mask"))


def token_weights(probs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, heads, S, S) attention probabilities -> (B, S) attention received, mean 1 over the unpadded tokens."""
    w = probs.double().mean(1).sum(1)  # (B, S): mean over heads, sum over queries
    mask = torch.ones_like(w) if mask is None else mask.to(w)
    return w * mask / (w * mask).sum() * mask.sum()


def _attention_probs(model, attn, batch: dict) -> torch.Tensor:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        model.set_attn_implementation("eager")
    try:
        return stop_at(attn, lambda: run_batch(model, batch), output_index=1)
    finally:
        if impl not in (None, "eager"):
            model.set_attn_implementation(impl)


def _sequential_stats(runner, ref_modules, group, batches, residual: bool = False,
                      a_eps: float | None = None, q_eps: float = 0.0) -> LayerStats:
    """Qronos statistics of one group's shared input over the calibration batches (module doc for the extras).
    ``q_eps`` blends toward plain statistics: Σ_X̂, Σ_{XX̂} ← (1 − q)·(Qronos) + q·Σ_X (q = 1: plain mode's Σ)."""
    name, mod = group[0]
    ref_mod = ref_modules[name]
    prefix = _block_prefix(name)
    source = next((v for k, v in RESIDUAL_SOURCES.items() if name.endswith(k)), None) if residual else None
    weighted = a_eps is not None and _is_qkv(group)
    acc: dict[str, torch.Tensor] = {}
    count = 0.0
    mods = dict(runner.model.named_modules())

    def add(key, val):
        acc[key] = acc[key] + val if key in acc else val

    for i, b in enumerate(batches):
        x = runner.capture("reference", ref_mod, i)
        xh = runner.capture("model", mod, i).to(x.device)
        keep = b["attention_mask"].reshape(-1).bool().to(x.device) if b.get("attention_mask") is not None else None
        flat = lambda t: t.reshape(-1, t.shape[-1]).double() if keep is None else t.reshape(-1, t.shape[-1]).double()[keep]
        x, xh = flat(x), flat(xh)
        tok = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
        if weighted:
            probs = runner.attention_probs(ref_modules[prefix + ".self_attn"], i)
            aw = token_weights(probs, b.get("attention_mask")).reshape(-1).to(x.device)
            aw = aw if keep is None else aw[keep]
            tok = (1 - a_eps) * aw + a_eps * tok
        if b.get("token_weight") is not None:  # per-token weights c_j (dllmquant's CGQ)
            c = b["token_weight"].reshape(-1).to(x)
            tok = tok * (c if keep is None else c[keep])
        xw = x * tok.unsqueeze(1)
        add("sig_h", (xh * tok.unsqueeze(1)).T @ xh)
        add("cross", xw.T @ xh)
        add("sig_x", xw.T @ x)
        if source is not None:
            r = flat(runner.capture("reference", ref_modules[f"{prefix}.{source}"], i))
            rh = flat(runner.capture("model", mods[f"{prefix}.{source}"], i).to(x.device))
            add("res", ((r - rh) * tok.unsqueeze(1)).T @ xh)
        count += float(tok.sum())  # Σ c_j: the weighted mean (the token count when unweighted)
    if q_eps:  # blend toward plain statistics (x̂ = x)
        acc["sig_h"] = (1 - q_eps) * acc["sig_h"] + q_eps * acc["sig_x"]
        acc["cross"] = (1 - q_eps) * acc["cross"] + q_eps * acc["sig_x"]
    return LayerStats(acc["sig_h"] / count, acc["cross"] / count, acc["sig_x"] / count, tokens=round(count),
                      residual_cross=acc["res"] / count if "res" in acc else None)


def golden_section(f, lo: float, hi: float, steps: int = 10) -> tuple[float, float]:
    """Minimise a unimodal ``f`` on [lo, hi] with ``steps`` golden-section evaluations after the first two;
    returns (argmin among the evaluated points, its value)."""
    inv = (5 ** 0.5 - 1) / 2
    a, b = lo, hi
    c, d = b - inv * (b - a), a + inv * (b - a)
    fc, fd = f(c), f(d)
    seen = [(fc, c), (fd, d)]
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - inv * (b - a)
            fc = f(c)
            seen.append((fc, c))
        else:
            a, c, fc = c, d, fd
            d = a + inv * (b - a)
            fd = f(d)
            seen.append((fd, d))
    val, arg = min(seen)
    return arg, val


def _search_eps(runner, ref_modules, group, batches, quantizer, rate, extras, steps, log) -> dict:
    """The joint ε search for one q/k/v group: q_eps, then a_eps (if attention weighting is on), each by golden
    section on [0, 1], minimising the relative MSE at the block's o_proj input; the group is restored after each
    trial. Returns the statistics' keyword arguments with the chosen ε."""
    prefix = _block_prefix(group[0][0])
    probe_name = f"{prefix}.self_attn.{ATTN_OUT}"
    mods = dict(runner.model.named_modules())
    saved = [m.weight.detach().clone() for _, m in group]
    ref_in = [runner.capture("reference", ref_modules[probe_name], i).double() for i in range(len(batches))]

    def rel_mse(kw) -> float:
        stats = _sequential_stats(runner, ref_modules, group, batches, **kw)
        try:
            for _, m in group:
                m.weight.copy_(quantizer.quantize(m.weight.detach().double(), stats, rate).weight.to(m.weight.dtype))
            err = sum(float(((runner.capture("model", mods[probe_name], i).double().to(r.device) - r) ** 2).sum())
                      for i, r in enumerate(ref_in))
        finally:
            for (_, m), w in zip(group, saved):
                m.weight.copy_(w)
        return err / sum(float((r ** 2).sum()) for r in ref_in)

    kw = dict(extras)
    kw["q_eps"], val = golden_section(lambda q: rel_mse({**kw, "q_eps": q}), 0.0, 1.0, steps)
    if kw.get("a_eps") is not None:
        kw["a_eps"], val = golden_section(lambda e: rel_mse({**kw, "a_eps": e}), 0.0, 1.0, steps)
    if log:
        log(f"[quantize] {prefix} ε search: q_eps {kw['q_eps']:.3f}, a_eps {kw.get('a_eps')}, rel. MSE {val:.4g}")
    return kw
