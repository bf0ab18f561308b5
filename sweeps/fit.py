"""Fit a scaling law (``sweeps/laws.py``) to a collected sweep table, report it, plot it.

The fit: rows whose target is ≤ 0 are dropped (and reported: a log law cannot hold them); a closed-form OLS
start where the law has one; then a Huber loss on log residuals minimised by L-BFGS from that start and from the
best ``top_k`` points of the law's init grid; the lowest objective wins. Parameters the data cannot identify
(the exponent of an input with a single value) are frozen. Reported: the constants, R² of log target on the
fitted rows, and the relative error on held-out corners (the rows at the largest N and D, left out of the fit).

CLI (collects multirun dirs or reads a CSV; writes <out>.csv, <out>_fit.json, <out>_fit.md, <out>.png)::

    python -m sweeps.fit logs/multirun/qat_law_tiny logs/multirun/qat_law_tiny_decomp --law qat_delta \\
        --out sweeps/results/qat_law_tiny
    python -m sweeps.fit table.csv --law chinchilla --where precision=fp
    python -m sweeps.fit logs/multirun/qat_law_tiny_seeds --bootstrap 1000 --out sweeps/results/qat_law_tiny_seeds

``--bootstrap B`` (several seeds per cell): the law is fitted to the cell means over seeds and refitted on B
resamples of each cell's seeds; every exponent gets a bootstrap SE and a 90% percentile interval (``--level``).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from sweeps.laws import Law, get_law


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


def _huber(r: torch.Tensor, delta: float) -> torch.Tensor:
    a = r.abs()
    return torch.where(a <= delta, 0.5 * r ** 2, delta * (a - 0.5 * delta)).sum()


def _minimise(law: Law, X: dict, logy: torch.Tensor, x0: np.ndarray, free: np.ndarray, delta: float):
    from scipy.optimize import minimize

    base = torch.as_tensor(x0, dtype=torch.float64)
    idx = torch.as_tensor(np.flatnonzero(free))

    def objective(z):
        theta = base.clone()
        zt = torch.as_tensor(z, dtype=torch.float64).requires_grad_(True)
        theta = theta.index_put((idx,), zt)
        loss = _huber(law.log_predict(theta, X) - logy, delta)
        loss.backward()
        return float(loss.detach()), zt.grad.numpy().copy()

    res = minimize(objective, x0[free], jac=True, method="L-BFGS-B", options={"maxiter": 2000})
    theta = x0.copy()
    theta[free] = res.x
    return theta, float(res.fun)


def heldout_corner(df: pd.DataFrame, inputs=("N", "D")) -> np.ndarray:
    """Rows at the largest value of every input in ``inputs`` (the extrapolation corner)."""
    mask = np.ones(len(df), dtype=bool)
    for col in inputs:
        if col in df:
            mask &= df[col].to_numpy() == df[col].max()
    return mask


def fit_law(law: Law | str, df: pd.DataFrame, huber_delta: float | None = None, holdout: np.ndarray | str | None = "corner",
            top_k: int = 8, init: np.ndarray | None = None) -> FitResult:
    law = get_law(law) if isinstance(law, str) else law
    missing = [c for c in (*law.inputs, law.target) if c not in df]
    if missing:
        raise ValueError(f"the table has no column(s) {missing} that law {law.name!r} needs")
    df = df.dropna(subset=[*law.inputs, law.target]).reset_index(drop=True)
    bad = df[law.target].to_numpy() <= 0
    dropped = df[bad].to_dict("records")
    df = df[~bad].reset_index(drop=True)
    hold = np.zeros(len(df), dtype=bool)
    if isinstance(holdout, str) and holdout == "corner":
        hold = heldout_corner(df)
    elif holdout is not None and not isinstance(holdout, str):
        hold = np.asarray(holdout, dtype=bool)[~bad]
    if (~hold).sum() < len(law.params) + 1:  # too few rows to hold any out
        hold[:] = False
    train = df[~hold]
    if len(train) < len(law.params) - len(law.frozen({c: train[c].to_numpy() for c in law.inputs})) + 1:
        raise ValueError(f"{law.name}: {len(train)} usable rows (target > 0) cannot fit {len(law.params)} parameters")
    Xn = {c: train[c].to_numpy(dtype=np.float64) for c in law.inputs}
    y = train[law.target].to_numpy(dtype=np.float64)
    X = {c: torch.tensor(v) for c, v in Xn.items()}
    logy = torch.log(torch.tensor(y))
    delta = law.huber_delta if huber_delta is None else huber_delta

    frozen = law.frozen(Xn)
    free = np.array([p not in frozen for p in law.params])
    starts = [] if init is None else [np.asarray(init, dtype=np.float64)]
    lin = law.linear_init(Xn, y)
    if lin is not None:
        starts.append(lin)
    grid = law.init_grid()
    with torch.no_grad():  # rank the grid by its objective and start L-BFGS from the best few
        scores = [float(_huber(law.log_predict(torch.as_tensor(g), X) - logy, delta)) for g in grid]
    starts += [grid[i] for i in np.argsort(scores)[:top_k]]
    best = None
    for x0 in starts:
        x0 = np.asarray(x0, dtype=np.float64).copy()
        for p, v in frozen.items():
            x0[law.params.index(p)] = v
        theta, obj = _minimise(law, X, logy, x0, free, delta)
        if np.isfinite(obj) and (best is None or obj < best[1]):
            best = (theta, obj)
    theta, obj = best
    pred = np.log(law.predict(theta, Xn))
    ly = np.log(y)
    ss_res, ss_tot = float(((ly - pred) ** 2).sum()), float(((ly - ly.mean()) ** 2).sum())
    result = FitResult(law=law.name, constants=law.constants(theta), theta=[float(t) for t in theta],
                       r2_log=1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"), n_fit=len(train),
                       dropped=dropped, objective=obj, frozen=frozen)
    if hold.any():
        test = df[hold]
        p = law.predict(theta, {c: test[c].to_numpy(dtype=np.float64) for c in law.inputs})
        obs = test[law.target].to_numpy(dtype=np.float64)
        rel = np.abs(p - obs) / np.abs(obs)
        result.heldout = [{**{c: float(r[c]) for c in law.inputs}, "observed": float(o), "predicted": float(q),
                           "rel_err": float(e)} for (_, r), o, q, e in zip(test.iterrows(), obs, p, rel)]
        result.heldout_rel_err = float(rel.mean())
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
            thetas.append(fit(df.iloc[idx], top_k=0, init=np.asarray(full.theta)).theta)
        except ValueError:
            failed += 1
    thetas = np.asarray(thetas)
    a = (1.0 - level) / 2.0
    params = {p: {"estimate": full.theta[i], "se": float(thetas[:, i].std(ddof=1)),
                  "lo": float(np.quantile(thetas[:, i], a)), "hi": float(np.quantile(thetas[:, i], 1.0 - a))}
              for i, p in enumerate(law.params) if p not in full.frozen}
    return {"by": by, "level": level, "n_boot": n_boot, "failed": failed, "n_cells": len(cells),
            "replicates": int(df[by].nunique()), "fit": asdict(full), "params": params}


def sign_verdict(lo: float, hi: float, sign: int) -> str:
    """held: the interval excludes 0 on the expected side; not_held: on the other; inconclusive: it contains 0."""
    if lo > 0 or hi < 0:
        return "held" if (lo > 0) == (sign > 0) else "not_held"
    return "inconclusive"


# --- the QAT-law report ------------------------------------------------------------------------------------
# the paper's signs of the δ law's exponents: δ = k·D^γ_D·(log₂G)^γ_G / N^γ_N with every γ > 0
QAT_SIGNS = (("dδ/dN < 0", "gamma_N", 1), ("dδ/dD > 0", "gamma_D", 1), ("dδ/dG > 0", "gamma_G", 1))


def qat_report(table: pd.DataFrame, huber_delta: float | None = None, n_boot: int = 0, by: str = "seed",
               level: float = 0.9) -> dict:
    """δ fits per precision, the Chinchilla fit of the full-precision rows, and the paper's sign claims; with
    ``n_boot`` > 0 and several ``by`` replicates, each δ law is also bootstrapped over them (``bootstrap_fit``) and
    the signs are judged by their ``level`` intervals."""
    out: dict = {"fits": {}, "skipped": {}, "claims": {}, "bootstrap": {}}
    rows = table[table["precision"] != "fp"]
    for prec, sub in rows.groupby("precision"):
        sub = sub.rename(columns={"group_size": "G"})
        try:
            out["fits"][prec] = asdict(fit_law("qat_delta", sub, huber_delta))
        except ValueError as err:
            out["skipped"][prec] = str(err)
        if n_boot and by in sub and sub[by].nunique() > 1:
            try:
                out["bootstrap"][prec] = bootstrap_fit("qat_delta", sub, n_boot, by, level, huber_delta=huber_delta)
            except ValueError as err:
                out["skipped"][f"{prec} (bootstrap)"] = str(err)
    fp = table[table["precision"] == "fp"].drop_duplicates(subset=["N", "D", "seed"])
    if fp["N"].nunique() >= 2 and fp["D"].nunique() >= 2 and len(fp) >= 6:
        try:
            out["fits"]["fp (chinchilla)"] = asdict(fit_law("chinchilla", fp, huber_delta))
        except ValueError as err:
            out["skipped"]["fp (chinchilla)"] = str(err)
    else:
        out["skipped"]["fp (chinchilla)"] = f"{len(fp)} full-precision cells: the Chinchilla part needs >= 6 over >= 2 N and 2 D"
    fits = out["fits"]
    if "w4a4" in fits:
        c = fits["w4a4"]["constants"]
        fr = fits["w4a4"]["frozen"]
        boot = out["bootstrap"].get("w4a4", {}).get("params", {})
        for claim, param, sign in QAT_SIGNS:
            if param in boot:  # the interval decides: held / not_held / inconclusive
                out["claims"][claim] = sign_verdict(boot[param]["lo"], boot[param]["hi"], sign)
            else:
                out["claims"][claim] = None if param in fr else bool(sign * c[param] > 0)
    if "w4a16" in fits and "w16a4" in fits:
        out["claims"]["γ_D(weight) > γ_D(activation)"] = bool(
            fits["w4a16"]["constants"]["gamma_D"] > fits["w16a4"]["constants"]["gamma_D"])
    a8 = table[table["precision"] == "w4a4_fc2a8"]
    if len(a8):
        keys = ["N", "D", "seed", "group_size"]
        pair = a8.merge(table[table["precision"] == "w4a4"], on=keys, suffixes=("_a8", "_a4"))
        if len(pair):
            out["claims"]["FC2-A8 lowers the W4A4 error"] = bool((pair["delta_a8"] < pair["delta_a4"]).mean() > 0.5)
            out["fc2a8_vs_w4a4_mean_delta"] = [float(pair["delta_a8"].mean()), float(pair["delta_a4"].mean())]
    return out


def markdown(report: dict) -> str:
    lines = ["| fit | constants | R² (log) | rows | held-out rel. err | dropped (target ≤ 0) |", "|---|---|---|---|---|---|"]
    for name, f in report["fits"].items():
        consts = ", ".join(f"{k}={v:.4g}" for k, v in f["constants"].items() if not k.startswith("log_"))
        if f["frozen"]:
            consts += " (frozen: " + ", ".join(f["frozen"]) + ")"
        held = "—" if f["heldout_rel_err"] is None else f"{100 * f['heldout_rel_err']:.1f}% ({len(f['heldout'])} rows)"
        lines.append(f"| {name} | {consts} | {f['r2_log']:.3f} | {f['n_fit']} | {held} | {len(f['dropped'])} |")
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | | | |")
    if report.get("bootstrap"):
        lines += ["", "| fit | parameter | estimate | bootstrap SE | interval | resamples (failed) |", "|---|---|---|---|---|---|"]
        for name, b in report["bootstrap"].items():
            lines += [f"| {name} | {p} | {v['estimate']:.4g} | {v['se']:.3g} | {100 * b['level']:.0f}%: "
                      f"[{v['lo']:.4g}, {v['hi']:.4g}] | {b['n_boot']} ({b['failed']}) over {b['replicates']} {b['by']}s |"
                      for p, v in b["params"].items() if p != "log_k"]
    if report.get("claims"):
        word = lambda v: "n/a" if v is None else v if isinstance(v, str) else ("yes" if v else "no")
        lines += ["", "| paper's claim | holds here |", "|---|---|"]
        lines += [f"| {k} | {word(v)} |" for k, v in report["claims"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from sweeps.collect import collect, qat_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="+", help="multirun dirs (collected) or one CSV table")
    ap.add_argument("--law", default="qat_delta", help="qat_delta (the QAT report) | chinchilla | any in sweeps/laws.py")
    ap.add_argument("--where", action="append", default=[], help="column=value filters (repeatable)")
    ap.add_argument("--huber-delta", type=float, default=None)
    ap.add_argument("--bootstrap", type=int, default=0, metavar="B",
                    help="refit B times on resampled replicates (--by) per cell: SE and a --level interval per parameter")
    ap.add_argument("--by", default="seed", help="the replicate column the bootstrap resamples (default: seed)")
    ap.add_argument("--level", type=float, default=0.9, help="the bootstrap interval's coverage (default: 0.9)")
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

    if len(args.sources) == 1 and args.sources[0].endswith(".csv"):
        table, failures = pd.read_csv(args.sources[0]), []
    else:
        jobs, failures = collect(*args.sources)
        table = qat_table(jobs) if args.law == "qat_delta" else pd.DataFrame([j["flat"] for j in jobs])
    for cond in args.where:
        col, val = cond.split("=", 1)
        table = table[table[col].astype(str) == val]
    for f in failures:
        print(f"excluded failed job {f['dir']}: {f['status'][:200]}")
    if args.law == "qat_delta":
        report = qat_report(table, args.huber_delta, args.bootstrap, args.by, args.level)
    else:
        report = {"fits": {args.law: asdict(fit_law(args.law, table, args.huber_delta))}, "skipped": {}, "claims": {},
                  "bootstrap": {}}
        if args.bootstrap:
            report["bootstrap"][args.law] = bootstrap_fit(args.law, table, args.bootstrap, args.by, args.level,
                                                          huber_delta=args.huber_delta)
    report["failed_jobs"] = [{"dir": f["dir"], "status": f["status"]} for f in failures]
    text = markdown(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(out.with_name(out.name + ".csv"), index=False)
        out.with_name(out.name + "_fit.json").write_text(json.dumps(report, indent=2, default=float))
        out.with_name(out.name + "_fit.md").write_text(text)
        from sweeps.plot import plot_report

        plot_report(table, report, out.with_name(out.name + ".png"), loggers=loggers)
        print(f"wrote {out}.csv, {out}_fit.json, {out}_fit.md, {out}.png")
    if loggers:
        import wandb

        from lightning_modules.common.dashboard import log_table

        log_table("law/table", table.to_dict("records"), loggers)
        loggers[0].experiment.summary.update({f"{name}/{k}": v for name, f in report["fits"].items()
                                              for k, v in f["constants"].items()})
        wandb.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
