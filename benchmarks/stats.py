"""The one verdict rule of the reproduction report: every benchmark's verdicts are computed here and nowhere else.

A benchmark measures an :class:`Estimate` (a value and, where there is a noise estimate, an interval over stated
replicates), then :func:`claim` judges it against the claim's expected direction and threshold. The schema
(``benchmarks/schema.py``) recomputes each stored verdict with :func:`decide` when it loads a results file, so a
verdict written any other way does not load. The rule, printed at the top of ``benchmarks/REPORT.md``:
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np

LEVEL = 0.90  # two-sided; an interval entirely on one side of the threshold is a one-sided test at 5%
EXPECT = (">", "<", "within")
ROLES = ("claim", "control", "by_construction")
UNKNOWN = "unknown"  # n_seeds / n_items of a migrated claim its file cannot tell

RULE = (
    "**The verdict rule** (`benchmarks/stats.py`, the one place a verdict is computed). A claim has an expected "
    "direction (the estimate above `>`, below `<`, or `within` ± a margin of a threshold), a threshold (0, or 1 for "
    "a ratio, when the claim is that an effect exists; otherwise a stated value: the paper's, or ours with the "
    "reason), an estimate and a two-sided 90% interval over stated replicates. Means over seeds use Student's t "
    "with the seeds' degrees of freedom (never z with 2–3 seeds); arms that share seeds or items are compared by "
    "paired differences, others by Welch's t (or Newcombe's interval for two proportions); an interval over the "
    "items of one run (prompts, tokens, updates: binomial/Wilson, t over items, or a percentile bootstrap) says so. "
    "A choice made after seeing the data (best layer, best prompt) widens the interval to 1 − 0.10/k for k "
    "candidates (Bonferroni); \"better than every competitor\" compares against each one with both arms' errors, "
    "held only when every comparison is held. **held**: the interval lies entirely on the expected side of the "
    "threshold; **not held**: entirely on the other side; otherwise **inconclusive** — always so without a noise "
    "estimate (one run, two single numbers), with zero variance (SE 0, a zero-width bootstrap), or when the "
    "measurement cannot move (a discriminator that never fires). Claims true by construction and controls (go/no-go "
    "checks, planted recoveries) are judged but not counted. \"Held\" means held at tiny scale on these replicates, "
    "never that the paper is reproduced.")
__doc__ += "\n" + RULE + "\n"


@dataclass(frozen=True)
class Estimate:
    """A measured value and its interval. ``over`` names the replicates behind the interval ("seeds", or the items
    of one run: "prompts", "tokens", "updates", ...), ``n`` their count; ``lo``/``hi`` None: no noise estimate."""
    value: float | None
    lo: float | None = None
    hi: float | None = None
    se: float | None = None
    df: float | None = None
    n: int | None = None
    over: str | None = None
    method: str = "none"
    level: float = LEVEL
    paired: bool | None = None
    candidates: int = 1

    @property
    def interval(self) -> list[float] | None:
        return None if self.lo is None or self.hi is None else [float(self.lo), float(self.hi)]


def _level(level: float, candidates: int) -> float:
    """The interval's coverage for a choice among ``candidates`` made after the fact (Bonferroni)."""
    if candidates < 1:
        raise ValueError(f"candidates={candidates}: at least 1")
    return 1.0 - (1.0 - level) / candidates


def t_quantile(level: float, df: float | None) -> float:
    """Two-sided ``level`` quantile of Student's t with ``df`` degrees of freedom (the normal for ``df`` None)."""
    from scipy import stats

    q = 0.5 + level / 2
    return float(stats.norm.ppf(q) if df is None or not math.isfinite(df) else stats.t.ppf(q, df))


def _finite(xs: Iterable[float]) -> np.ndarray:
    a = np.asarray([float(x) for x in xs], dtype=np.float64)
    if a.size and not np.isfinite(a).all():
        raise ValueError(f"non-finite values {a[~np.isfinite(a)][:3].tolist()}: a verdict needs finite numbers")
    return a


# --- estimates -----------------------------------------------------------------------------------------------
def single(value: float | None, over: str | None = None) -> Estimate:
    """One number with no noise estimate (one run): always inconclusive."""
    return Estimate(None if value is None else float(value), over=over)


def from_se(value: float, se: float | None, df: float | None, n: int, over: str, method: str, *,
            level: float = LEVEL, paired: bool | None = None, candidates: int = 1) -> Estimate:
    """value ± t(df)·se (the normal for ``df`` None): for a standard error computed elsewhere (delta method, a
    stored result); ``se`` None is no noise estimate."""
    if se is None or not math.isfinite(se):
        return Estimate(float(value), n=n, over=over, paired=paired, candidates=candidates)
    lv = _level(level, candidates)
    h = t_quantile(lv, df) * se
    return Estimate(float(value), value - h, value + h, float(se), df, n, over, method, lv, paired, candidates)


def given(value: float, lo: float | None, hi: float | None, *, n: int, over: str, method: str,
          level: float = LEVEL) -> Estimate:
    """An interval computed elsewhere (a bootstrap in ``sweeps.fit``), taken as it is; None ends: no interval."""
    if lo is None or hi is None:
        return Estimate(float(value), n=n, over=over)
    return Estimate(float(value), float(lo), float(hi), None, None, n, over, method, level)


def mean(xs: Sequence[float], over: str = "seeds", *, level: float = LEVEL, candidates: int = 1) -> Estimate:
    """Mean with a Student-t interval on n − 1 degrees of freedom (no interval for one value)."""
    a = _finite(xs)
    if a.size == 0:
        raise ValueError("mean of no values")
    if a.size < 2:
        return Estimate(float(a[0]), n=1, over=over, candidates=candidates)
    return from_se(float(a.mean()), float(a.std(ddof=1) / math.sqrt(a.size)), a.size - 1, int(a.size), over, "t",
                   level=level, candidates=candidates)


def paired(a: Sequence[float], b: Sequence[float], over: str = "seeds", *, level: float = LEVEL,
           candidates: int = 1) -> Estimate:
    """mean(a − b) over replicates both arms share (the same seeds or items), t on n − 1 degrees of freedom."""
    if len(a) != len(b):
        raise ValueError(f"paired: {len(a)} vs {len(b)} replicates — pair the same seeds or items")
    e = mean([x - y for x, y in zip(a, b)], over, level=level, candidates=candidates)
    return replace(e, paired=True, method="paired t" if e.lo is not None else e.method)


def welch(a: Sequence[float], b: Sequence[float], over: str = "seeds", *, level: float = LEVEL,
          candidates: int = 1) -> Estimate:
    """mean(a) − mean(b) for arms with different replicates, Welch's t with Satterthwaite's degrees of freedom.
    An arm with one value contributes no variance; both with one: no noise estimate."""
    x, y = _finite(a), _finite(b)
    d = float(x.mean() - y.mean())
    vx = x.var(ddof=1) / x.size if x.size > 1 else 0.0
    vy = y.var(ddof=1) / y.size if y.size > 1 else 0.0
    n = int(min(x.size, y.size))
    if x.size < 2 and y.size < 2:
        return Estimate(d, n=n, over=over, paired=False, candidates=candidates)
    terms = [(v, k) for v, k in ((vx, x.size), (vy, y.size)) if k > 1]
    num = (vx + vy) ** 2
    den = sum(v * v / (k - 1) for v, k in terms)
    df = num / den if den > 0 else min(k for _, k in terms) - 1
    return from_se(d, math.sqrt(vx + vy), df, n, over, "Welch t", level=level, paired=False, candidates=candidates)


def _z(level: float) -> float:
    return t_quantile(level, None)


def wilson(k: int, n: int, level: float = LEVEL) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n."""
    if n <= 0:
        raise ValueError(f"wilson: n={n} trials")
    z, p = _z(level), k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def proportion(k: int, n: int, over: str = "items", *, level: float = LEVEL, candidates: int = 1) -> Estimate:
    """k of n with its Wilson interval (never zero-width, also at 0/n and n/n)."""
    lv = _level(level, candidates)
    lo, hi = wilson(k, n, lv)
    return Estimate(k / n, lo, hi, None, None, n, over, "Wilson", lv, None, candidates)


def proportion_diff(k1: int, n1: int, k2: int, n2: int, over: str = "items", *, level: float = LEVEL,
                    candidates: int = 1) -> Estimate:
    """k1/n1 − k2/n2 of two independent samples, Newcombe's hybrid score interval (from the two Wilson intervals:
    0/32 vs 0/32 gives a real interval around 0, not an exact 0)."""
    lv = _level(level, candidates)
    p1, p2 = k1 / n1, k2 / n2
    (l1, u1), (l2, u2) = wilson(k1, n1, lv), wilson(k2, n2, lv)
    d = p1 - p2
    lo = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    return Estimate(d, lo, hi, None, None, int(min(n1, n2)), over, "Newcombe", lv, False, candidates)


def correlation(r: float, n: int, over: str = "items", *, level: float = LEVEL, candidates: int = 1) -> Estimate:
    """Pearson r over n points with the Fisher-z interval (SE 1/√(n − 3)); fewer than 4 points: no interval."""
    if n < 4 or not math.isfinite(r) or abs(r) >= 1:
        return Estimate(float(r), n=n, over=over, candidates=candidates)
    lv = _level(level, candidates)
    z, h = math.atanh(r), _z(lv) / math.sqrt(n - 3)
    return Estimate(float(r), math.tanh(z - h), math.tanh(z + h), 1 / math.sqrt(n - 3), None, n, over, "Fisher z",
                    lv, None, candidates)


def slope(x: Sequence[float], y: Sequence[float], over: str = "points", *, level: float = LEVEL) -> Estimate:
    """Least-squares slope of y on x with its t interval on n − 2 degrees of freedom (residuals as the noise)."""
    xs, ys = _finite(x), _finite(y)
    n = xs.size
    if n < 3:
        return Estimate(float(np.polyfit(xs, ys, 1)[0]) if n == 2 else None, n=n, over=over)
    sxx = float(((xs - xs.mean()) ** 2).sum())
    b = float(((xs - xs.mean()) * (ys - ys.mean())).sum() / sxx)
    resid = ys - ys.mean() - b * (xs - xs.mean())
    se = math.sqrt(float((resid ** 2).sum()) / (n - 2) / sxx)
    return from_se(b, se, n - 2, n, over, "OLS t", level=level)


def dispersion(chi2: float, dof: int, over: str = "cells", *, level: float = LEVEL) -> Estimate:
    """Pearson χ²/dof of a count fit (1 = binomial noise alone) with its interval from χ² ~ φ·χ²(dof)."""
    from scipy import stats

    if dof < 1:
        return Estimate(None, n=dof, over=over)
    a = (1 - level) / 2
    return Estimate(chi2 / dof, chi2 / stats.chi2.ppf(1 - a, dof), chi2 / stats.chi2.ppf(a, dof), None, dof, dof,
                    over, "χ² (overdispersion)", level)


def ratio(a: Sequence[float], b: Sequence[float], over: str, *, paired: bool, level: float = LEVEL) -> Estimate:
    """mean(a) / mean(b) with a delta-method SE (the covariance term when both arms share replicates), t on
    n − 1 degrees of freedom (the smaller arm's when unpaired)."""
    x, y = _finite(a), _finite(b)
    if paired and x.size != y.size:
        raise ValueError(f"paired ratio: {x.size} vs {y.size} replicates")
    mx, my = float(x.mean()), float(y.mean())
    r = mx / my
    if min(x.size, y.size) < 2:
        return Estimate(r, n=int(min(x.size, y.size)), over=over, paired=paired)
    vx, vy = x.var(ddof=1) / x.size, y.var(ddof=1) / y.size
    cov = float(np.cov(x, y, ddof=1)[0, 1] / x.size) if paired else 0.0
    var = r * r * (vx / mx ** 2 + vy / my ** 2 - 2 * cov / (mx * my))
    n = int(min(x.size, y.size))
    return from_se(r, math.sqrt(max(var, 0.0)), n - 1, n, over, "delta-method t", level=level, paired=paired)


def bootstrap(value: float, replicates: Sequence[float], n: int, over: str, *, level: float = LEVEL,
              candidates: int = 1) -> Estimate:
    """A percentile interval from bootstrap replicates of a statistic (resampling ``n`` ``over``)."""
    reps = _finite(replicates)
    if reps.size < 2:
        return Estimate(float(value), n=n, over=over, candidates=candidates)
    lv = _level(level, candidates)
    a = (1 - lv) / 2
    return Estimate(float(value), float(np.quantile(reps, a)), float(np.quantile(reps, 1 - a)),
                    float(reps.std(ddof=1)), None, n, over, "bootstrap", lv, None, candidates)


def resample(data: Sequence, stat: Callable[[list], float], over: str, *, n_boot: int = 2000, seed: int = 0,
             level: float = LEVEL) -> Estimate:
    """``stat`` of the items and its percentile interval from resampling the items with replacement."""
    items = list(data)
    rng = np.random.default_rng(seed)
    reps = [stat([items[i] for i in rng.integers(0, len(items), len(items))]) for _ in range(n_boot)]
    return bootstrap(stat(items), reps, len(items), over, level=level)


def seed_bootstrap(value: float, boot_se: float, n_seeds: int, *, level: float = LEVEL) -> Estimate:
    """A statistic bootstrapped over ``n_seeds`` seeds, judged as a mean over seeds: the bootstrap SE (which is
    √((n−1)/n) of the classical one) rescaled, and t on n − 1 degrees of freedom — with 3 seeds a percentile
    interval has 10 distinct resamples and covers far less than it says."""
    if n_seeds < 2:
        return Estimate(float(value), n=n_seeds, over="seeds")
    return from_se(value, boot_se * math.sqrt(n_seeds / (n_seeds - 1)), n_seeds - 1, n_seeds, "seeds",
                   "t (bootstrap SE over seeds)", level=level)


# --- the verdict ---------------------------------------------------------------------------------------------
def decide(value: float | None, interval: Sequence[float] | None, expect: str | None, threshold: float | None,
           margin: float | None = None) -> tuple[str, str]:
    """(verdict, reason) from an interval: the rule above, and the only function that writes a verdict."""
    if expect is None:
        return "not_measurable_here", "no measurement here"
    if expect not in EXPECT:
        raise ValueError(f"expect={expect!r}: one of {EXPECT}")
    if threshold is None or not math.isfinite(threshold):
        raise ValueError("a judged claim needs a finite threshold")
    if expect == "within" and not (margin and margin > 0):
        raise ValueError("expect='within' needs a margin > 0")
    if value is None:
        return "inconclusive", "not measured"
    if interval is None:
        return "inconclusive", "no noise estimate (one run)"
    lo, hi = (float(v) for v in interval)
    if not lo <= hi:
        raise ValueError(f"interval [{lo}, {hi}] is not ordered")
    if hi - lo <= 1e-9 * max(1.0, abs(lo), abs(hi)):
        return "inconclusive", "zero variance: no noise estimate"
    if expect == "within":
        a, b = threshold - margin, threshold + margin
        if a < lo and hi < b:
            return "held", f"inside {threshold:g} ± {margin:g}"
        if hi < a or lo > b:
            return "not_held", f"outside {threshold:g} ± {margin:g}"
        return "inconclusive", f"overlaps the edge of {threshold:g} ± {margin:g}"
    above, below = lo > threshold, hi < threshold
    if above or below:
        on_side = above if expect == ">" else below
        return ("held" if on_side else "not_held"), f"entirely {'above' if above else 'below'} {threshold:g}"
    return "inconclusive", f"contains {threshold:g}"


def unidentified_reason(needs: Iterable[str], unidentified: Iterable[str]) -> str | None:
    """Why a fitted claim cannot be judged: a constant it rests on lies on a flat direction of the fit or has a
    zero-width bootstrap interval (``sweeps.fit.identifiability``); pass it as ``claim(degenerate=...)``."""
    hit = sorted(set(needs) & set(unidentified))
    return f"not identified by the fit: {', '.join(hit)}" if hit else None


def identified_verdict(verdict, needs: Iterable[str], unidentified: Iterable[str]):
    """``verdict`` unless :func:`unidentified_reason` finds a reason: then inconclusive (a pinned constant is not
    a measured one)."""
    return "inconclusive" if unidentified_reason(needs, unidentified) else verdict


def all_of(verdicts: Iterable[str]) -> str:
    """'Better than every competitor': held when every comparison is held, not held when any is not held."""
    vs = list(verdicts)
    if not vs:
        return "inconclusive"
    if "not_held" in vs:
        return "not_held"
    return "held" if all(v == "held" for v in vs) else "inconclusive"


def claim(id: str, quote: str, metric: str, est: Estimate, *, expect: str, threshold: float = 0.0,
          why: str, n_seeds: int | str | None, n_items: int | str | None, margin: float | None = None,
          paper_value: str | None = None, our_threshold: str | None = None, role: str = "claim",
          degenerate: str | None = None, versus: dict[str, Estimate] | None = None):
    """A judged claim. ``n_seeds`` and ``n_items`` are both stated (None where they do not apply); a threshold that
    is ours says why in ``our_threshold``; ``degenerate`` names why the measurement cannot test the claim (the
    verdict is then inconclusive). ``versus`` ({competitor: estimate of the difference}) makes it an 'every
    competitor' claim: each comparison is judged with the same direction and threshold and the verdict is
    :func:`all_of` theirs; ``est`` is the one shown (usually the strongest competitor's)."""
    from benchmarks.schema import Claim

    if role not in ROLES:
        raise ValueError(f"role={role!r}: one of {ROLES}")
    comparisons = None
    if versus:
        comparisons = [{"against": k, "value": e.value, "interval": e.interval, "method": e.method,
                        "paired": e.paired, "verdict": decide(e.value, e.interval, expect, threshold, margin)[0]}
                       for k, e in versus.items()]
        verdict = all_of(c["verdict"] for c in comparisons)
    else:
        verdict, _ = decide(est.value, est.interval, expect, threshold, margin)
    if degenerate:
        verdict = "inconclusive"
    return Claim(id=id, quote=quote, metric=metric, value=est.value, verdict=verdict, why=why, expect=expect,
                 threshold=float(threshold), margin=margin, interval=est.interval,
                 level=est.level if est.interval else None, method=est.method if est.interval else None,
                 over=est.over, df=est.df, stderr=est.se, n_seeds=n_seeds, n_items=n_items, paired=est.paired,
                 candidates=est.candidates, paper_value=paper_value, our_threshold=our_threshold, role=role,
                 degenerate=degenerate, comparisons=comparisons)


def not_measurable(id: str, quote: str, metric: str, *, paper_value: str | None, why: str,
                   value: float | None = None):
    """A claim this machine cannot measure (paper scale, hub checkpoints, APIs); ``value``: a tiny stand-in number
    reported beside it, not judged."""
    from benchmarks.schema import Claim

    return Claim(id=id, quote=quote, metric=metric, value=value, verdict="not_measurable_here", why=why,
                 paper_value=paper_value)


def recheck(c: dict) -> str:
    """The verdict a stored claim's fields imply (``schema.validate`` compares it with the stored one)."""
    if c.get("verdict") == "not_measurable_here" and c.get("expect") is None:
        return "not_measurable_here"
    if c.get("comparisons"):
        v = all_of(decide(x["value"], x["interval"], c["expect"], c["threshold"], c.get("margin"))[0]
                   for x in c["comparisons"])
    else:
        v = decide(c.get("value"), c.get("interval"), c.get("expect"), c.get("threshold"), c.get("margin"))[0]
    return "inconclusive" if c.get("degenerate") else v
