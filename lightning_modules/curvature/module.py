"""Representational curvature vs next-token entropy (King, Fedorenko, Hosseini; ICML 2026, arXiv 2604.23985).

``CurvatureLM`` is the LM base module plus

- the analysis, in every validation and test loop: per hidden-state index k = 0..L (0 = the embedding output,
  k = the residual stream after block k-1; ``include_embedding``; k = L per ``last_state``: ``post_norm``, the
  default, is the last block's output after the final norm, as transformers' ``output_hidden_states`` and so the
  precursor's ``compute_model_curvature`` read it; ``pre_norm`` (ours before issue 40) keeps k = L the same kind of
  vector as every other index, the residual stream), the contextual curvature
  κ_t^k(w) (``window``) and the next-token entropy H_t at the same t, in ``analysis_dtype`` (float32 or wider: bf16
  blurs small angles); logged ``<stage>/kappa/L<k>`` (mean κ), ``<stage>/r/L<k>`` (Pearson), ``<stage>/rho/L<k>``
  (Spearman), ``<stage>/partial_r/L<k>`` (partial Pearson controlling ``controls``: ``position``, ``log_frequency``
  of the current token (unigram counts of the evaluated split, add-one) and its ``surprisal`` -log p(x_t|x<t)), and
  ``<stage>/r_peak`` / ``r_peak_layer`` / ``kappa_min_layer`` / ``mean_entropy`` / ``kappa_reg`` (mean κ over
  ``reg.layers``). A fit logs the same analysis at step 0, before the first update (``results["emergence"]``).
- the perturbation (test loop, ``perturb.n_positions`` > 0): at hidden-state index ``perturb.layer`` (null = L//2)
  and random tokens t, h_t += δ with ‖δ‖ = s·‖h_t - h_{t-1}‖ through ``activations.intervene``, δ of
  ``perturb.kind`` (perturb.py; a list measures several kinds on the same tokens; default pca_sampled,
  extrapolation and the equal-norm ``orthogonal`` control), for every s of ``perturb.scale`` (default 0.02, 0.05,
  0.1, 0.5) with the same random draws, so each s scales the same candidate directions. Why a sweep (issue 40): at
  s = 0.5 a middle layer's angle is near that of unrelated points and every direction raises H through a
  second-order term (ΔH ∝ s² for the orthogonal control), so ΔH at one large s cannot separate aligned from
  misaligned; the first-order effect is the slope ΔH/s at small s. Logged per s
  ``test/perturb/s<s>/<condition>/{dH, dH_lo, dH_hi, dNLL, dtheta}`` and the paired differences aligned -
  misaligned on the same tokens (``test/perturb/s<s>/<straight|extrapolation>_minus_<curvy|orthogonal|random>/dH``,
  with 95% intervals), and per condition the slope at the smallest s (``test/perturb/<condition>/slope``,
  ``slope_lo``, ``slope_hi``: the mean of ΔH/s over tokens). Positions are drawn from their own seeded stream, so
  runs of different kinds perturb the same tokens.
- the straightening regulariser in ``compute_loss``: CE + λ·mean_t,k κ_t^k over ``reg.layers`` (null = the middle
  half of the blocks' outputs); ``reg.form`` angle (default, ours: eps in the norms, cosine within ±(1-1e-6)) |
  one_minus_cos (1 - cos of successive steps: the precursor trainer's penalty) | second_diff
  (‖h_{t+1} - 2h_t + h_{t-1}‖, the precursor's alternative, not scale-invariant). The angle stays the default: it
  is the quantity the analysis measures and the paper names (their gradients agree to cosine 0.9986, issue 40),
  and 1 - cos flattens near straight trajectories, where d(1 - cos θ)/dθ = sin θ vanishes. ``reg.match_order``
  rescales the penalty to CE's order of magnitude (10^(floor log10 CE - floor log10 penalty), detached, as the
  precursor's trainer); ``reg.delay_steps`` starts it later.

[INF] The sources give no window, controls, perturbation construction, regulariser form, λ, layers or run sizes:
every default here (window 3, the three controls, s ∈ {0.02, 0.05, 0.1, 0.5} with 64 candidates in 10 PCs, angle
form, λ = 0.1, the middle half, no delay) is inferred; ``last_state: post_norm`` is the precursor code's.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import torch

from lightning_modules.common.activations import capture
from lightning_modules.common.backbone import build_config, check_revision
from lightning_modules.common.lm import CausalLMModule
from lightning_modules.curvature.analysis import (contextual_curvature, paired_ci, partial_corr, pearson, second_diff,
                                                  soft_angles, spearman, step_cosines, token_entropy, window_mean)
from lightning_modules.curvature.perturb import KINDS, perturbation_effects, top_pcs

CONTROLS = ("position", "log_frequency", "surprisal")
PERTURB = dict(layer=None, scale=(0.02, 0.05, 0.1, 0.5), kind=("pca_sampled", "extrapolation", "orthogonal"),
               n_candidates=64, pcs=10, n_positions=512, positions_per_sequence=8, seed=0)
ALIGNED_CONDITIONS, MISALIGNED_CONDITIONS = ("straight", "extrapolation"), ("curvy", "orthogonal", "random")
REG = dict(layers=None, form="angle", match_order=True, delay_steps=0, eps=1e-8)
REG_FORMS = ("angle", "one_minus_cos", "second_diff")
LAST_STATES = ("post_norm", "pre_norm")


class CurvatureLM(CausalLMModule):
    """Next-token LM with the curvature analysis in its evaluation loops and an optional straightening regulariser.

    Args:
        backbone, optimizer, scheduler, weight_decay: as ``CausalLMModule``.
        window: points in the contextual-curvature window (>= 3; 3 = the single angle at t).
        include_embedding: analyse hidden-state index 0 (the embedding output) too.
        last_state: hidden-state index L after the final norm (post_norm: transformers' and the precursor's) or
            before it (pre_norm: the residual stream, as every other index).
        analysis_dtype: dtype of the angles and entropies (float32 | float64).
        controls: the partial correlation's controls, a subset of position / log_frequency / surprisal.
        perturb: layer (hidden-state index 1..L, null = L//2), scale (one s or a list), kind (pca_sampled |
            extrapolation | orthogonal | random, or a list), n_candidates, pcs, n_positions (0 = off),
            positions_per_sequence, seed.
        reg: lambda (0 = plain LM), layers (hidden-state indices, null = the middle half), form (angle |
            one_minus_cos | second_diff), match_order, delay_steps, eps.
    """

    def __init__(self, backbone: Mapping[str, Any], optimizer: Callable | None = None, scheduler: Callable | None = None,
                 weight_decay: float = 0.0, window: int = 3, include_embedding: bool = True,
                 analysis_dtype: str = "float32", controls: Sequence[str] = CONTROLS,
                 perturb: Mapping[str, Any] | None = None, reg: Mapping[str, Any] | None = None,
                 last_state: str = "post_norm"):
        super().__init__(backbone=backbone, optimizer=optimizer, scheduler=scheduler, weight_decay=weight_decay)
        check_revision(self.backbone_spec)
        if window < 3:
            raise ValueError(f"model.window={window}: contextual curvature needs at least 3 points (window >= 3)")
        if analysis_dtype not in ("float32", "float64"):
            raise ValueError(f"model.analysis_dtype={analysis_dtype!r}: use float32 or float64 (bf16 blurs small angles)")
        bad = [c for c in controls if c not in CONTROLS]
        if bad:
            raise ValueError(f"model.controls {bad} unknown: choose from {', '.join(CONTROLS)}")
        if last_state not in LAST_STATES:
            raise ValueError(f"model.last_state={last_state!r}: choose post_norm or pre_norm")
        self.last_state = last_state
        cfg = build_config(self.backbone_spec)
        self.depth = L = int(cfg.num_hidden_layers)
        self.window, self.include_embedding, self.controls = int(window), bool(include_embedding), list(controls)
        self.analysis_dtype = getattr(torch, analysis_dtype)
        self.perturb = {**PERTURB, **(perturb or {})}
        if self.perturb["layer"] is None:
            self.perturb["layer"] = max(1, L // 2)
        if not 1 <= int(self.perturb["layer"]) <= L:
            raise ValueError(f"model.perturb.layer={self.perturb['layer']} is beyond the model's depth: hidden-state "
                             f"indices 1..{L} (k = the output of block k-1)")
        kinds = [self.perturb["kind"]] if isinstance(self.perturb["kind"], str) else list(self.perturb["kind"])
        if not kinds or any(k not in KINDS for k in kinds):
            raise ValueError(f"model.perturb.kind={self.perturb['kind']!r}: choose one of {', '.join(KINDS)} "
                             "(or a list of them, measured on the same tokens)")
        self.perturb["kind"] = kinds
        scales = self.perturb["scale"]
        scales = [scales] if isinstance(scales, (int, float)) else list(scales)
        if not scales or any(not float(x) > 0 for x in scales):
            raise ValueError(f"model.perturb.scale={self.perturb['scale']!r}: one s > 0 or a list of them")
        self.perturb["scale"] = sorted(float(x) for x in scales)
        if int(self.perturb["layer"]) == L and last_state == "post_norm" and int(self.perturb["n_positions"]) > 0:
            raise ValueError(f"model.perturb.layer={L} with model.last_state=post_norm: the perturbation edits a "
                             "block's output before the final norm; pick a layer < L or model.last_state=pre_norm")
        reg = dict(reg or {})
        self.reg_lambda = float(reg.pop("lambda", 0.0))
        self.reg = {**REG, **reg}
        if self.reg["layers"] is None:  # the middle half of the blocks' outputs
            self.reg["layers"] = [k + 1 for k in range(L // 4, L // 4 + max(1, L // 2))]
        self.reg["layers"] = [int(k) for k in self.reg["layers"]]
        beyond = [k for k in self.reg["layers"] if not 0 <= k <= L]
        if beyond:
            raise ValueError(f"model.reg.layers {beyond} beyond the model's depth: hidden-state indices 0..{L}")
        if self.reg_lambda > 0 and not self.reg["layers"]:
            raise ValueError("model.reg.lambda > 0 with empty model.reg.layers: name the layers to straighten "
                             "(null = the middle half)")
        if self.reg["form"] not in REG_FORMS:
            raise ValueError(f"model.reg.form={self.reg['form']!r}: choose one of {', '.join(REG_FORMS)}")
        self.layers = list(range(0 if self.include_embedding else 1, L + 1))
        self.results: dict[str, Any] = {"emergence": []}
        self._records = None

    # --- hidden states ---------------------------------------------------------------------------------------
    def _states(self, acts, hidden_states=None) -> dict[int, torch.Tensor]:
        """Hidden-state index k -> (B, T, D): 0 the embedding output, k the output of block k-1; L from
        transformers' ``hidden_states`` (after the final norm) when ``last_state`` is post_norm."""
        out = {k + 1: h for k, h in acts.get("block_out", {}).items()}
        if "embed" in acts and acts["embed"]:
            out[0] = acts["embed"][0]
        if hidden_states is not None:
            out[self.depth] = hidden_states[-1]
        return out

    def _post_norm(self, layers) -> bool:
        """Whether a forward must also return transformers' hidden states (index L after the final norm)."""
        return self.last_state == "post_norm" and self.depth in layers

    # --- regulariser -----------------------------------------------------------------------------------------
    def reg_penalty(self, states: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """Mean over ``reg.layers`` and tokens of the differentiable κ_t (angle form) or second difference."""
        per = []
        for k in self.reg["layers"]:
            h = states[k].float()
            form = self.reg["form"]
            if form == "angle":
                vals = soft_angles(h, eps=self.reg["eps"])
            elif form == "one_minus_cos":
                vals = 1 - step_cosines(h, eps=self.reg["eps"])
            else:
                vals = second_diff(h)
            kappa = window_mean(vals, self.window)
            per.append(kappa[..., self.window - 1:].mean())
        return torch.stack(per).mean()

    def compute_loss(self, batch) -> torch.Tensor:
        if self.reg_lambda <= 0 or self.global_step < self.reg["delay_steps"]:
            return super().compute_loss(batch)
        blocks = [k - 1 for k in self.reg["layers"] if k > 0]
        sites = ("embed", "block_out") if 0 in self.reg["layers"] else ("block_out",)
        post = self._post_norm(self.reg["layers"])
        with capture(self.model, sites, layers=blocks, detach=False) as acts:
            out = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                             labels=batch["labels"], use_cache=False, output_hidden_states=post)
        penalty = self.reg_penalty(self._states(acts, out.hidden_states if post else None))
        scale = 1.0
        if self.reg["match_order"]:
            ce, pen = out.loss.detach().abs().clamp_min(1e-12), penalty.detach().abs().clamp_min(1e-12)
            scale = 10.0 ** (math.floor(math.log10(ce.item())) - math.floor(math.log10(pen.item())))
        if self._trainer is not None:
            bs = batch["input_ids"].shape[0]
            self.log("train/ce", out.loss, on_step=True, on_epoch=False, batch_size=bs)
            self.log("train/curvature_penalty", penalty, on_step=True, on_epoch=False, batch_size=bs)
        return out.loss + self.reg_lambda * scale * penalty

    # --- analysis --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def analyse_batch(self, input_ids: torch.Tensor):
        """Per-token records of one batch (rows with a full window) and what the perturbation needs."""
        blocks = list(range(self.depth))
        sites = ("embed", "block_out") if self.include_embedding else ("block_out",)
        post = self._post_norm(self.layers)
        with capture(self.model, sites, layers=blocks) as acts:
            out = self.model(input_ids=input_ids, use_cache=False, output_hidden_states=post)
        logits = out.logits
        states = self._states(acts, out.hidden_states if post else None)
        dt = self.analysis_dtype
        kappa = torch.stack([contextual_curvature(states[k].to(dt), self.window) for k in self.layers], -1)  # B,T,K
        logp = torch.log_softmax(logits.to(dt), -1)
        entropy = -(logp.exp() * logp).sum(-1)       # token_entropy, sharing logp with the surprisal
        B, T = input_ids.shape
        surprisal = torch.full((B, T), math.nan, dtype=dt, device=logits.device)
        surprisal[:, 1:] = -logp[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
        pos = torch.arange(T, device=input_ids.device).expand(B, T)
        keep = pos >= max(self.window - 1, 1)
        nll_sum = -logp[:, :-1].gather(-1, input_ids[:, 1:, None]).sum()
        rec = {"kappa": kappa[keep].cpu(), "entropy": entropy[keep].cpu(), "position": pos[keep].cpu().to(dt),
               "token": input_ids[keep].cpu(), "surprisal": surprisal[keep].cpu()}
        return rec, logits, states, (nll_sum, B * (T - 1))

    def _start(self):
        self._records = {"rows": [], "perturb": {}, "n_perturbed": 0, "nll": 0.0, "count": 0}

    def _add(self, input_ids, perturb: bool = False, batch_idx: int = 0):
        rec, logits, states, (nll, n) = self.analyse_batch(input_ids)
        r = self._records
        r["rows"].append(rec)
        r["nll"] += float(nll)
        r["count"] += n
        if perturb and r["n_perturbed"] < int(self.perturb["n_positions"]):
            self._perturb(input_ids, logits, states, batch_idx)

    def _perturb(self, input_ids, logits, states, batch_idx):
        p, r = self.perturb, self._records
        k = int(p["layer"])
        h = states[k].to(self.analysis_dtype)
        B, T = input_ids.shape
        if T < 5:
            return
        # positions from their own stream, so runs of different kinds perturb the same tokens
        where = torch.Generator().manual_seed(int(p["seed"]) * 100003 + batch_idx)
        gen = torch.Generator().manual_seed(int(p["seed"]) * 100003 + batch_idx + 7919)
        pcs = top_pcs(h, int(p["pcs"])) if "pca_sampled" in p["kind"] else None
        for _ in range(int(p["positions_per_sequence"])):
            left = int(p["n_positions"]) - r["n_perturbed"]
            if left <= 0:
                break
            rows = min(B, left)
            ts = torch.randint(max(2, self.window - 1), T - 1, (rows,), generator=where).to(input_ids.device)
            draws = gen.get_state()
            for s in p["scale"]:  # the same random draws at every s: each s scales the same directions
                gen.set_state(draws)
                eff = perturbation_effects(self.model, input_ids[:rows], logits[:rows], h[:rows], k, ts, p["kind"],
                                           s, pcs=pcs, n_candidates=int(p["n_candidates"]), generator=gen)
                for cond, vals in eff.items():
                    slot = r["perturb"].setdefault((s, cond), {m: [] for m in vals})
                    for m, v in vals.items():
                        slot[m].append(v.cpu())
            r["n_perturbed"] += rows

    def _gathered(self):
        r = self._records
        if self._trainer is not None and self._trainer.world_size > 1:  # every rank's tokens, on every rank
            parts = [None] * self._trainer.world_size
            torch.distributed.all_gather_object(parts, r)
            r = {"rows": [x for p in parts for x in p["rows"]], "nll": sum(p["nll"] for p in parts),
                 "count": sum(p["count"] for p in parts),
                 "perturb": {c: {m: [x for p in parts for x in p["perturb"][c][m]] for m in r["perturb"][c]}
                             for c in r["perturb"]}}
        return r

    def summarize(self, stage: str) -> dict[str, float]:
        """The per-layer statistics and summaries of the records of this loop, as ``<stage>/...`` metrics."""
        r = self._gathered()
        cat = {key: torch.cat([row[key] for row in r["rows"]]) for key in r["rows"][0]}
        H, kappa = cat["entropy"].double(), cat["kappa"].double()
        counts = torch.bincount(cat["token"], minlength=int(cat["token"].max()) + 1).double() + 1
        controls = {"position": cat["position"].double(), "surprisal": cat["surprisal"].double(),
                    "log_frequency": torch.log(counts[cat["token"]] / counts.sum())}
        C = torch.stack([controls[c] for c in self.controls], 1) if self.controls else torch.empty(len(H), 0)
        out, rows = {}, []
        for j, k in enumerate(self.layers):
            x = kappa[:, j]
            ok = torch.isfinite(x) & torch.isfinite(H) & torch.isfinite(C).all(1)
            row = {"layer": k, "kappa": float(x[ok].mean()), "r": pearson(x[ok], H[ok]),
                   "rho": spearman(x[ok], H[ok]), "partial_r": partial_corr(x[ok], H[ok], C[ok])}
            rows.append(row)
            for key in ("kappa", "r", "rho", "partial_r"):
                out[f"{stage}/{key}/L{k}"] = row[key]
        peak = max(rows, key=lambda row: row["r"] if math.isfinite(row["r"]) else -math.inf)
        flat = min(rows, key=lambda row: row["kappa"])
        out.update({f"{stage}/r_peak": peak["r"], f"{stage}/r_peak_layer": peak["layer"],
                    f"{stage}/kappa_min_layer": flat["layer"], f"{stage}/mean_entropy": float(H.mean()),
                    f"{stage}/kappa_reg": sum(row["kappa"] for row in rows if row["layer"] in self.reg["layers"])
                    / max(1, sum(row["layer"] in self.reg["layers"] for row in rows)),
                    f"{stage}/loss": r["nll"] / max(1, r["count"])})
        out[f"{stage}/ppl"] = math.exp(out[f"{stage}/loss"])
        self.results[f"{stage}_layers"] = rows
        out.update(self.perturb_summary(r["perturb"], stage))
        return out

    @staticmethod
    def perturb_summary(perturb: Mapping[tuple[float, str], Mapping[str, list]], stage: str) -> dict[str, float]:
        """Per s: ΔH (95% paired interval), ΔNLL and Δθ of each condition and the paired differences aligned -
        misaligned on the same tokens; per condition the slope ΔH/s at the smallest s."""
        out = {}
        dH = {key: torch.cat(vals["dH"]) for key, vals in perturb.items()}
        for (s, cond), vals in perturb.items():
            pre = f"{stage}/perturb/s{s:g}/{cond}"
            m, lo, hi = paired_ci(dH[s, cond])
            out.update({f"{pre}/dH": m, f"{pre}/dH_lo": lo, f"{pre}/dH_hi": hi,
                        f"{pre}/dNLL": float(torch.cat(vals["dNLL"]).mean()),
                        f"{pre}/dtheta": float(torch.cat(vals["dtheta"]).mean()),
                        f"{stage}/perturb/n": len(dH[s, cond])})
        scales = sorted({s for s, _ in perturb})
        for s in scales:
            for a in ALIGNED_CONDITIONS:  # paired on the same tokens: aligned minus each misaligned condition
                for b in MISALIGNED_CONDITIONS:
                    if (s, a) in dH and (s, b) in dH:
                        m, lo, hi = paired_ci(dH[s, a] - dH[s, b])
                        pre = f"{stage}/perturb/s{s:g}/{a}_minus_{b}"
                        out.update({f"{pre}/dH": m, f"{pre}/dH_lo": lo, f"{pre}/dH_hi": hi})
        if scales:
            s0 = scales[0]
            for (s, cond), d in dH.items():
                if s == s0:
                    m, lo, hi = paired_ci(d / s0)
                    out.update({f"{stage}/perturb/{cond}/slope": m, f"{stage}/perturb/{cond}/slope_lo": lo,
                                f"{stage}/perturb/{cond}/slope_hi": hi})
        return out

    def _log_summary(self, stage: str, step: int | None = None):
        metrics = self.summarize(stage)
        if stage == "val":
            self.results["emergence"].append({"step": self.global_step if step is None else step,
                                              **{k: metrics[f"val/r/L{k}"] for k in self.layers}})
        if step is None:
            for key, v in metrics.items():
                self.log(key, float(v), sync_dist=False)
        else:  # outside a loop (step 0 of a fit): straight to the loggers
            for lg in self.loggers:
                lg.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)
        from lightning_modules.common.dashboard import log_table

        log_table(f"{stage}/layers", self.results[f"{stage}_layers"], self.loggers, step=self.global_step)

    # --- loops -----------------------------------------------------------------------------------------------
    def on_train_start(self):
        """Step 0 of the emergence curve: the validation analysis before any update."""
        loader = self.trainer.datamodule.val_dataloader() if self.trainer.datamodule is not None else None
        if loader is None or self.global_step > 0:  # a resumed fit has its step 0 already
            return
        was = self.model.training
        self.model.eval()
        self._start()
        for i, batch in enumerate(loader):
            if isinstance(self.trainer.limit_val_batches, int) and i >= self.trainer.limit_val_batches:
                break
            self._add(batch["input_ids"].to(self.device))
        self._log_summary("val", step=0)
        self.model.train(was)

    def on_fit_end(self):
        """The emergence curve on the dashboards: val r(κ, H) by step and layer."""
        from lightning_modules.common.dashboard import heatmap

        em = self.results["emergence"]
        if len(em) > 1:
            heatmap("val/r_by_step", [[e[k] for k in self.layers] for e in em], self.loggers,
                    xlabel="hidden-state index (0 = embeddings)", ylabel="step", xticks=self.layers,
                    yticks=[e["step"] for e in em])

    def on_validation_epoch_start(self):
        self._start()

    def validation_step(self, batch, batch_idx):
        self._add(batch["input_ids"])

    def on_validation_epoch_end(self):
        if self._records["rows"]:
            self._log_summary("val")

    def on_test_epoch_start(self):
        self._start()

    def test_step(self, batch, batch_idx):
        self._add(batch["input_ids"], perturb=int(self.perturb["n_positions"]) > 0, batch_idx=batch_idx)

    def on_test_epoch_end(self):
        if self._records["rows"]:
            self._log_summary("test")
