"""Fit a scaling law (``sweeps/laws.py``; a paper's own in ``lightning_modules/<paper>/law.py``) to a collected
sweep table, report it, plot it.

The fit: rows whose target is ≤ 0 are dropped (and reported: a log law cannot hold them); then the law's objective
(``Law.objective``: a Huber loss on log residuals unless a law says otherwise) is minimised by L-BFGS from every
point of the law's init grid (a grid over every constant, as the Chinchilla refits do) and from the closed-form
OLS start where the law has one. All starts run at once (a batched L-BFGS over ``torch.func.vmap``, each start an
independent problem), the ``top_k`` best are polished with SciPy's L-BFGS-B, and the lowest objective wins, ties
broken by the parameters themselves: the answer depends neither on the order of the starts nor on thread count.
Parameters the data cannot identify (the exponent of an input with a single value) are frozen. Reported: the
constants, R² of log target on the fitted rows, and the relative error on held-out corners (the rows at the
largest N and D, left out of the fit).

CLI (collects multirun dirs or reads a CSV; writes <out>.csv, <out>_fit.json, <out>_fit.md, <out>.png); the law's
paper may give its own table, report, markdown and plot (``sweeps.laws.Study``), else the generic ones here::

    python -m sweeps.fit logs/multirun/qat_law_tiny logs/multirun/qat_law_tiny_decomp --law qat_delta \\
        --out sweeps/results/qat_law_tiny
    python -m sweeps.fit table.csv --law chinchilla --where precision=fp
    python -m sweeps.fit logs/multirun/qat_law_tiny_seeds --law qat_delta --bootstrap 1000 \\
        --out sweeps/results/qat_law_tiny_seeds

``--bootstrap B`` (several seeds per cell): the law is fitted to the cell means over seeds and refitted on B
resamples of each cell's seeds; every exponent gets a bootstrap SE and a 90% percentile interval (``--level``).

Identifiability (reported with every fit): the Jacobian of the log predictions with respect to the free constants
at the fit, columns scaled to unit norm, is the square root of the Gauss–Newton Hessian of the log-residual
objective; a singular value below ``FLAT`` times the largest is a flat direction (moving along it changes no
prediction to first order), and the constants with a weight ≥ ``FLAT_WEIGHT`` in it are *not identified* (e.g. A,
α and E of an N term fitted on two values of N: any pair of levels is met by a one-parameter family). A bootstrap
interval of zero width (every resample on the same value: the refit never moved from its warm start) marks its
constant the same way. :func:`identified_verdict` turns any claim resting on such a constant into
``inconclusive``: it is never called held (or not held).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from sweeps.laws import Law, get_law, law_class, study_for


@dataclass
class FitResult:
    law: str
    constants: dict[str, float]
    theta: list[float]
    r2_log: float
    n_fit: int
    dropped: list[dict] = field(default_factory=list)
    heldout: list[dict] = field(default_factory=list)
    heldout_rel_err: float | None = None
    objective: float = float("nan")
    frozen: dict[str, float] = field(default_factory=dict)
    heldout_max_rel_err: float | None = None  # the max absolute relative error beside the mean (InfoLaw's metric)
    fit_rel_err: float | None = None          # mean and max absolute relative error on the fitted rows
    fit_max_rel_err: float | None = None
    unidentified: list[str] = field(default_factory=list)     # constants the fitted rows do not pin down
    flat_directions: list[dict] = field(default_factory=list)  # {"ratio": s_i/s_max, "weights": {param: v_p}}


FLAT = 1e-6         # a scaled singular value below FLAT x the largest: a flat direction
FLAT_WEIGHT = 0.01  # a constant with at least this weight in a flat (unit) direction is not identified
ZERO_WIDTH = 1e-9   # a bootstrap interval narrower than this (relative to max(1, |estimate|)) has zero width


def identifiability(law: Law, theta, X: dict, frozen: dict) -> tuple[list[str], list[dict]]:
    """(constants not identified, flat directions) at ``theta`` on the rows ``X`` (module docstring)."""
    free = [i for i, p in enumerate(law.params) if p not in frozen]
    base = torch.as_tensor(np.asarray(theta, dtype=np.float64))
    idx = torch.as_tensor(free)
    J = torch.autograd.functional.jacobian(lambda z: law.log_predict(base.index_put((idx,), z), X), base[idx])
    J = torch.nan_to_num(J.reshape(-1, len(free)))
    norms = J.norm(dim=0)
    dead = [law.params[free[j]] for j in range(len(free)) if not norms[j] > 0]  # moves no prediction at all
    live = [j for j in range(len(free)) if norms[j] > 0]
    flat = [{"ratio": 0.0, "weights": {p: 1.0}} for p in dead]
    if live:
        _, S, Vt = torch.linalg.svd(J[:, live] / norms[live], full_matrices=False)
        for s_i, v in zip(S, Vt):
            if s_i < FLAT * S[0]:
                flat.append({"ratio": float(s_i / S[0]),
                             "weights": {law.params[free[j]]: float(w) for j, w in zip(live, v) if abs(w) >= FLAT_WEIGHT}})
    unidentified = [p for p in law.params if any(p in d["weights"] for d in flat)]
    return unidentified, flat


def zero_width(interval: dict) -> bool:
    """A bootstrap interval (estimate, lo, hi) every resample of which landed on the same value."""
    return interval["hi"] - interval["lo"] <= ZERO_WIDTH * max(1.0, abs(interval["estimate"]))


def identified_verdict(verdict, needs, unidentified) -> str | bool | None:
    """``verdict`` unless a constant in ``needs`` is not identified by the fit (``benchmarks/stats.py`` decides)."""
    from benchmarks.stats import identified_verdict as decide_identified

    return decide_identified(verdict, needs, unidentified)


def _minimise(law: Law, X: dict, logy: torch.Tensor, x0: np.ndarray, free: np.ndarray, delta: float):
    """SciPy L-BFGS-B on the free parameters from ``x0``; returns (theta, objective)."""
    from scipy.optimize import minimize

    base = torch.as_tensor(x0, dtype=torch.float64)
    idx = torch.as_tensor(np.flatnonzero(free))

    def objective(z):
        zt = torch.as_tensor(z, dtype=torch.float64).requires_grad_(True)
        loss = law.objective(base.index_put((idx,), zt), X, logy, delta)
        loss.backward()
        return float(loss.detach()), zt.grad.numpy().copy()

    res = minimize(objective, x0[free], jac=True, method="L-BFGS-B",
                   options={"maxiter": 2000, **getattr(law, "polish_options", {})})
    theta = x0.copy()
    theta[free] = res.x
    return theta, float(res.fun)


def _lbfgs_all(law: Law, X: dict, logy: torch.Tensor, starts: np.ndarray, free: np.ndarray, delta: float,
               iters: int = 200, history: int = 10, ftol: float = 1e-12, gtol: float = 1e-10):
    """L-BFGS from every row of ``starts`` at once (independent problems, one ``vmap``-ed objective per step over
    the rows still running): two-loop recursion and a backtracking Armijo line search per row; frozen parameters
    never move. A row stops when its line search fails or its objective or gradient stops moving.
    Returns (thetas [K, P], objectives [K])."""
    from torch.func import grad_and_value, vmap

    both = vmap(grad_and_value(lambda th: law.objective(th, X, logy, delta)))
    mask = torch.as_tensor(free, dtype=torch.float64)

    def grad_value(Z):
        g, f = both(Z)
        return torch.nan_to_num(g * mask, nan=0.0), f

    def dot(a, b):
        return (a * b).sum(-1)

    Z = torch.as_tensor(starts, dtype=torch.float64).clone()
    g, f = grad_value(Z)
    Z_all, f_all = Z.clone(), f.clone()
    rows = torch.nonzero(torch.isfinite(f)).flatten()  # the rows still running; Z, f, g, hist hold only these
    Z, f, g = Z[rows], f[rows], g[rows]
    hist: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (s, y, rho), newest last
    for _ in range(iters):
        if len(rows) == 0:
            break
        q, alphas = g.clone(), []
        for s_, y_, rho in reversed(hist):
            a = rho * dot(s_, q)
            q -= a[:, None] * y_
            alphas.append(a)
        if hist:
            s_, y_, _ = hist[-1]
            sy, yy = dot(s_, y_), dot(y_, y_)
            q *= torch.where((sy > 0) & (yy > 0), sy / yy.clamp_min(1e-300), 1.0)[:, None]
        for (s_, y_, rho), a in zip(hist, reversed(alphas)):
            q += (a - rho * dot(y_, q))[:, None] * s_
        d, slope = -q, -dot(q, g)
        bad = ~(slope < 0)  # not a descent direction: steepest descent instead
        d[bad], slope[bad] = -g[bad], -dot(g, g)[bad]
        t = torch.ones_like(f) if hist else 1.0 / g.abs().sum(-1).clamp_min(1.0)  # a cautious first step
        accepted, g_new, f_new = torch.zeros_like(f, dtype=torch.bool), g.clone(), f.clone()
        for _ in range(50):  # halve each row's step until Armijo holds
            g_try, f_try = grad_value(Z + t[:, None] * d)
            new = ~accepted & torch.isfinite(f_try) & (f_try <= f + 1e-4 * t * slope)
            g_new[new], f_new[new] = g_try[new], f_try[new]
            accepted |= new
            if bool(accepted.all()):
                break
            t = torch.where(accepted, t, t / 2)
        step = torch.where(accepted, t, torch.zeros_like(t))[:, None] * d
        y = torch.where(accepted[:, None], g_new - g, torch.zeros_like(g))
        sy = dot(step, y)
        hist = [*hist, (step, y, torch.where(sy > 1e-300, 1.0 / sy.clamp_min(1e-300), torch.zeros_like(sy)))][-history:]
        keep = accepted & (f - f_new > ftol * f.abs()) & (g_new.abs().amax(-1) > gtol)
        Z = torch.where(accepted[:, None], Z + step, Z)
        f, g = torch.where(accepted, f_new, f), torch.where(accepted[:, None], g_new, g)
        Z_all[rows], f_all[rows] = Z, f
        if not bool(keep.all()):
            rows, Z, f, g = rows[keep], Z[keep], f[keep], g[keep]
            hist = [(s_[keep], y_[keep], rho[keep]) for s_, y_, rho in hist]
    return Z_all.numpy(), f_all.numpy()


def _best(thetas: np.ndarray, objectives: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` lowest finite objectives; ties broken by the parameters, so row order never matters."""
    finite = np.flatnonzero(np.isfinite(objectives))
    keys = [thetas[finite, j] for j in reversed(range(thetas.shape[1]))] + [objectives[finite]]
    return finite[np.lexsort(keys)[:k]]


def heldout_corner(df: pd.DataFrame, inputs=("N", "D")) -> np.ndarray:
    """Rows at the largest value of every input in ``inputs`` (the extrapolation corner)."""
    mask = np.ones(len(df), dtype=bool)
    for col in inputs:
        if col in df:
            mask &= df[col].to_numpy() == df[col].max()
    return mask


def holdout_mask(df: pd.DataFrame, holdout, corner=("N", "D")) -> np.ndarray:
    """Rows to hold out: ``"corner"`` (the largest value of every column in ``corner``: a law's ``corner``), ``"col=value"`` (rows where the column equals the value;
    ``col=max`` / ``col=min`` for its extreme), or a list of these (their union)."""
    if isinstance(holdout, str):
        holdout = [holdout]
    mask = np.zeros(len(df), dtype=bool)
    for spec in holdout:
        if spec == "corner":
            mask |= heldout_corner(df, corner)
            continue
        col, sep, val = spec.partition("=")
        if not sep or col not in df:
            raise ValueError(f"holdout {spec!r}: write 'corner' or '<column>=<value>' with a column of the table "
                             f"({', '.join(map(str, df.columns))})")
        x = df[col]
        if val in ("max", "min"):
            mask |= (x == getattr(x, val)()).to_numpy()
        elif pd.api.types.is_numeric_dtype(x):
            mask |= np.isclose(x.to_numpy(dtype=np.float64), float(val), rtol=1e-9, atol=0.0)
        else:
            mask |= (x.astype(str) == val).to_numpy()
    return mask


def rel_errors(law: Law, theta, df: pd.DataFrame) -> np.ndarray:
    """|predicted − observed| / |observed| per row; NaN where the observed target is 0 (a count law's rows with
    k = 0 stay in its fit, but a relative error has no meaning there)."""
    p = law.predict(theta, {c: df[c].to_numpy(dtype=np.float64) for c in law.inputs})
    obs = df[law.target].to_numpy(dtype=np.float64)
    return np.abs(p - obs) / np.where(obs != 0, np.abs(obs), np.nan)


def mean_max(rel: np.ndarray) -> tuple[float | None, float | None]:
    """Mean and max of the defined relative errors (None when no row has one)."""
    rel = rel[np.isfinite(rel)]
    return (float(rel.mean()), float(rel.max())) if rel.size else (None, None)


def fit_law(law: Law | str, df: pd.DataFrame, huber_delta: float | None = None, holdout: np.ndarray | str | None = "corner",
            top_k: int = 8, init: np.ndarray | None = None, check: bool = True) -> FitResult:
    """The fit (module docstring); ``check=False`` skips the identifiability check (bootstrap refits)."""
    law = get_law(law) if isinstance(law, str) else law
    missing = [c for c in (*law.inputs, *law.counts, law.target) if c not in df]
    if missing:
        raise ValueError(f"the table has no column(s) {missing} that law {law.name!r} needs")
    df = df.dropna(subset=[*law.inputs, *law.counts, law.target]).reset_index(drop=True)
    bad = df[law.target].to_numpy() <= 0
    if law.counts:  # a likelihood on counts holds rows with nothing right
        bad[:] = False
    dropped = df[bad].to_dict("records")
    df = df[~bad].reset_index(drop=True)
    law.check({c: df[c].to_numpy(dtype=np.float64) for c in law.inputs})
    hold = np.zeros(len(df), dtype=bool)
    if isinstance(holdout, str) or (isinstance(holdout, (list, tuple)) and holdout and isinstance(holdout[0], str)):
        hold = holdout_mask(df, holdout, law.corner)
    elif holdout is not None:
        hold = np.asarray(holdout, dtype=bool)[~bad]
    if (~hold).sum() < len(law.params) + 1:  # too few rows to hold any out
        hold[:] = False
    train = df[~hold]
    if len(train) < len(law.params) - len(law.frozen({c: train[c].to_numpy() for c in law.inputs})) + 1:
        raise ValueError(f"{law.name}: {len(train)} usable rows (target > 0) cannot fit {len(law.params)} parameters")
    Xn = {c: train[c].to_numpy(dtype=np.float64) for c in (*law.inputs, *law.counts)}
    y = train[law.target].to_numpy(dtype=np.float64)
    X = {c: torch.tensor(v) for c, v in Xn.items()}
    logy = torch.log(torch.tensor(y))
    delta = law.huber_delta if huber_delta is None else huber_delta

    frozen = law.frozen(Xn)
    free = np.array([p not in frozen for p in law.params])
    lin = law.linear_init(Xn, y)
    extra = ([] if lin is None else [np.asarray(lin, dtype=np.float64)]) + \
        ([] if init is None else [np.asarray(init, dtype=np.float64)])
    if init is not None and top_k == 0:  # a warm start (bootstrap refits): from init (and the OLS start) only
        starts, top_k = np.array(extra), len(extra)
    else:
        starts = np.array([np.asarray(g, dtype=np.float64) for g in law.init_grid()] + extra)
    for p, v in frozen.items():
        starts[:, law.params.index(p)] = v
    thetas, objectives = _lbfgs_all(law, X, logy, starts, free, delta)
    polished = [_minimise(law, X, logy, thetas[i], free, delta) for i in _best(thetas, objectives, top_k)]
    if not polished:
        raise ValueError(f"{law.name}: the objective is not finite at any start; check the table's {law.inputs}")
    thetas = np.array([t for t, _ in polished])
    i = _best(thetas, np.array([o for _, o in polished]), 1)[0]
    theta, obj = thetas[i], polished[i][1]
    pos = y > 0  # every row, except count rows with k = 0
    pred = np.log(law.predict(theta, Xn))[pos]
    ly = np.log(y[pos])
    ss_res, ss_tot = float(((ly - pred) ** 2).sum()), float(((ly - ly.mean()) ** 2).sum())
    result = FitResult(law=law.name, constants=law.constants(theta), theta=[float(t) for t in theta],
                       r2_log=1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"), n_fit=len(train),
                       dropped=dropped, objective=obj, frozen=frozen)
    result.fit_rel_err, result.fit_max_rel_err = mean_max(rel_errors(law, theta, train))
    if check:
        result.unidentified, result.flat_directions = identifiability(law, theta, X, frozen)
    if hold.any():
        test = df[hold]
        p = law.predict(theta, {c: test[c].to_numpy(dtype=np.float64) for c in law.inputs})
        obs = test[law.target].to_numpy(dtype=np.float64)
        rel = rel_errors(law, theta, test)
        result.heldout = [{**{c: float(r[c]) for c in law.inputs}, "observed": float(o), "predicted": float(q),
                           "rel_err": float(e)} for (_, r), o, q, e in zip(test.iterrows(), obs, p, rel)]
        result.heldout_rel_err, result.heldout_max_rel_err = mean_max(rel)
    return result


# --- uncertainty: cell means over seeds and the bootstrap --------------------------------------------------
def cell_means(df: pd.DataFrame, law: Law | str, by: str = "seed", keys: tuple[str, ...] = ()) -> pd.DataFrame:
    """One row per cell (the law's inputs + ``keys``): the target's mean over the ``by`` replicates, its standard
    error (NaN with one replicate) and the replicate count."""
    law = get_law(law) if isinstance(law, str) else law
    cols = [*law.inputs, *keys]
    g = df.dropna(subset=[law.target]).groupby(cols)[law.target]
    out = g.agg(["mean", "std", "count"]).reset_index()
    return out.rename(columns={"mean": law.target}).assign(
        se=lambda t: t["std"] / np.sqrt(t["count"]), n=lambda t: t["count"]).drop(columns=["std", "count"])


def bootstrap_fit(law: Law | str, df: pd.DataFrame, n_boot: int = 1000, by: str = "seed", level: float = 0.9,
                  seed: int = 0, huber_delta: float | None = None, keys: tuple[str, ...] = ()) -> dict:
    """Fit the law to the cell means over ``by`` replicates, then refit ``n_boot`` times with each cell's replicates
    resampled with replacement (a stratified bootstrap over seeds: every cell keeps its count). Per parameter: the
    estimate, the bootstrap SE and the ``level`` percentile interval. Resamples whose fit fails are counted."""
    law = get_law(law) if isinstance(law, str) else law
    if by not in df:
        raise ValueError(f"bootstrap over {by!r}: the table has no such column (choose the replicate column, e.g. seed)")
    df = df.dropna(subset=[law.target]).reset_index(drop=True)
    cells = [c.index.to_numpy() for _, c in df.groupby([*law.inputs, *keys])]
    if max(len(c) for c in cells) < 2:
        raise ValueError(f"bootstrap over {by!r}: every cell has one replicate; run the sweep with several seeds")
    fit = lambda d, **kw: fit_law(law, cell_means(d, law, by, keys), huber_delta, holdout=None, **kw)
    full = fit(df)
    rng = np.random.default_rng(seed)
    thetas, failed = [], 0
    for _ in range(n_boot):
        idx = np.concatenate([rng.choice(c, size=len(c)) for c in cells])
        try:  # start from the full fit (and the law's closed form): the resample is a small perturbation
            thetas.append(fit(df.iloc[idx], top_k=0, init=np.asarray(full.theta), check=False).theta)
        except ValueError:
            failed += 1
    thetas = np.asarray(thetas)
    a = (1.0 - level) / 2.0
    params = {p: {"estimate": full.theta[i], "se": float(thetas[:, i].std(ddof=1)),
                  "lo": float(np.quantile(thetas[:, i], a)), "hi": float(np.quantile(thetas[:, i], 1.0 - a))}
              for i, p in enumerate(law.params) if p not in full.frozen}
    return {"by": by, "level": level, "n_boot": n_boot, "failed": failed, "n_cells": len(cells),
            "replicates": int(df[by].nunique()), "fit": asdict(full), "params": params,
            "unidentified": _boot_unidentified(full, params)}


def case_bootstrap_fit(law: Law | str, df: pd.DataFrame, n_boot: int = 1000, level: float = 0.9, seed: int = 0,
                       huber_delta: float | None = None, holdout=None) -> dict:
    """``bootstrap_fit`` for a sweep with one seed per cell: refit on ``n_boot`` resamples of the fitted rows (cells)
    with replacement, each from the full fit; per parameter the estimate, SE and ``level`` percentile interval."""
    law = get_law(law) if isinstance(law, str) else law
    full = fit_law(law, df, huber_delta, holdout=holdout)
    held = {tuple(r[c] for c in law.inputs) for r in full.heldout}
    rows = df.dropna(subset=[*law.inputs, law.target])
    kept = np.array([tuple(r) not in held for r in rows[list(law.inputs)].itertuples(index=False)], dtype=bool)
    rows = rows[(rows[law.target].to_numpy() > 0) & kept]
    rng = np.random.default_rng(seed)
    thetas, failed = [], 0
    for _ in range(n_boot):
        try:
            thetas.append(fit_law(law, rows.iloc[rng.integers(0, len(rows), len(rows))], huber_delta, holdout=None,
                                  top_k=0, init=np.asarray(full.theta), check=False).theta)
        except ValueError:
            failed += 1
    thetas = np.asarray(thetas)
    a = (1.0 - level) / 2.0
    params = {p: {"estimate": full.theta[i], "se": float(thetas[:, i].std(ddof=1)),
                  "lo": float(np.quantile(thetas[:, i], a)), "hi": float(np.quantile(thetas[:, i], 1.0 - a))}
              for i, p in enumerate(law.params) if p not in full.frozen}
    return {"by": "cell", "level": level, "n_boot": n_boot, "failed": failed, "n_cells": len(rows), "replicates": len(rows),
            "fit": asdict(full), "params": params, "unidentified": _boot_unidentified(full, params)}


def _boot_unidentified(full: FitResult, params: dict) -> list[str]:
    """The full fit's unidentified constants and those whose bootstrap interval has zero width."""
    for v in params.values():
        v["zero_width"] = zero_width(v)
    return list(full.unidentified) + [p for p, v in params.items() if v["zero_width"] and p not in full.unidentified]


def sign_verdict(lo: float, hi: float, sign: int) -> str:
    """held: the interval excludes 0 on the expected side; not_held: on the other; inconclusive: it contains 0 (or
    has no width). The rule is ``benchmarks/stats.py``'s, the one place a verdict is computed."""
    from benchmarks.stats import decide

    return decide(0.5 * (lo + hi), [lo, hi], ">" if sign > 0 else "<", 0.0)[0]


def markdown(report: dict) -> str:
    lines = ["| fit | constants | R² (log) | rows | held-out rel. err | dropped (target ≤ 0) |", "|---|---|---|---|---|---|"]
    for name, f in report["fits"].items():
        consts = ", ".join(f"{k}={v:.4g}" for k, v in f["constants"].items() if not k.startswith("log_"))
        if f["frozen"]:
            consts += " (frozen: " + ", ".join(f["frozen"]) + ")"
        if f.get("unidentified"):
            consts += " (not identified: " + ", ".join(f["unidentified"]) + ")"
        held = "—" if f["heldout_rel_err"] is None else f"{100 * f['heldout_rel_err']:.1f}% ({len(f['heldout'])} rows)"
        if f.get("heldout_max_rel_err") is not None and law_class(f["law"]).heldout_max:  # mean and max
            held = f"{100 * f['heldout_rel_err']:.2f}% mean, {100 * f['heldout_max_rel_err']:.2f}% max ({len(f['heldout'])} rows)"
        lines.append(f"| {name} | {consts} | {f['r2_log']:.3f} | {f['n_fit']} | {held} | {len(f['dropped'])} |")
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | | | |")
    if report.get("bootstrap"):
        lines += ["", "| fit | parameter | estimate | bootstrap SE | interval | resamples (failed) |", "|---|---|---|---|---|---|"]
        for name, b in report["bootstrap"].items():
            lines += [f"| {name} | {p} | {v['estimate']:.4g} | {v['se']:.3g} | {100 * b['level']:.0f}%: "
                      f"[{v['lo']:.4g}, {v['hi']:.4g}]{' (zero width: not identified)' if v.get('zero_width') else ''} | "
                      f"{b['n_boot']} ({b['failed']}) over {b['replicates']} {b['by']}s |"
                      for p, v in b["params"].items() if p != "log_k"]
    if report.get("claims"):
        word = lambda v: "n/a" if v is None else v if isinstance(v, str) else ("yes" if v else "no")
        lines += ["", "| paper's claim | holds here |", "|---|---|"]
        lines += [f"| {k} | {word(v)} |" for k, v in report["claims"].items()]
    return "\n".join(lines) + "\n"


def law_options(table: pd.DataFrame, args) -> dict:
    """The law's constructor options: what its paper's study reads off the table, then ``--option KEY=VALUE``."""
    import yaml

    study = study_for(args.law)
    options = study.options(table, args.law) if study.options else {}
    return {**options, **{k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in args.option)}}


def fit_report(table: pd.DataFrame, args) -> dict:
    """The generic report: ``args.law`` fitted to the table (held-out rows per ``--holdout``), bootstrapped over
    ``--by`` replicates (or over the fitted cells with ``--by cell``) when ``--bootstrap B``."""
    law = get_law(args.law, **law_options(table, args))
    holdout = args.holdout or "corner"
    report = {"fits": {args.law: asdict(fit_law(law, table, args.huber_delta, holdout=holdout))},
              "skipped": {}, "claims": {}, "bootstrap": {}}
    if args.bootstrap and args.by == "cell":  # one seed per cell: resample the cells
        report["bootstrap"][args.law] = case_bootstrap_fit(law, table, args.bootstrap, args.level,
                                                           huber_delta=args.huber_delta, holdout=holdout)
    elif args.bootstrap:
        report["bootstrap"][args.law] = bootstrap_fit(law, table, args.bootstrap, args.by, args.level,
                                                      huber_delta=args.huber_delta)
    return report


def main(argv=None) -> int:
    from sweeps.collect import collect, flat_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="+", help="multirun dirs (collected) or one CSV table")
    ap.add_argument("--law", required=True, help="chinchilla | any law a paper registers (lightning_modules/*/law.py)")
    ap.add_argument("--where", action="append", default=[], help="column=value filters (repeatable)")
    ap.add_argument("--huber-delta", type=float, default=None)
    ap.add_argument("--bootstrap", type=int, default=0, metavar="B",
                    help="refit B times on resampled replicates (--by) per cell: SE and a --level interval per parameter")
    ap.add_argument("--by", default="seed", help="the replicate column the bootstrap resamples (default: seed; "
                    "cell: resample the fitted cells, for a sweep with one seed)")
    ap.add_argument("--level", type=float, default=0.9, help="the bootstrap interval's coverage (default: 0.9)")
    ap.add_argument("--holdout", action="append", default=None,
                    help="rows to hold out: corner (default) | <column>=<value> | <column>=max (repeatable: the union)")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a law option (YAML value), e.g. --option quality=[1,0] --option form=joint (repeatable)")
    ap.add_argument("--out", default=None, help="output prefix: <out>.csv, <out>_fit.json, <out>_fit.md, <out>.png")
    ap.add_argument("--wandb", action="store_true",
                    help="also log the table, constants and plot to a W&B run in the sweep's group (multirun/<dir name>)")
    args = ap.parse_args(argv)
    loggers = []
    if args.wandb:  # the group the sweep's own runs have (callbacks/hydra_summary.run_group)
        from lightning.pytorch.loggers import WandbLogger

        group = f"multirun/{Path(args.sources[0]).name}" if not args.sources[0].endswith(".csv") else None
        loggers.append(WandbLogger(project="paperlab", group=group, job_type="fit-law", name=f"fit-{args.law}",
                                   save_dir=args.out and str(Path(args.out).parent) or "."))
        loggers[0].log_hyperparams(vars(args))

    study = study_for(args.law)
    if len(args.sources) == 1 and args.sources[0].endswith(".csv"):
        table, failures = pd.read_csv(args.sources[0]), []
    else:
        jobs, failures = collect(*args.sources)
        table = study.table(jobs) if study.table else flat_table(jobs)
    for cond in args.where:
        col, val = cond.split("=", 1)
        table = table[table[col].astype(str) == val]
    for f in failures:
        print(f"excluded failed job {f['dir']}: {f['status'][:200]}")
    report = (study.report or fit_report)(table, args)
    report["failed_jobs"] = [{"dir": f["dir"], "status": f["status"]} for f in failures]
    text = (study.markdown or markdown)(report)
    print(text)
    if args.out:
        from sweeps.plot import plot_fit

        png = write_outputs(args.out, table, report, text)
        (study.plot or plot_fit)(table, report, png, args, loggers)
        print(f"wrote {args.out}.csv, {args.out}_fit.json, {args.out}_fit.md, {png}")
    if loggers:
        import wandb

        from lightning_modules.common.dashboard import log_table

        log_table("law/table", table.to_dict("records"), loggers)
        loggers[0].experiment.summary.update({f"{name}/{k}": v for name, f in report.get("fits", {}).items()
                                              for k, v in f["constants"].items()})
        wandb.finish()
    return 0


def write_outputs(out: str | Path, table: pd.DataFrame, report: dict, text: str) -> Path:
    """``<out>.csv`` (the table), ``<out>_fit.json`` and ``<out>_fit.md`` (the report); the path for the plot."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table.to_csv(out.with_name(out.name + ".csv"), index=False)
    out.with_name(out.name + "_fit.json").write_text(json.dumps(report, indent=2, default=float))
    out.with_name(out.name + "_fit.md").write_text(text)
    return out.with_name(out.name + ".png")


if __name__ == "__main__":
    raise SystemExit(main())
