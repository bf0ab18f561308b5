"""The verdict rule (benchmarks/stats.py) on planted data: each case has a known answer."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sp

from benchmarks import stats
from benchmarks.schema import validate


def verdict(est, expect=">", threshold=0.0, margin=None):
    return stats.decide(est.value, est.interval, expect, threshold, margin)[0]


def test_t_and_z_disagree_with_three_seeds():
    """Three seeds whose z interval (1.645 SE) excludes 0 but whose t(2) interval (2.92 SE) does not."""
    xs = [0.1, 0.3, 0.5]
    est = stats.mean(xs)
    se = np.std(xs, ddof=1) / math.sqrt(3)
    assert est.df == 2 and math.isclose(est.se, se)
    assert math.isclose(est.hi - est.value, sp.t.ppf(0.95, 2) * se)
    z = stats.from_se(est.value, se, None, 3, "seeds", "z")  # what the old rule did
    assert verdict(z) == "held" and verdict(est) == "inconclusive"
    assert verdict(stats.mean([0.28, 0.3, 0.32])) == "held"  # a tight effect survives t


def test_wrong_sign_is_not_held():
    est = stats.mean([-0.31, -0.29, -0.33, -0.30])
    assert verdict(est, ">") == "not_held" and verdict(est, "<") == "held"
    assert stats.decide(est.value, est.interval, ">", 0.0)[1].startswith("entirely below")


def test_zero_variance_is_inconclusive_never_exact():
    same = stats.mean([0.969, 0.969, 0.969])
    assert same.se == 0 and verdict(same, ">", 0.5) == "inconclusive"
    flat = stats.bootstrap(5.289, [5.289] * 50, 24, "cells")
    assert verdict(flat) == "inconclusive"
    assert "zero variance" in stats.decide(flat.value, flat.interval, ">", 0.0)[1]
    # two proportions at 0/32: Newcombe's interval has width, straddles 0, so no exact "0 = 0" comparison
    zero = stats.proportion_diff(0, 32, 0, 32)
    assert zero.lo < 0 < zero.hi and verdict(zero) == "inconclusive"


def test_one_run_is_inconclusive():
    assert verdict(stats.single(1.08), ">", 0.01) == "inconclusive"
    assert verdict(stats.mean([1.08]), ">", 0.01) == "inconclusive"
    assert verdict(stats.welch([5.2], [6.3])) == "inconclusive"
    assert stats.decide(1.08, None, ">", 0.01)[1] == "no noise estimate (one run)"


def test_paired_interval_is_narrower_on_correlated_arms():
    """Both arms see the same seeds; a large seed effect shared by both hides a small treatment effect from an
    unpaired comparison, not from the paired one."""
    rng = np.random.default_rng(0)
    seed_effect = rng.normal(0, 1.0, 5)
    a = seed_effect + 0.3 + rng.normal(0, 0.02, 5)
    b = seed_effect + rng.normal(0, 0.02, 5)
    p, w = stats.paired(a, b), stats.welch(a, b)
    assert math.isclose(p.value, w.value)
    assert (p.hi - p.lo) < 0.1 * (w.hi - w.lo)
    assert verdict(p) == "held" and verdict(w) == "inconclusive"
    assert p.paired and p.method == "paired t" and p.df == 4


def test_multiplicity_best_of_k():
    """Ten candidates with no effect: the best one's 90% interval excludes 0 far more often than 5% of the time;
    Bonferroni over the ten keeps it near 5%."""
    rng = np.random.default_rng(1)
    naive = corrected = 0
    sims = 400
    for _ in range(sims):
        data = rng.normal(0, 1, (10, 12))
        best = data[np.argmax(data.mean(1))]
        naive += verdict(stats.mean(best, "items")) == "held"
        corrected += verdict(stats.mean(best, "items", candidates=10)) == "held"
    assert naive / sims > 0.25 and corrected / sims < 0.08
    est = stats.mean([1.0, 2.0, 3.0], candidates=4)
    assert est.candidates == 4 and math.isclose(est.level, 1 - 0.1 / 4)


def test_references():
    """Each interval against scipy or a textbook value."""
    a, b = [1.2, 2.5, 3.1, 4.0, 2.2], [0.9, 2.6, 2.0, 3.1, 1.5]
    ref = sp.ttest_rel(a, b).confidence_interval(0.9)
    p = stats.paired(a, b)
    assert math.isclose(p.lo, ref.low) and math.isclose(p.hi, ref.high)
    x, y = [1.0, 2.0, 4.0, 3.5], [0.1, 0.4, 0.2, 0.9, 0.3, 0.6]
    ref = sp.ttest_ind(x, y, equal_var=False).confidence_interval(0.9)
    w = stats.welch(x, y)
    assert math.isclose(w.lo, ref.low) and math.isclose(w.hi, ref.high)
    lo, hi = stats.wilson(0, 10, 0.95)  # Wilson 1927; Newcombe (1998) table I: 0/10 -> [0, 0.2775]
    assert lo == 0 and math.isclose(hi, 0.2775, abs_tol=1e-4)
    # Newcombe (1998) method 10, example (56/70 - 48/80): 95% [0.0524, 0.3339]
    d = stats.proportion_diff(56, 70, 48, 80, level=0.95)
    assert math.isclose(d.lo, 0.0524, abs_tol=1e-4) and math.isclose(d.hi, 0.3339, abs_tol=1e-4)
    r = stats.correlation(0.5, 28)
    assert math.isclose(r.lo, math.tanh(math.atanh(0.5) - sp.norm.ppf(0.95) / 5))
    xs, ys = np.arange(8.0), np.array([0.1, 0.5, 0.7, 1.4, 1.5, 2.2, 2.4, 2.9])
    s, lr = stats.slope(xs, ys), sp.linregress(xs, ys)
    assert math.isclose(s.value, lr.slope) and math.isclose(s.se, lr.stderr)
    phi = stats.dispersion(64.0, 32)  # chi2 = 2 x dof: overdispersion 2, interval from the chi2(32) quantiles
    assert phi.value == 2 and math.isclose(phi.lo, 64 / sp.chi2.ppf(0.95, 32)) and phi.hi > 2 > phi.lo


def test_within_margin_and_every_competitor():
    near = stats.mean([0.249, 0.250, 0.251])
    assert verdict(near, "within", 0.2546, 0.01) == "held"
    assert verdict(near, "within", 0.30, 0.01) == "not_held"
    assert stats.all_of(["held", "held"]) == "held" and stats.all_of(["held", "inconclusive"]) == "inconclusive"
    assert stats.all_of(["held", "not_held"]) == "not_held"
    c = stats.claim("lowest", "q", "m", stats.mean([0.2, 0.25, 0.3]), expect=">", why="w", n_seeds=3, n_items=None,
                    versus={"a": stats.mean([0.2, 0.25, 0.3]), "b": stats.mean([-0.1, 0.1, 0.3])})
    assert c.verdict == "inconclusive" and [x["verdict"] for x in c.comparisons] == ["held", "inconclusive"]


def test_schema_recomputes_the_verdict():
    """A verdict written by hand that the interval does not support does not load."""
    c = stats.claim("x", "q", "m", stats.mean([0.1, 0.3, 0.5]), expect=">", why="w", n_seeds=3, n_items=None)
    doc = {"schema": 2, "paper": "toy", "command": "c", "commit": "abc", "machine": {"cores": 2, "device": "cpu"},
           "date": "d", "wall_s": 1.0, "figures": [], "claims": [vars(c) | {"verdict": "held"}]}
    with pytest.raises(ValueError, match=r"claims\[0\]\.verdict: 'held' does not follow .* gives 'inconclusive'"):
        validate(doc)
    doc["claims"][0]["verdict"] = "inconclusive"
    validate(doc)
    doc["claims"][0].update(verdict="inconclusive", degenerate="never fires", interval=[0.2, 0.4])
    validate(doc)  # a degenerate measurement is inconclusive whatever its interval
