"""SubspacePath Pruner (Gong et al., ICML 2026; release GongZhiren/SubspacePathPruner): domain probes, axis-aligned
head importance and per-scenario head pruning of a frozen LM. No training: the procedure is the test loop.

Offline (first test step, base frozen; ``fit_offline``):
- domain basis ``basis``: ``onehot`` (the release: the data's domains as given) | ``quasi_orthogonal`` (the paper's
  unreleased DBS: ``n_domains`` of the data's candidate domains whose embedding centroids, ``common.embedding``
  mean-pooled last hidden states of the same model, have the smallest largest |cos|, chosen greedily);
- probes: per layer ℓ and domain k a one-vs-rest logistic on the mean-pooled post-attention residual
  (``probe.site: post_attn``, the spec's, kept as default: the release's hook means to read it but gets the
  attention output alone, ``attn_out``, available as the switch), BCE, ``probe.epochs`` (20), Adam lr 1e-3, batch
  32, raw features (``probe.features``), as released, on cached activations;
  ``calib.enabled``: per-regime (single / ood / cross) per-layer temperatures fitted on val pools, the scenario's
  split choosing the regime ([INF]: the release's "4-probe system" is not described further);
- importance I_{ℓ,h,k} = E_{x∈P_k}[(u_kᵀw̃)² / (‖w̃‖² + ε)], w̃ = head h's write (site ``head_write``), u_k the unit
  probe-k weight at ℓ ([INF]); ``importance.pool``: ``mean_write`` (w̃ mean-pooled over tokens) | ``per_token`` (the
  ratio per token, then the mean); ``importance.mode``: ``single`` (base probes) | ``multi`` (the cross-regime probes,
  trained on pairs of passages from two domains with both labels, as the release's multi mode uses the cross set);
- whitelist: high mean / low across-domain variance of I (quantiles 0.8 / 0.2) confirmed by one-way ANOVA p > 0.05
  (``whitelist.test: anova | none``; the release names no test).

Online, per scenario (``test_step``): the first turn's prompt (never its answer), stop-words removed, through one
forward → sigmoid probe outputs
p (L, K) → ``method.compile_mask`` with eta = ``pruning_strength``, or with ``budget.target_prune`` (the paper-scale
runs: 0.3, the paper's operating point) one eta bisected before the first scenario so that the run's mean pruned
fraction is the target (``target_scope: run``; ``scenario``: each scenario bisected to it, a matched comparison) → one mask for every scored turn, run by ``execution``: ``mask`` (``attention.head_mask``) |
``slice`` (``attention.prune_heads``; GQA masks widened to whole KV groups first). Per scored turn: the answer's NLL
given the conversation so far and the turn's prompt (dense and pruned), and keyword Recall of a greedy continuation.
Scored turns (``scored_turns``): a multi-turn scenario's later turns (its first turn, prompt and answer, compiled the
mask); a single-turn scenario (the CommonsenseQA / NQ / ARC splits) its one turn, its mask compiled from the prompt
alone (the spec's "first turn's prompt"), so the scored answer never reaches the mask.

Logged per split s ∈ selected / out_of_domain / cross_domain: ``test/<s>/ppl_dense``, ``ppl_pruned``, ``ppl_ratio``,
``recall_dense``, ``recall_pruned``, ``pruned_fraction``, ``kv_saved_fraction`` (the KV cache a mask frees: only
KV groups whose every head is pruned; ``kv_group_mask`` keeps a group while any of its heads is kept, so heads
pruned across groups save compute but no cache); overall ``test/ppl_ratio`` (pruned / dense over all scored turns),
``test/pruned_fraction``, ``test/kv_saved_fraction``, ``test/compile_ms``, ``test/tokens_per_s_dense`` / ``_pruned``,
``test/probe_acc/L<ℓ>`` (val pools, argmax over domains). ``results`` holds per-scenario rows, I, the whitelist.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any, Mapping

import torch

from lightning_modules.common.activations import capture
from lightning_modules.common.attention import attention_modules, head_mask, kv_group_mask, prune_heads
from lightning_modules.common.lm import CausalLMModule
from lightning_modules.subspace_path.method import (BUDGET_MODES, Probes, bisect_eta, compile_mask, fit_temperatures,
                                                    importance_terms, kv_saved_fraction, quasi_orthogonal, recall,
                                                    strip_stop_words, train_probes, whitelist)

BASES = ("onehot", "quasi_orthogonal")
EXECUTIONS = ("mask", "slice")
PROBE = dict(epochs=20, lr=1e-3, batch_size=32, max_tokens=256, features="raw", site="post_attn")
PROBE_SITES = ("post_attn", "attn_out")
CALIB = dict(enabled=False)
IMPORTANCE = dict(mode="single", pool="mean_write", eps=1e-6)
WHITELIST = dict(mean_quantile=0.8, var_quantile=0.2, test="anova", alpha=0.05)
BUDGET = dict(mode="release_union", rho_min=0.1, floor_layer=0.1, floor_global=0.05, sim_min=0.1, sharpen=1.5,
              fallback_s=0.3, target_prune=None, target_scope="run")
TARGET_SCOPES = ("run", "scenario")
EVAL = dict(max_new_tokens=16, max_context_tokens=512)
REGIMES = {"selected": "single", "out_of_domain": "ood", "cross_domain": "cross"}


def scored_turns(scenario: Mapping) -> range:
    """The turns a scenario is scored on: all but the first (which compiled the mask), or a single turn itself."""
    n = len(scenario["turns"])
    return range(1, n) if n > 1 else range(n)


def _merge(defaults: dict, given: Mapping | None, what: str) -> dict:
    given = dict(given or {})
    bad = [k for k in given if k not in defaults]
    if bad:
        raise ValueError(f"model.{what} has unknown key(s) {bad}: choose from {', '.join(defaults)}")
    return {**defaults, **given}


class SubspacePathModule(CausalLMModule):
    """A frozen backbone pruned per scenario by the SubspacePath procedure (see the module docstring).

    Args:
        backbone: backbone spec.
        basis: onehot | quasi_orthogonal; n_domains: K for quasi_orthogonal (null = all the data's domains).
        probe: epochs, lr, batch_size (the release's 20, 1e-3, 32), max_tokens (each text cut to this many tokens),
            features (raw, the release's | standardised, ours).
        calib: enabled (per-regime per-layer temperatures).
        importance: mode (single | multi), pool (mean_write | per_token), eps.
        whitelist: mean_quantile, var_quantile, test (anova | none), alpha.
        budget: mode (release_union | paper_sum), rho_min, floor_layer, floor_global, sim_min, sharpen, fallback_s,
            target_prune (null, or a pruned fraction in [0, 1)), target_scope (run: one eta for the run's mean |
            scenario: eta bisected per scenario).
        pruning_strength: eta (>= 0); the release's keep ratio grows with it.
        execution: mask | slice.
        eval: max_new_tokens (greedy continuation per scored turn), max_context_tokens.
    """

    def __init__(self, backbone: Mapping[str, Any], basis: str = "onehot", n_domains: int | None = None,
                 probe: Mapping | None = None, calib: Mapping | None = None, importance: Mapping | None = None,
                 whitelist: Mapping | None = None, budget: Mapping | None = None, pruning_strength: float = 0.5,
                 execution: str = "mask", eval: Mapping | None = None):
        super().__init__(backbone=backbone)
        if basis not in BASES:
            raise ValueError(f"model.basis={basis!r}: choose one of {', '.join(BASES)}")
        if execution not in EXECUTIONS:
            raise ValueError(f"model.execution={execution!r}: choose one of {', '.join(EXECUTIONS)}")
        if pruning_strength < 0:
            raise ValueError(f"model.pruning_strength={pruning_strength}: use eta >= 0")
        if n_domains is not None and n_domains < 2:
            raise ValueError(f"model.n_domains={n_domains}: the basis needs K >= 2 domains")
        self.basis, self.n_domains, self.eta, self.execution = basis, n_domains, float(pruning_strength), execution
        self.probe_cfg = _merge(PROBE, probe, "probe")
        self.calib_cfg = _merge(CALIB, calib, "calib")
        self.imp_cfg = _merge(IMPORTANCE, importance, "importance")
        self.white_cfg = _merge(WHITELIST, whitelist, "whitelist")
        self.budget = _merge(BUDGET, budget, "budget")
        self.eval_cfg = _merge(EVAL, eval, "eval")
        if self.budget["mode"] not in BUDGET_MODES:
            raise ValueError(f"model.budget.mode={self.budget['mode']!r}: choose one of {', '.join(BUDGET_MODES)}")
        for key in ("floor_layer", "floor_global", "rho_min", "sim_min"):
            if not 0 <= float(self.budget[key]) <= 1:
                raise ValueError(f"model.budget.{key}={self.budget[key]}: use a fraction in [0, 1]")
        if self.budget["target_scope"] not in TARGET_SCOPES:
            raise ValueError(f"model.budget.target_scope={self.budget['target_scope']!r}: choose one of "
                             f"{', '.join(TARGET_SCOPES)}")
        tp = self.budget["target_prune"]
        if tp is not None and not 0 <= float(tp) < 1:
            raise ValueError(f"model.budget.target_prune={tp}: use a pruned fraction in [0, 1) or null")
        if self.probe_cfg["site"] not in PROBE_SITES:
            raise ValueError(f"model.probe.site={self.probe_cfg['site']!r}: choose one of {', '.join(PROBE_SITES)}")
        if self.imp_cfg["mode"] not in ("single", "multi"):
            raise ValueError(f"model.importance.mode={self.imp_cfg['mode']!r}: choose single or multi")
        if self.imp_cfg["pool"] not in ("mean_write", "per_token"):
            raise ValueError(f"model.importance.pool={self.imp_cfg['pool']!r}: choose mean_write or per_token")
        if self.white_cfg["test"] not in ("anova", "none"):
            raise ValueError(f"model.whitelist.test={self.white_cfg['test']!r}: choose anova or none")
        self.state: dict | None = None
        self.rows: list[dict] = []
        self.results: dict = {}

    # --- activations -----------------------------------------------------------------------------
    def _ids(self, tok, text: str, max_tokens: int | None = None, left: bool = False) -> torch.Tensor:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        n = max_tokens or self.probe_cfg["max_tokens"]
        ids = ids[-n:] if left else ids[:n]
        return torch.tensor([ids or [tok.eos_token_id]], device=self.device)

    @torch.no_grad()
    def pooled(self, tok, text: str, writes_axes: torch.Tensor | None = None):
        """Mean-pooled probe features (L, d) at ``probe.site``: ``post_attn`` (the spec's and ours: the residual
        stream after the attention sub-block, h + attn(h)) | ``attn_out`` (what the release's probes read: its
        pre-hook receives no keyword arguments, so it silently takes the attention output alone); with
        ``writes_axes`` (L, K, d) also the per-head importance terms (L, H, K) of this text (``importance.pool``)."""
        ids = self._ids(tok, text)
        site = self.probe_cfg["site"]
        sites = (site, "head_write") if writes_axes is not None else (site,)
        with capture(self.model, sites) as acts:
            self.model(input_ids=ids, use_cache=False)
        L = len(acts[site])
        feats = torch.stack([acts[site][l][0].double().mean(0) for l in range(L)]).cpu()
        if writes_axes is None:
            return feats
        terms = []
        for l in range(L):   # on the model's device: a 13B layer's writes are (T, 40, 5120)
            w = acts["head_write"][l][0]                                        # (T, H, d)
            u = writes_axes[l].to(w.device)
            if self.imp_cfg["pool"] == "mean_write":
                t = importance_terms(w.double().mean(0), u, self.imp_cfg["eps"])
            else:
                t = importance_terms(w, u, self.imp_cfg["eps"]).mean(0)
            terms.append(t.cpu())
        return feats, torch.stack(terms)                                       # (L, H, K)

    def _features(self, tok, pools: Mapping[str, list[str]], domains: list[str]):
        x, y = [], []
        for k, d in enumerate(domains):
            for t in pools.get(d, []):
                x.append(self.pooled(tok, t))
                y.append(torch.nn.functional.one_hot(torch.tensor(k), len(domains)).double())
        return torch.stack(x), torch.stack(y)

    def _pairs(self, tok, pools: Mapping[str, list[str]], domains: list[str], seed: int):
        """Two-domain texts (a passage of each) with both labels: the cross regime."""
        g = torch.Generator().manual_seed(seed)
        x, y = [], []
        n = max(len(v) for v in pools.values())
        for i in range(n):
            a, b = torch.randperm(len(domains), generator=g)[:2].tolist()
            pa, pb = pools[domains[a]], pools[domains[b]]
            x.append(self.pooled(tok, pa[i % len(pa)] + " " + pb[i % len(pb)]))
            lab = torch.zeros(len(domains), dtype=torch.float64)
            lab[[a, b]] = 1
            y.append(lab)
        return torch.stack(x), torch.stack(y)

    # --- offline ---------------------------------------------------------------------------------
    @torch.no_grad()
    def fit_offline(self, dm, tok) -> dict:
        """Basis, probes (+ calibration), importance and whitelist from the datamodule's pools."""
        self.model.eval()
        candidates = list(dm.domains)
        if self.basis == "onehot":
            if self.n_domains not in (None, len(candidates)):
                raise ValueError(f"model.n_domains={self.n_domains} with basis=onehot: the basis is the data's "
                                 f"{len(candidates)} domains; use basis=quasi_orthogonal to choose among them")
            selected = candidates
        else:
            from lightning_modules.common.embedding import Encoder, centroids

            k = self.n_domains or len(candidates)
            if k > len(candidates):
                raise ValueError(f"model.n_domains={k} > the {len(candidates)} candidate domains in data.domains")
            enc = Encoder(self.model, tok, pooling="mean", max_length=self.probe_cfg["max_tokens"])
            selected = [candidates[i] for i in quasi_orthogonal(centroids(enc, dm.pools("train", candidates)), k)]
        dm.selected = selected
        train, val = dm.pools("train", selected), dm.pools("val", selected)
        pc = self.probe_cfg
        fit = lambda x, y: train_probes(x, y, pc["epochs"], pc["lr"], pc["batch_size"],  # noqa: E731
                                        features=pc["features"])
        x, y = self._features(tok, train, selected)
        probes = {"single": fit(x, y)}
        xv, yv = self._features(tok, val, selected)
        acc = (probes["single"].logits(xv).argmax(-1) == yv.argmax(-1)[:, None]).double().mean(0)   # (L,)
        if self.imp_cfg["mode"] == "multi" or self.calib_cfg["enabled"]:
            xc, yc = self._pairs(tok, train, selected, seed=0)
            probes["cross"] = fit(torch.cat([x, xc]), torch.cat([y, yc]))
        if self.calib_cfg["enabled"]:
            xcv, ycv = self._pairs(tok, val, selected, seed=1)
            ood = [d for d in dm.ood_domains if dm.passages.get(d, {}).get("val")]
            xo = self._features(tok, dm.pools("val", ood), ood)[0] if ood else xv
            yo = torch.zeros(len(xo), len(selected), dtype=torch.float64) if ood else yv
            base = probes["single"]
            for regime, (px, py) in {"single": (xv, yv), "ood": (xo, yo), "cross": (xcv, ycv)}.items():
                src = probes["cross"] if regime == "cross" else base
                probes[regime] = Probes(src.weight, src.bias, fit_temperatures(src, px, py))
        axes = (probes["cross"] if self.imp_cfg["mode"] == "multi" else probes["single"]).axes()   # (L, K, d)
        samples = []
        for k, d in enumerate(selected):
            samples.append(torch.stack([self.pooled(tok, t, axes)[1][..., k] for t in train[d]]))      # (N_k, L, H)
        imp = torch.stack([s.mean(0) for s in samples], -1)                                          # (L, H, K)
        white = whitelist(samples, self.white_cfg["mean_quantile"], self.white_cfg["var_quantile"],
                          self.white_cfg["test"], self.white_cfg["alpha"])
        self.state = {"domains": selected, "probes": probes, "importance": imp, "whitelist": white,
                      "probe_acc": acc}
        return self.state

    # --- online ----------------------------------------------------------------------------------
    def _kv_groups(self) -> int:
        attn = attention_modules(self.model)[0]
        return attn.k_proj.out_features // attn.head_dim

    def compile(self, probs: torch.Tensor, eta: float | None = None, target_prune: float | None = None):
        """Probe probabilities (L, K) → (mask (L, H) bool, info); ``execution: slice`` widens it to KV groups. At
        ``eta`` (default: ``pruning_strength``, or the run's calibrated eta), or, given ``target_prune`` (or with
        ``budget.target_scope: scenario``), at this scenario's eta bisected to that pruned fraction."""
        st, b = self.state, self.budget
        kw = dict(rho_min=b["rho_min"], mode=b["mode"], sim_min=b["sim_min"], sharpen=b["sharpen"],
                  fallback_s=b["fallback_s"], floor_layer=b["floor_layer"], floor_global=b["floor_global"])

        def at(e):
            mask, info = compile_mask(probs, st["importance"], st["whitelist"], eta=e, **kw)
            if self.execution == "slice":
                mask = kv_group_mask(mask, self._kv_groups())
                info["pruned_fraction"] = 1.0 - float(mask.double().mean())
            info["kv_saved_fraction"] = kv_saved_fraction(mask, self._kv_groups())
            return mask, info

        if target_prune is None and b["target_scope"] == "scenario":
            target_prune = b["target_prune"]
        if target_prune is not None:   # this scenario's own eta, bisected to the pruned fraction (matched comparisons)
            e, mask, info = bisect_eta(at, float(target_prune))
            info["eta"] = e
            return mask, info
        e = self.eta if eta is None else eta
        mask, info = at(e)
        info["eta"] = e
        return mask, info

    @torch.no_grad()
    def scenario_probs(self, tok, scenario: Mapping) -> torch.Tensor:
        """Sigmoid probe outputs (L, K) for the scenario's routing text: its first prompt, stop-words removed (the
        release's session description). The gold answer is never read: routing on it would leak the answer."""
        first = scenario["turns"][0]
        text = strip_stop_words(first["prompt"]) or first["prompt"]
        regime = REGIMES.get(scenario.get("split"), "single") if self.calib_cfg["enabled"] else "single"
        return self.state["probes"][regime].probs(self.pooled(tok, text)).float()

    def pruned(self, mask: torch.Tensor | None):
        """The context manager that runs the model with ``mask`` (None = dense)."""
        import contextlib

        if mask is None:
            return contextlib.nullcontext(self.model)
        return prune_heads(self.model, mask) if self.execution == "slice" else head_mask(self.model, mask.double())

    @torch.no_grad()
    def evaluate_turns(self, tok, scenario: Mapping, mask: torch.Tensor | None) -> list[dict]:
        """Per scored turn (``scored_turns``): the answer's summed NLL and token count given the conversation and
        prompt, Recall of a greedy continuation, and generation time."""
        out, history = [], []
        ec, scored = self.eval_cfg, scored_turns(scenario)
        for i, turn in enumerate(scenario["turns"]):
            prompt = "\n".join(history + [turn["prompt"]])
            history.append(turn["prompt"] + " " + turn.get("answer", ""))
            if i not in scored:
                continue
            ctx = self._ids(tok, prompt, ec["max_context_tokens"], left=True)
            ans = self._ids(tok, " " + turn["answer"], ec["max_context_tokens"])
            ids = torch.cat([ctx, ans], 1)[:, -ec["max_context_tokens"]:]
            n_ans = min(ans.shape[1], ids.shape[1] - 1)
            with self.pruned(mask):
                logits = self.model(input_ids=ids, use_cache=False).logits[0, -n_ans - 1:-1].double()
                nll = torch.nn.functional.cross_entropy(logits, ids[0, -n_ans:], reduction="sum")
                t0 = time.perf_counter()
                gen = self.model.generate(input_ids=ctx, attention_mask=torch.ones_like(ctx), do_sample=False,
                                          max_new_tokens=ec["max_new_tokens"], pad_token_id=tok.eos_token_id)
                dt = time.perf_counter() - t0
            new = gen[0, ctx.shape[1]:]
            pred = tok.decode(new, skip_special_tokens=True)
            out.append({"nll": float(nll), "tokens": int(n_ans), "recall": recall(pred, turn["answer"],
                        turn.get("choices")), "gen_s": dt, "gen_tokens": int(new.numel()), "prediction": pred})
        return out

    # --- loop ------------------------------------------------------------------------------------
    def _dm(self):
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None or not hasattr(dm, "scenario"):
            raise ValueError("SubspacePathModule needs data=subspace_path (a datamodule with pools and scenarios)")
        return dm

    def on_test_epoch_start(self):
        self.rows = []
        self.model.eval()

    def calibrate_eta(self, dm) -> float:
        """The run's operating point (``budget.target_prune`` with ``target_scope: run``): one eta, bisected so that
        the mean pruned fraction over every scenario of the run is the target (the paper's ≈30%); each scenario keeps
        its breadth-dependent budget at that eta. ``pruning_strength`` alone does not pin the fraction."""
        probs = [self.scenario_probs(dm.tokenizer, dm.scenario(i)) for i in range(dm.n_total())]

        def mean_at(e):
            fr = [self.compile(p, eta=e)[1]["pruned_fraction"] for p in probs]
            return None, {"pruned_fraction": sum(fr) / len(fr)}

        eta, _, info = bisect_eta(mean_at, float(self.budget["target_prune"]))
        self.eta = eta
        self.results["calibrated"] = {"eta": eta, "mean_pruned_fraction": info["pruned_fraction"]}
        return eta

    def test_step(self, index, batch_idx):
        dm = self._dm()
        if self.state is None:
            self.fit_offline(dm, dm.tokenizer)
            if self.budget["target_prune"] is not None and self.budget["target_scope"] == "run":
                self.calibrate_eta(dm)
        sc = dm.scenario(int(index))
        t0 = time.perf_counter()
        probs = self.scenario_probs(dm.tokenizer, sc)
        mask, info = self.compile(probs)
        compile_s = time.perf_counter() - t0
        dense = self.evaluate_turns(dm.tokenizer, sc, None)
        pruned = self.evaluate_turns(dm.tokenizer, sc, mask)
        self.rows.append({"split": sc.get("split", "selected"), "domains": list(sc.get("domains", [])),
                          "compile_s": compile_s, "mask": mask.int().tolist(), "dense": dense, "pruned": pruned,
                          **{k: info[k] for k in ("breadth", "keep_ratio", "pruned_fraction", "kv_saved_fraction", "eta",
                                                  "fallback")}})

    def on_test_epoch_end(self):
        if not self.rows:
            return
        by_split = defaultdict(list)
        for r in self.rows:
            by_split[r["split"]].append(r)
        mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731

        def ppl(rows, which):
            turns = [t for r in rows for t in r[which]]
            return math.exp(sum(t["nll"] for t in turns) / max(1, sum(t["tokens"] for t in turns)))

        table = {}
        for split, rows in sorted(by_split.items()):
            d, p = ppl(rows, "dense"), ppl(rows, "pruned")
            table[split] = {"ppl_dense": d, "ppl_pruned": p, "ppl_ratio": p / d,
                            "recall_dense": 100 * mean([t["recall"] for r in rows for t in r["dense"]]),
                            "recall_pruned": 100 * mean([t["recall"] for r in rows for t in r["pruned"]]),
                            "pruned_fraction": mean([r["pruned_fraction"] for r in rows]),
                            "kv_saved_fraction": mean([r["kv_saved_fraction"] for r in rows]), "scenarios": len(rows)}
            for k, v in table[split].items():
                self.log(f"test/{split}/{k}", float(v))
        tps = lambda which: (sum(t["gen_tokens"] for r in self.rows for t in r[which])  # noqa: E731
                             / max(1e-9, sum(t["gen_s"] for r in self.rows for t in r[which])))
        overall = {"ppl_ratio": ppl(self.rows, "pruned") / ppl(self.rows, "dense"),
                   "pruned_fraction": mean([r["pruned_fraction"] for r in self.rows]),
                   "kv_saved_fraction": mean([r["kv_saved_fraction"] for r in self.rows]),
                   "compile_ms": 1000 * mean([r["compile_s"] for r in self.rows]),
                   "tokens_per_s_dense": tps("dense"), "tokens_per_s_pruned": tps("pruned")}
        for k, v in overall.items():
            self.log(f"test/{k}", float(v))
        for l, a in enumerate(self.state["probe_acc"].tolist()):
            self.log(f"test/probe_acc/L{l}", a)
        self.log("test/eta", float(self.eta))
        self.results = {**self.results,"domains": self.state["domains"], "splits": table, **overall,
                        "probe_acc": self.state["probe_acc"].tolist(),
                        "importance": self.state["importance"].tolist(),
                        "whitelist": self.state["whitelist"].int().tolist(), "scenarios": self.rows}
        from lightning_modules.common.dashboard import heatmap, log_table

        log_table("subspace_path/splits", [{"split": s, **v} for s, v in table.items()], self.loggers)
        heatmap("subspace_path/importance_max", self.state["importance"].amax(-1).tolist(), self.loggers,
                xlabel="head", ylabel="layer")
