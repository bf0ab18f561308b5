"""The SubspacePath Pruner's pieces as pure functions (Gong et al., ICML 2026; release GongZhiren/SubspacePathPruner).

- :func:`quasi_orthogonal` picks K candidate domains whose embedding centroids are nearly orthogonal (the paper's
  DBS, not released: greedy, minimising the largest |cos|).
- :func:`train_probes`: per layer and domain a one-vs-rest logistic probe (BCE, Adam, full batches of cached pooled
  activations); features standardised per layer for conditioning and folded back, so ``weight`` acts on raw
  activations. :func:`fit_temperatures`: per-layer temperatures (the optional calibration).
- :func:`importance_terms`: (uᵀw̃)² / (‖w̃‖² + ε) per head and axis, I = its mean over a domain's pool.
- :func:`whitelist`: high mean, low across-domain variance of I, confirmed by one-way ANOVA (p > alpha).
- :func:`breadth`, :func:`compile_mask` (the online ScenarioCompiler: probe probabilities → head mask, with the
  release's budget, union or the README's sum, whitelist and floors), :func:`bisect_eta` (matched pruning).
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


def train_probes(x: torch.Tensor, y: torch.Tensor, epochs: int = 20, lr: float = 1e-2, batch_size: int = 64,
                 weight_decay: float = 0.0, seed: int = 0) -> Probes:
    """One-vs-rest logistic probes for every layer at once: x (N, L, d) pooled activations, y (N, K) 0/1 labels."""
    with torch.inference_mode(False), torch.enable_grad():   # Lightning's test loop runs in inference mode
        return _train_probes(x.double().clone(), y.double().clone(), epochs, lr, batch_size, weight_decay, seed)


def _train_probes(x, y, epochs, lr, batch_size, weight_decay, seed) -> Probes:
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
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


def compile_mask(probs: torch.Tensor, importance: torch.Tensor, white: torch.Tensor | None = None, eta: float = 0.5,
                 rho_min: float = 0.1, mode: str = "release_union", sim_min: float = 0.1, sharpen: float = 1.5,
                 fallback_s: float = 0.3, floor_layer: float = 0.1, floor_global: float = 0.05):
    """Probe probabilities p (L, K) and importances I (L, H, K) → (keep mask (L, H) bool, info).

    q = mean_ℓ p, c = breadth(q), s = q/Σq; keep ratio = min(1, rho_min + eta·c). Domains with s_k < sim_min are
    skipped; the valid s are renormalised and raised to ``sharpen`` (s_eff). If none is valid: the mean importance
    over domains with s_eff = max(max_k s_k, fallback_s). ``release_union``: per domain the top ⌊keep·s_eff,k·L·H⌋
    heads by s_eff,k·I_k, their union; ``paper_sum``: the top ⌊keep·L·H⌋ by Σ_k s_eff,k·I_k. Then the whitelist and
    the floors (ranked by the same score)."""
    if mode not in BUDGET_MODES:
        raise ValueError(f"budget.mode={mode!r}: choose one of {', '.join(BUDGET_MODES)}")
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
        scores = I * s_eff                                               # (L, H, K)
        domains = valid.nonzero().flatten().tolist()
    else:
        s_eff = torch.tensor([max(float(s.max()), fallback_s)], dtype=torch.float64)
        scores = I.mean(-1, keepdim=True) * s_eff
        domains = [0]
    mask = torch.zeros(L, H, dtype=torch.bool)
    if mode == "release_union":
        for k in domains:
            n = int(math.floor(keep * float(s_eff[k]) * L * H))
            mask.view(-1)[scores[..., k].flatten().argsort(descending=True)[:n]] = True
        total = scores.amax(-1)
    else:
        total = scores.sum(-1)
        mask.view(-1)[total.flatten().argsort(descending=True)[: int(math.floor(keep * L * H))]] = True
    if white is not None:
        mask |= white.bool()
    mask = apply_floors(mask, total, floor_layer, floor_global)
    info = {"breadth": c, "keep_ratio": keep, "q": q.tolist(), "s": s.tolist(), "fallback": not bool(valid.any()),
            "pruned_fraction": 1.0 - float(mask.double().mean())}
    return mask, info


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
