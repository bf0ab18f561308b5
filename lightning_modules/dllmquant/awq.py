"""AWQ (Lin et al., 2024) behind the ``Quantizer`` interface (one user today, dllmquant; it moves to
``common/quantize/`` when a second paper needs it).

``search: block`` (the default: the release, mit-han-lab/llm-awq ``run_awq``, written from its description, issue 40)
works on the model before the driver collects its statistics (``AWQ.prepare(model, batches)``), block by block on
the calibration batches, each block's inputs coming from the full-precision model:

- **scale search**: for each group of linears that read one input — q/k/v (inspected through the attention's
  output), o_proj (its own output; only when v_proj's outputs are o_proj's inputs, i.e. no grouped-query
  attention), gate/up (the MLP's output), down_proj (its own output) — the input channels' mean |x| over the
  calibration tokens, m; for each ratio a = i/n_grid, i = 0..n_grid−1: s = max(m^a, 1e-4), s /= √(max s · min s),
  the group's weights set to Q(W·diag s)·diag(1/s) with Q the grid below, and the inspected module's output error
  mean ‖y − ŷ‖² against the full-precision output; the best s is folded into the model: W ← W·diag s and the
  producer of the input divided by s (input_layernorm, v_proj's rows, post_attention_layernorm, up_proj's rows),
  so the block computes the same function and every later input (and a W4A4 activation quantizer) sees x/s;
- **clip search** (``clip``): for every scaled linear but q/k (their error passes through QKᵀ), per row and group of
  ``group_size`` inputs, the clip max |w| ← (1 − i/n_grid)·max |w|, i < ``max_shrink``·n_grid, that minimises the
  group's partial-output error Δ_g Σ_g Δ_gᵀ (Δ = Q(clip w) − w), then W is clamped. Σ_g is the group's input
  second moment over all calibration tokens (``clip_tokens: null``, ours: exact, and memory is no reason to
  subsample through Σ); ``clip_tokens: 512`` takes every k-th token as the release does (its 512-token sample);
- the driver then rounds the scaled, clipped weights to the ``minmax_group`` grid of ``rtn.py`` with AWQ's range
  rule (the group's own min and max; 2^R codes and a zero point per group of 128).

Calibration tokens carry ``batch["token_weight"]`` c_j (CGQ, or 1): m, the output errors and Σ_g are c-weighted means.

``search: layer`` (ours before issue 40, a switch): no pass over the model; per linear, s = (√diag Σ)^a (the RMS of
each input channel) with a on a ``n_grid``-point grid in [0, 1] minimising the linear's own output error
tr((W−Ŵ)Σ(W−Ŵ)ᵀ), Ŵ = Q(W·diag s)·diag(1/s) on ``grid`` (``absmax_row``: per-row symmetric, ours; or
``minmax_group``); ``info["input_scale"]`` carries s to a W4A4 activation quantizer (``fake_quant.set_input_scales``).
It needs only Σ, but the RMS weighs outliers more than the release's mean |x|, and a per-linear error ignores what
the attention and the MLP do with it.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from lightning_modules.common.quantize.base import LayerStats, QuantResult, Quantizer
from lightning_modules.common.quantize.rtn import (absmax_scale, affine_params, affine_result, affine_round, affine_rtn,
                                                   check_grid, grid_rate_report, group_bounds, levels_for_rate,
                                                   round_to_grid, symmetric_grid)

SEARCHES = ("block", "layer")


def awq_quantize(weight: torch.Tensor, sigma: torch.Tensor, levels: int, a: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``search: layer`` on the absmax_row grid: (Ŵ, codes, s, the per-row step of W·diag s) for one exponent ``a``."""
    w = weight.double()
    m = torch.diagonal(sigma.double()).clamp_min(0).sqrt()
    s = (m.clamp_min(1e-8) ** a) if a else torch.ones_like(m)
    ws = w * s
    step = absmax_scale(ws, levels)
    q, codes = round_to_grid(ws, step, levels)
    return q / s, codes, s, step


def pseudo_quantize(w: torch.Tensor, levels: int, group_size: int) -> torch.Tensor:
    """AWQ's weight grid: asymmetric min-max groups (the group's own range), in ``w``'s dtype."""
    return affine_rtn(w.double(), levels, group_size, include_zero=False)[0].to(w.dtype)


class AWQ(Quantizer):
    name = "awq"
    no_grid_reason = None  # reports its AffineGrid

    def __init__(self, search: str = "block", n_grid: int = 20, clip: bool = True, max_shrink: float = 0.5,
                 clip_tokens: int | None = None, grid: str = "minmax_group", group_size: int = 128,
                 accounting: str = "cardinality"):
        if search not in SEARCHES:
            raise ValueError(f"awq search={search!r}: choose block (the release: mean |x|, block outputs) or layer")
        if n_grid < 1:
            raise ValueError(f"awq n_grid={n_grid}: at least one ratio")
        check_grid(grid, group_size)
        if search == "block" and grid != "minmax_group":
            raise ValueError("awq search=block quantizes on the release's grid: grid=minmax_group (or search=layer)")
        self.search, self.n_grid, self.clip, self.max_shrink = search, n_grid, clip, max_shrink
        self.clip_tokens, self.grid, self.group_size, self.accounting = clip_tokens, grid, group_size, accounting
        self.prepared = False

    # --- search: layer (ours) -------------------------------------------------------------------------------
    def exponents(self) -> list[float]:
        return [0.0] if self.n_grid == 1 else [i / (self.n_grid - 1) for i in range(self.n_grid)]

    def _layer_quantize(self, weight: torch.Tensor, stats: LayerStats, levels: int) -> QuantResult:
        best = None
        for a in self.exponents():
            m = torch.diagonal(stats.sigma.double()).clamp_min(0).sqrt()
            s = (m.clamp_min(1e-8) ** a) if a else torch.ones_like(m)
            if self.grid == "minmax_group":
                q, codes, step, zero = affine_rtn(weight.double() * s, levels, self.group_size, include_zero=False)
                w_hat, extra = q / s, (step, zero)
            else:
                w_hat, codes, s, step = awq_quantize(weight, stats.sigma, levels, a)
                extra = step
            d = weight.double() - w_hat
            err = float(((d @ stats.sigma.double()) * d).sum())
            if best is None or err < best[0]:
                best = (err, a, w_hat, codes, s, extra)
        _, a, w_hat, codes, s, extra = best
        info = {"awq_a": a, "input_scale": s}
        # the grid is W·diag(s)'s: a packed layer applies it to x / s (export.py)
        if isinstance(extra, tuple):
            return affine_result(w_hat, codes, *extra, levels, self.accounting, **info)
        return QuantResult(w_hat, codes.to(torch.int32), grid_rate_report(codes, levels, self.accounting),
                           {"levels": levels, "nominal_bits": math.log2(levels), **info,
                            "grid": symmetric_grid(extra, levels)})

    # --- the driver's call ------------------------------------------------------------------------------------
    def quantize(self, weight: torch.Tensor, stats: LayerStats, rate: float, rate_control: bool = False) -> QuantResult:
        levels = levels_for_rate(rate)
        if self.search == "layer":
            return self._layer_quantize(weight, stats, levels)
        if not self.prepared:
            raise ValueError("awq search=block: AWQ.prepare(model, batches) must scale and clip the model before the "
                             "driver quantizes it (DLLMQuantModule.quantize does)")
        return affine_result(*affine_rtn(weight.double(), levels, self.group_size, include_zero=False), levels,
                             self.accounting)

    # --- search: block (the release) --------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, model, batches: list[dict], rate: float, log=print) -> dict:
        """Scale (and clip) ``model``'s blocks in place from the calibration ``batches``; returns per layer group the
        chosen ratio and per clipped linear the mean shrink. A no-op for ``search: layer``."""
        if self.search == "layer":
            return {}
        levels = levels_for_rate(rate)
        report = {}
        for i, (block, inputs) in enumerate(_block_inputs(model, batches)):
            report.update(self._prepare_block(block, inputs, levels, f"{i}", log))
        self.prepared = True
        return report

    def _prepare_block(self, block, inputs, levels: int, tag: str, log) -> dict:
        attn, mlp = _child(block, "self_attn"), _child(block, "mlp")
        q, k, v, o = (_child(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        gate, up, down = (_child(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        ln1, ln2 = _child(block, "input_layernorm"), _child(block, "post_attention_layernorm")
        seen = _run_block(block, inputs, {"attn": attn, "o": o, "mlp": mlp, "down": down})
        weights = [b["weight"] for b in inputs]
        groups = [("qkv", [q, k, v], ln1, seen["attn"], lambda x, kw: attn(hidden_states=x, **kw)[0]),
                  ("gate_up", [gate, up], ln2, seen["mlp"], lambda x, kw: mlp(x)),
                  ("down", [down], up, seen["down"], lambda x, kw: down(x))]
        if v.out_features == o.in_features:  # the release skips v -> o under grouped-query attention
            groups.insert(1, ("o", [o], v, seen["o"], lambda x, kw: o(x)))
        out = {}
        for name, linears, producer, xs, fn in groups:
            ratio, s = self._search_scale(linears, xs, weights, fn, levels)
            _fold(producer, linears, s)
            out[f"{tag}.{name}"] = ratio
        if self.clip:
            seen = _run_block(block, inputs, {n: m for n, m in (("o", o), ("gate", gate), ("up", up), ("v", v),
                                                                  ("down", down))})
            for n, lin in (("v", v), ("o", o), ("gate", gate), ("up", up), ("down", down)):
                out[f"{tag}.{n}.clip"] = self._clip(lin, [x for x, _ in seen[n]], weights, levels)
        if log:
            log(f"[awq] block {tag}: ratios " + ", ".join(f"{k.split('.')[1]} {v:.2f}" for k, v in out.items()
                                                          if not k.endswith(".clip")))
        return out

    @torch.no_grad()
    def _search_scale(self, linears, xs, weights, fn: Callable, levels: int) -> tuple[float, torch.Tensor]:
        """The release's grid over ratios a = i/n_grid: the scale s with the least c-weighted output error."""
        total = sum(float(c.sum()) for c in weights)
        m = sum((x.abs().double() * c[..., None]).sum((0, 1)) for (x, _), c in zip(xs, weights)) / total
        ref = [fn(x, kw) for x, kw in xs]
        saved = [lin.weight.detach().clone() for lin in linears]
        best = (math.inf, 0.0, None)
        try:
            for i in range(self.n_grid):
                a = i / self.n_grid
                s = m.pow(a).clamp_min(1e-4)
                s = s / (s.max() * s.min()).sqrt()
                for lin, w in zip(linears, saved):
                    sw = s.to(w)
                    lin.weight.copy_(pseudo_quantize(w * sw, levels, self.group_size) / sw)
                err = sum(float((((fn(x, kw) - r).double() ** 2).mean(-1) * c).sum())
                          for (x, kw), r, c in zip(xs, ref, weights)) / total
                if err < best[0]:
                    best = (err, a, s)
        finally:
            for lin, w in zip(linears, saved):
                lin.weight.copy_(w)
        if best[2] is None:
            raise RuntimeError("awq: no finite output error on the calibration batches (NaN activations?)")
        return best[1], best[2]

    @torch.no_grad()
    def _clip(self, lin, xs, weights, levels: int) -> float:
        """Per row and group the clip that minimises Δ_g Σ_g Δ_gᵀ; W clamped in place; returns the mean shrink."""
        w = lin.weight.detach().double()
        x = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).double()
        c = torch.cat([c.reshape(-1) for c in weights]).to(x)
        if self.clip_tokens:  # the release's sample: every k-th token
            step = max(1, x.shape[0] // self.clip_tokens)
            x, c = x[::step], c[::step]
        maxq, best_max = levels - 1, []
        for i, j in group_bounds(w.shape[1], self.group_size):
            xg, wg = x[:, i:j], w[:, i:j]
            sig = (xg * c[:, None]).T @ xg / c.sum()
            org = wg.abs().amax(1, keepdim=True)
            best_err = torch.full_like(org, math.inf)
            best = org.clone()
            for k in range(max(1, int(self.max_shrink * self.n_grid))):
                mx = org * (1 - k / self.n_grid)
                cur = wg.clamp(-mx, mx)
                st, z = affine_params(cur, maxq, include_zero=False)
                d = affine_round(cur, st, z, maxq)[0] - wg
                err = ((d @ sig) * d).sum(1, keepdim=True)
                better = err < best_err
                best_err, best = torch.where(better, err, best_err), torch.where(better, mx, best)
            best_max.append(best.expand(-1, j - i))
        mx = torch.cat(best_max, 1)
        lin.weight.copy_(w.clamp(-mx, mx).to(lin.weight.dtype))
        return float(1 - (mx / w.abs().amax(1, keepdim=True).clamp_min(1e-12)).mean())


# --- the block walk ---------------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def _child(module, name: str):
    sub = getattr(module, name, None)
    if sub is None:
        raise ValueError(f"awq search=block needs LLaMA-style blocks: {type(module).__name__} has no {name} "
                         "(use model.quantizer.search=layer)")
    return sub


def _blocks(model) -> list[torch.nn.Module]:
    from lightning_modules.common.quantize.driver import blocks

    return blocks(model)


def _block_inputs(model, batches):
    """Yield (block, inputs) in order; inputs per batch: {"h": the block's input, "kw": its keyword arguments,
    "weight": c_j (B×S)}, the next block's computed by the full-precision block (scaling preserves it)."""
    from lightning_modules.common.quantize.calibration import run_batch

    layers = _blocks(model)
    inputs = []
    for b in batches:
        box = {}

        def grab(mod, args, kwargs):
            box["h"] = args[0] if args else kwargs["hidden_states"]
            box["kw"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            raise _Stop

        handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            run_batch(model, b)
        except _Stop:
            pass
        finally:
            handle.remove()
        h = box["h"]
        weight = b.get("token_weight")
        weight = torch.ones(h.shape[:2], dtype=torch.float64) if weight is None else weight.double()
        inputs.append({"h": h, "kw": box["kw"], "weight": weight.to(h.device)})
    for block in layers:
        nxt = []
        for inp in inputs:  # the full-precision block's outputs, before its weights are scaled and clipped
            out = block(inp["h"], **inp["kw"])
            nxt.append(out[0] if isinstance(out, (tuple, list)) else out)
        yield block, inputs
        for inp, h in zip(inputs, nxt):
            inp["h"] = h


def _run_block(block, inputs, watch: dict) -> dict[str, list]:
    """One pass of ``block`` over every batch, recording the input (and keyword arguments) of each watched module."""
    seen = {n: [] for n in watch}
    hooks = []
    for n, mod in watch.items():
        def hook(mod, args, kwargs, n=n):
            x = args[0] if args else kwargs["hidden_states"]
            seen[n].append((x.detach(), {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        hooks.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        for inp in inputs:
            block(inp["h"], **inp["kw"])
    finally:
        for h in hooks:
            h.remove()
    return seen


def _fold(producer, linears, s: torch.Tensor) -> None:
    """W ← W·diag s for the consumers, the producer's output channels ÷ s (a norm's weight, a linear's rows)."""
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight)[None])
    producer.weight.div_(s.to(producer.weight)[:, None] if producer.weight.dim() == 2 else s.to(producer.weight))
    if getattr(producer, "bias", None) is not None:
        producer.bias.div_(s.to(producer.bias))
