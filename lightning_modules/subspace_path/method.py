"""The SubspacePath Pruner's pieces as pure functions (Gong et al., ICML 2026; release GongZhiren/SubspacePathPruner).

- :func:`quasi_orthogonal` picks K candidate domains whose embedding centroids are nearly orthogonal (the paper's
  DBS, not released: greedy, minimising the largest |cos|).
- :func:`train_probes`: per layer and domain a one-vs-rest logistic probe (BCE, Adam, mini-batches of cached pooled
  activations): raw features at lr 1e-3, batch 32 (the release's) or standardised per layer and folded back (ours);
  ``weight`` acts on raw activations either way. :func:`fit_temperatures`: per-layer temperatures (the optional calibration).
- :func:`importance_terms`: (uᵀw̃)² / (‖w̃‖² + ε) per head and axis, I = its mean over a domain's pool.
- :func:`whitelist`: high mean, low across-domain variance of I, confirmed by one-way ANOVA (p > alpha).
- :func:`breadth`, :func:`compile_mask` (the online ScenarioCompiler: probe probabilities → head mask): the
  release's budget (:func:`release_union_mask`: max-over-layers similarities, :func:`infer_domains`, the min-max
  ^1.5 map applied twice, int floors in its order) or the README's sum; :func:`bisect_eta` (matched pruning).
- :func:`kv_saved_fraction`: the KV-cache share a mask frees (whole KV groups only).
- :func:`keywords`, :func:`recall`: the paper's Recall (keyword overlap without stop-words; letter match for
  multiple choice).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

BUDGET_MODES = ("release_union", "paper_sum")

# A common English stop-word list (the release removes stop-words before keyword overlap and from the scenario text).
STOP_WORDS = frozenset("""a about above after again against all am an and any are as at be because been before being
below between both but by can could did do does doing down during each few for from further had has have having he her
here hers herself him himself his how i if in into is it its itself just me more most my myself no nor not now of off on
once only or other our ours ourselves out over own same she should so some such than that the their theirs them
themselves then there these they this those through to too under until up very was we were what when where which while
who whom why will with would you your yours yourself yourselves""".split())


def keywords(text: str) -> list[str]:
    """Lower-cased word tokens of ``text`` without stop-words, in order."""
    return [w for w in re.findall(r"[a-z0-9_]+", text.lower()) if w not in STOP_WORDS]


def strip_stop_words(text: str) -> str:
    return " ".join(keywords(text))


def recall(prediction: str, answer: str, choices: Sequence[str] | None = None) -> float:
    """Fraction of the answer's keywords found in the prediction; with ``choices`` (multiple choice) 1 when the
    first option letter in the prediction is the answer's letter."""
    if choices:
        letter = re.search(r"\b([A-Z])\b", prediction.upper())
        return float(letter is not None and letter.group(1) == answer.strip().upper()[:1])
    ref = set(keywords(answer))
    return len(ref & set(keywords(prediction))) / len(ref) if ref else 0.0


def quasi_orthogonal(centroids: torch.Tensor, k: int) -> list[int]:
    """Indices of ``k`` rows of ``centroids`` (C, d) chosen greedily to minimise the largest |cos| among them: the
    least-aligned pair first, then each time the candidate whose largest |cos| to the chosen ones is smallest."""
    c = F.normalize(centroids.double(), dim=-1)
    cos = (c @ c.T).abs()
    n = cos.shape[0]
    if not 2 <= k <= n:
        raise ValueError(f"quasi_orthogonal: choose 2 <= K <= {n} domains (got {k})")
    masked = cos + torch.eye(n, dtype=cos.dtype) * 9
    i, j = divmod(int(masked.argmin()), n)
    chosen = [i, j]
    while len(chosen) < k:
        worst = cos[:, chosen].amax(1)
        worst[chosen] = math.inf
        chosen.append(int(worst.argmin()))
    return chosen


@dataclass
class Probes:
    """Logistic probes: logits (…, L, K) = x (…, L, d) · weight (L, K, d) + bias (L, K), on raw activations."""

    weight: torch.Tensor
    bias: torch.Tensor
    temperature: torch.Tensor | None = None   # (L,) when calibrated

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.einsum("...ld,lkd->...lk", x.to(self.weight), self.weight) + self.bias
        return z / self.temperature[:, None] if self.temperature is not None else z

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(x))

    def axes(self) -> torch.Tensor:
        """u_{ℓ,k}: the unit probe weights (L, K, d) ([INF]: the release's axis is the probe direction)."""
        return F.normalize(self.weight, dim=-1)


PROBE_FEATURES = ("raw", "standardised")


def train_probes(x: torch.Tensor, y: torch.Tensor, epochs: int = 20, lr: float = 1e-3, batch_size: int = 32,
                 weight_decay: float = 0.0, seed: int = 0, features: str = "raw") -> Probes:
    """One-vs-rest logistic probes for every layer at once: x (N, L, d) pooled activations, y (N, K) 0/1 labels;
    BCE, Adam at ``lr`` on shuffled mini-batches of ``batch_size``. ``features``: ``raw`` (the release's: Adam
    1e-3, batch 32 on the activations as they are) | ``standardised`` (ours: per-layer z-scores, folded back into the
    weights after training, which conditions residual streams whose coordinates differ by orders of magnitude)."""
    if features not in PROBE_FEATURES:
        raise ValueError(f"probe.features={features!r}: choose one of {', '.join(PROBE_FEATURES)}")
    with torch.inference_mode(False), torch.enable_grad():   # Lightning's test loop runs in inference mode
        return _train_probes(x.double().clone(), y.double().clone(), epochs, lr, batch_size, weight_decay, seed,
                             features == "standardised")


def _train_probes(x, y, epochs, lr, batch_size, weight_decay, seed, standardise) -> Probes:
    if standardise:
        mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    else:
        mu, sd = torch.zeros_like(x[0]), torch.ones_like(x[0])
    z = (x - mu) / sd
    N, L, d = x.shape
    K = y.shape[1]
    g = torch.Generator().manual_seed(seed)
    w = torch.zeros(L, K, d, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(L, K, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=lr, weight_decay=weight_decay)
    target = y[:, None, :].expand(N, L, K)
    for _ in range(epochs):
        for idx in torch.randperm(N, generator=g).split(batch_size):
            logits = torch.einsum("nld,lkd->nlk", z[idx], w) + b
            loss = F.binary_cross_entropy_with_logits(logits, target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    w, b = w.detach(), b.detach()
    w_raw = w / sd[:, None, :]                                   # w·(x-μ)/σ + b = (w/σ)·x + (b - (w/σ)·μ)
    return Probes(w_raw, b - torch.einsum("lkd,ld->lk", w_raw, mu))


def fit_temperatures(probes: Probes, x: torch.Tensor, y: torch.Tensor,
                     grid: torch.Tensor | None = None) -> torch.Tensor:
    """Per-layer temperature T_ℓ minimising the BCE of sigmoid(logit / T_ℓ) on (x, y) (a log-spaced grid search)."""
    grid = torch.logspace(-1, 1.5, 61, dtype=torch.float64) if grid is None else grid
    z = Probes(probes.weight, probes.bias).logits(x)                         # (N, L, K), uncalibrated
    t = y.double()[:, None, :].expand_as(z)
    losses = torch.stack([F.binary_cross_entropy_with_logits(z / T, t, reduction="none").mean((0, 2)) for T in grid])
    return grid[losses.argmin(0)]


def importance_terms(writes: torch.Tensor, axes: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(uₖᵀw̃)² / (‖w̃‖² + ε): writes (…, H, d), axes (K, d) unit → (…, H, K)."""
    w = writes.double()
    proj = torch.einsum("...hd,kd->...hk", w, axes.double())
    return proj.pow(2) / (w.pow(2).sum(-1, keepdim=True) + eps)


def whitelist(samples: Sequence[torch.Tensor], mean_quantile: float = 0.8, var_quantile: float = 0.2,
              test: str = "anova", alpha: float = 0.05) -> torch.Tensor:
    """Backbone heads (L, H) bool from per-sample importances, one (N_k, L, H) tensor per domain k (each sample's
    I toward its own domain's axis): mean over domains ≥ its ``mean_quantile`` quantile, across-domain variance
    ≤ its ``var_quantile`` quantile, and (``test: anova``) no significant domain effect (one-way ANOVA p > alpha)."""
    if test not in ("anova", "none"):
        raise ValueError(f"whitelist.test={test!r}: choose anova or none")
    means = torch.stack([s.double().mean(0) for s in samples])            # (K, L, H)
    m, v = means.mean(0), means.var(0, unbiased=False)
    keep = (m >= torch.quantile(m.flatten(), mean_quantile)) & (v <= torch.quantile(v.flatten(), var_quantile))
    if test == "anova":
        from scipy.stats import f_oneway

        for l, h in keep.nonzero().tolist():
            groups = [s[:, l, h].double().numpy() for s in samples]
            p = f_oneway(*groups).pvalue
            keep[l, h] = bool(p > alpha) or bool(math.isnan(p))   # nan: identical groups, no domain effect
    return keep


def breadth(q: torch.Tensor) -> float:
    """c = H(q/Σq) / log K ∈ [0, 1]: 0 for a one-hot mixture, 1 for a uniform one."""
    p = q.double() / q.double().sum()
    ent = -(p * p.clamp_min(1e-300).log()).sum()
    return float(ent / math.log(q.numel()))


def apply_floors(mask: torch.Tensor, score: torch.Tensor, floor_layer: float = 0.1,
                 floor_global: float = 0.05) -> torch.Tensor:
    """Add the best-scored heads until every layer keeps ≥ max(1, ⌈floor_layer·H⌉) and the model ≥
    ⌈floor_global·L·H⌉."""
    mask = mask.clone()
    L, H = mask.shape
    per_layer = max(1, math.ceil(floor_layer * H))
    for l in range(L):
        for h in score[l].argsort(descending=True).tolist():
            if int(mask[l].sum()) >= per_layer:
                break
            mask[l, h] = True
    need = math.ceil(floor_global * L * H) - int(mask.sum())
    if need > 0:
        rest = torch.where(mask.flatten(), -math.inf, score.flatten().double())
        mask.view(-1)[rest.argsort(descending=True)[:need]] = True
    return mask


def infer_domains(probs: torch.Tensor, min_prob: float = 0.05, concentration_weight: float = 0.3,
                  cross_threshold: float = 0.15) -> list[int]:
    """The release's domain inference (``DomainInference.infer_domains`` with its defaults): each layer's sigmoid
    outputs p (L, K) renormalised to shares; per domain score = (0.6·mean of its top-5 layer shares + 0.4·its
    largest share)·(1 + w / (n + 1)), n the layers where its share exceeds ``min_prob``. Domains scoring ≥ ``min_prob``
    are candidates; when two or more score ≥ ``cross_threshold`` all of those are returned (a cross-domain scenario,
    best first), else the best candidate alone (or the best domain when none is a candidate)."""
    p = probs.double()
    total = p.sum(-1, keepdim=True)
    share = torch.where(total > 0, p / total.clamp_min(1e-300), p)
    top = share.topk(min(5, share.shape[0]), dim=0).values.mean(0)
    n_sig = (share > min_prob).sum(0).double()
    score = (0.6 * top + 0.4 * share.amax(0)) * (1 + concentration_weight / (n_sig + 1))
    order = sorted(range(score.numel()), key=lambda k: -float(score[k]))   # stable: ties keep the domain order
    kept = [k for k in order if score[k] >= min_prob]
    if not kept:
        return order[:1]
    high = [k for k in kept if score[k] >= cross_threshold]
    return high if len(high) > 1 else kept[:1]


def _top_n(score: torch.Tensor, n: int) -> torch.Tensor:
    """(L, H) bool of the n best-scored heads; ties in (layer, head) order, as a stable sort of the release's list."""
    mask = torch.zeros(score.numel(), dtype=torch.bool)
    mask[torch.sort(score.flatten(), descending=True, stable=True).indices[:n]] = True
    return mask.reshape(score.shape)


def release_union_mask(probs: torch.Tensor, importance: torch.Tensor, white: torch.Tensor | None, eta: float,
                       rho_min: float = 0.1, sim_min: float = 0.1, sharpen: float = 1.5, fallback_s: float = 0.3,
                       floor_layer: float = 0.1, floor_global: float = 0.05):
    """The release's budget (``SessionPruner._prune_based_on_domains``), step by step.

    - similarity s_k = max over layers of the sigmoid outputs (not normalised); breadth c from their mean over
      layers; base keep ratio = min(1, rho_min + eta·c);
    - only the inferred domains (:func:`infer_domains`) are processed, each skipped when s_k < ``sim_min`` unless
      every s_k is (then the mean importance over domains with s_eff = max(s_k, ``fallback_s``));
    - a domain's head scores are s_k·I_{·,·,k} (the raw s_k); its count is max(1, int(L·H·min(1, base·s_eff))) where
      s_eff maps s_k through min-max over the valid s (those ≥ ``sim_min``) raised to ``sharpen`` and back — twice,
      as the release applies it once before and once inside its head selection;
    - union of the domains' top heads, plus the whitelist; then the floors with int and in the release's order:
      one head in every empty layer, then ``max(int(floor_global·L·H), L)`` heads overall, then
      ``max(int(floor_layer·H), 1)`` per layer, each topped up by the best score over the processed domains."""
    L, H, K = importance.shape
    I = importance.double()
    p = probs.double()
    c = breadth(p.mean(0))
    sim = p.amax(0)
    base = min(1.0, rho_min + eta * c)
    domains = infer_domains(p)
    all_low = float(sim.max()) < sim_min
    valid = sim[sim >= sim_min]
    hi, lo = (float(valid.max()), float(valid.min())) if len(valid) else (float(sim.max()), sim_min)

    def stretch(x: float) -> float:
        return lo + ((x - lo) / (hi - lo)) ** sharpen * (hi - lo)

    def scores(k: int) -> torch.Tensor:
        return max(float(sim[k]), fallback_s) * I.mean(-1) if all_low else float(sim[k]) * I[..., k]

    used = [k for k in domains if all_low or sim[k] >= sim_min]
    mask = torch.zeros(L, H, dtype=torch.bool)
    for k in used:
        eff = max(float(sim[k]), fallback_s) if all_low else (stretch(float(sim[k])) if hi > lo else float(sim[k]))
        if hi > lo and eff >= lo:
            eff = stretch(eff)
        mask |= _top_n(scores(k), max(1, int(L * H * min(base * eff, 1.0))))
    white = torch.zeros(L, H, dtype=torch.bool) if white is None else white.bool()
    mask |= white
    best = torch.stack([scores(k) for k in used]).amax(0) if used else None      # (L, H), max over domains
    for l in range(L):                                          # 1. no layer left empty
        if not mask[l].any():
            mask[l, int(best[l].argmax()) if best is not None else 0] = True
    need = max(int(L * H * floor_global), L) - int(mask.sum())  # 2. enough heads overall
    if need > 0 and used:
        # (L, |used|, H): the release's list order (layer, domain, head) breaks ties; whitelist heads are not candidates
        cand = torch.stack([scores(k) for k in used], 1).masked_fill(white[:, None, :], -math.inf).flatten()
        for i in torch.sort(cand, descending=True, stable=True).indices.tolist():
            if need <= 0 or math.isinf(float(cand[i])):
                break
            l, h = i // (len(used) * H), i % H
            if not mask[l, h]:
                mask[l, h] = True
                need -= 1
    per_layer = max(int(H * floor_layer), 1)                    # 3. enough heads per layer
    for l in range(L):
        missing = per_layer - int(mask[l].sum())
        if missing > 0:
            s = best[l] if best is not None else torch.zeros(H, dtype=torch.float64)
            free = [h for h in torch.sort(s, descending=True, stable=True).indices.tolist() if not mask[l, h]]
            mask[l, free[:missing]] = True
    info = {"breadth": c, "keep_ratio": base, "q": p.mean(0).tolist(), "s": sim.tolist(), "fallback": all_low,
            "inferred": domains, "pruned_fraction": 1.0 - float(mask.double().mean())}
    return mask, info


def compile_mask(probs: torch.Tensor, importance: torch.Tensor, white: torch.Tensor | None = None, eta: float = 0.5,
                 rho_min: float = 0.1, mode: str = "release_union", sim_min: float = 0.1, sharpen: float = 1.5,
                 fallback_s: float = 0.3, floor_layer: float = 0.1, floor_global: float = 0.05):
    """Probe probabilities p (L, K) and importances I (L, H, K) → (keep mask (L, H) bool, info).

    ``release_union`` (default): the release's budget, :func:`release_union_mask`. ``paper_sum`` (the README's
    formula, score = Σ_k s_eff,k·I_k): q = mean_ℓ p, c = breadth(q), s = q/Σq; keep ratio = min(1, rho_min + eta·c);
    domains with s_k < sim_min are skipped; the valid s are renormalised and raised to ``sharpen`` (s_eff); if none
    is valid, the mean importance over domains with s_eff = max(max_k s_k, fallback_s); the top ⌊keep·L·H⌋ heads by
    Σ_k s_eff,k·I_k, then the whitelist and the floors (:func:`apply_floors`, ranked by the same score)."""
    if mode not in BUDGET_MODES:
        raise ValueError(f"budget.mode={mode!r}: choose one of {', '.join(BUDGET_MODES)}")
    if mode == "release_union":
        return release_union_mask(probs, importance, white, eta, rho_min, sim_min, sharpen, fallback_s,
                                  floor_layer, floor_global)
    L, H, K = importance.shape
    I = importance.double()
    q = probs.double().mean(0)
    c = breadth(q)
    s = q / q.sum()
    keep = min(1.0, rho_min + eta * c)
    valid = s >= sim_min
    if valid.any():
        s_eff = torch.zeros(K, dtype=torch.float64)
        s_eff[valid] = (s[valid] / s[valid].sum()) ** sharpen
        total = (I * s_eff).sum(-1)
    else:
        total = I.mean(-1) * max(float(s.max()), fallback_s)
    mask = _top_n(total, int(math.floor(keep * L * H)))
    if white is not None:
        mask |= white.bool()
    mask = apply_floors(mask, total, floor_layer, floor_global)
    info = {"breadth": c, "keep_ratio": keep, "q": q.tolist(), "s": s.tolist(), "fallback": not bool(valid.any()),
            "pruned_fraction": 1.0 - float(mask.double().mean())}
    return mask, info


def kv_saved_fraction(mask: torch.Tensor, n_kv: int) -> float:
    """The share of the KV cache a head mask (L, H) frees: (layer, KV group) pairs whose every query head is pruned.
    Under grouped-query attention a group serves H / n_kv heads; pruning some of them saves compute but no cache."""
    L, H = mask.shape
    return float((~mask.bool().reshape(L, n_kv, H // n_kv).any(-1)).double().mean())


def bisect_eta(compile_at: Callable[[float], tuple[torch.Tensor, dict]], target_prune: float, hi: float = 64.0,
               steps: int = 40):
    """The eta whose mask's pruned fraction is closest to ``target_prune`` (the fraction falls as eta grows: the
    release's keep ratio rises with it). Returns (eta, mask, info)."""
    lo_eta, hi_eta = 0.0, hi
    best = None
    for _ in range(steps):
        mid = (lo_eta + hi_eta) / 2
        mask, info = compile_at(mid)
        gap = abs(info["pruned_fraction"] - target_prune)
        if best is None or gap < best[0]:
            best = (gap, mid, mask, info)
        if info["pruned_fraction"] > target_prune:
            lo_eta = mid
        else:
            hi_eta = mid
    return best[1], best[2], best[3]
