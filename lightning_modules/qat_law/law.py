"""The QAT δ law (Chen et al., arXiv 2505.14302), its sweep table, report and plot.

``δ_p(N, D, G) = k·D^γ_D·(log₂G)^γ_G / N^γ_N`` per precision, fitted by ``sweeps.fit`` to the table that
:func:`qat_table` collects from a multirun of ``qat_law_*`` jobs (one row per job and variant, each paired with
its full-precision twin); :func:`qat_report` adds the Chinchilla fit of the full-precision rows and the paper's
sign claims (bootstrapped over seeds when the sweep has several)::

    python -m sweeps.fit logs/multirun/qat_law_tiny logs/multirun/qat_law_tiny_decomp --law qat_delta \\
        --out sweeps/results/qat_law_tiny
"""
from __future__ import annotations

import itertools
from dataclasses import asdict

import numpy as np
import pandas as pd
import torch

from sweeps.collect import add_deltas
from sweeps.fit import bootstrap_fit, fit_law, identified_verdict, sign_verdict
from sweeps.laws import Law, Study, register
from sweeps.plot import ax_law, save_figure


class QATDeltaLaw(Law):
    """QAT error of Chen et al. (arXiv 2505.14302): δ = k · D^γ_D · (log₂ G)^γ_G / N^γ_N.

    ``log δ = log k + γ_D log D + γ_G log log₂ G − γ_N log N`` is linear in (log k, γ's): OLS gives the start.
    Signs the paper reports: γ_N > 0 (∂δ/∂N < 0), γ_D > 0, γ_G > 0. At G = 1, log₂G = 0: a sweep at that single G
    freezes γ_G at 0 and (log₂G)^0 = 1 (its feature is taken as 0, not 0·(−∞)); G = 1 beside other G is refused,
    as the law would put δ = 0 there.
    """

    name = "qat_delta"
    params = ("log_k", "gamma_D", "gamma_G", "gamma_N")
    inputs = ("N", "D", "G")
    target = "delta"
    _exponent_of = {"gamma_D": "D", "gamma_G": "G", "gamma_N": "N"}

    @staticmethod
    def features(X):
        lib = torch if isinstance(X["N"], torch.Tensor) else np
        log2g = lib.log2(X["G"])
        fg = lib.log(lib.where(log2g > 0, log2g, 1.0))  # G = 1: 0, as its γ_G is frozen at 0 (check refuses the rest)
        return lib.log(X["D"]), fg, -lib.log(X["N"])

    def check(self, X):
        G = np.asarray(X["G"])
        if (G <= 1).any() and len(np.unique(G)) > 1:
            raise ValueError("qat_delta: G = 1 (or below) beside other group sizes, where (log₂G)^γ_G would make δ = 0: "
                             "drop the G = 1 rows (--where) or fit them on their own")

    def log_predict(self, theta, X):
        fd, fg, fn = self.features(X)
        return theta[0] + theta[1] * fd + theta[2] * fg + theta[3] * fn

    def frozen(self, X):
        return {p: 0.0 for p, col in self._exponent_of.items() if len(np.unique(np.asarray(X[col]))) < 2}

    def linear_init(self, X, y):
        fd, fg, fn = self.features({k: np.asarray(X[k], dtype=np.float64) for k in self.inputs})
        cols = {"gamma_D": fd, "gamma_G": fg, "gamma_N": fn}
        free = [p for p in cols if p not in self.frozen(X)]
        A = np.column_stack([np.ones_like(fd)] + [cols[p] for p in free])
        sol, *_ = np.linalg.lstsq(A, np.log(y), rcond=None)
        theta = np.zeros(len(self.params))
        theta[0] = sol[0]
        for p, v in zip(free, sol[1:]):
            theta[self.params.index(p)] = v
        return theta

    def init_grid(self):
        return [np.array(t, dtype=np.float64) for t in
                itertools.product((-5.0, 0.0, 5.0), (0.0, 0.5), (0.0, 1.0), (0.0, 0.5))]

    def constants(self, theta):
        c = super().constants(theta)
        c["k"] = float(np.exp(theta[0]))
        return c


def qat_table(jobs: list[dict]) -> pd.DataFrame:
    """One row per (job, variant): N, D, seed, precision, bits, group_size, loss, delta (vs the fp twin)."""
    rows = []
    for job in jobs:
        res = job["metrics"].get("results", {}).get("qat_law")
        if not res:
            continue
        for r in res["rows"]:
            rows.append({"N": res["N"], "D": res["D"], "seed": job["seed"], **r, "job": job["dir"]})
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    return add_deltas(table)


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
        unidentified = [*fits["w4a4"]["unidentified"], *out["bootstrap"].get("w4a4", {}).get("unidentified", [])]
        for claim, param, sign in QAT_SIGNS:
            if param in boot:  # the interval decides: held / not_held / inconclusive
                verdict = sign_verdict(boot[param]["lo"], boot[param]["hi"], sign)
            else:
                verdict = None if param in fr else bool(sign * c[param] > 0)
            out["claims"][claim] = identified_verdict(verdict, [param], unidentified)  # never held on a flat constant
    if "w4a16" in fits and "w16a4" in fits:
        out["claims"]["γ_D(weight) > γ_D(activation)"] = identified_verdict(
            bool(fits["w4a16"]["constants"]["gamma_D"] > fits["w16a4"]["constants"]["gamma_D"]), ["gamma_D"],
            [*fits["w4a16"]["unidentified"], *fits["w16a4"]["unidentified"]])
    a8 = table[table["precision"] == "w4a4_fc2a8"]
    if len(a8):
        keys = ["N", "D", "seed", "group_size"]
        pair = a8.merge(table[table["precision"] == "w4a4"], on=keys, suffixes=("_a8", "_a4"))
        if len(pair):
            out["claims"]["FC2-A8 lowers the W4A4 error"] = bool((pair["delta_a8"] < pair["delta_a4"]).mean() > 0.5)
            out["fc2a8_vs_w4a4_mean_delta"] = [float(pair["delta_a8"].mean()), float(pair["delta_a4"].mean())]
    return out


def plot_report(table: pd.DataFrame, report: dict, path, wandb_key: str = "qat_law/fit", loggers=()):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = {"w4a4": 0, "w4a16": 1, "w16a4": 2, "w4a4_fc2a8": 3}
    precisions = sorted((p for p in table["precision"].unique() if p != "fp"), key=lambda p: (order.get(p, 9), p))
    chin = report["fits"].get("fp (chinchilla)")
    panels = len(precisions) + 1
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), squeeze=False)
    for ax, prec in zip(axes[0], precisions):
        sub = table[table["precision"] == prec].rename(columns={"group_size": "G"})
        fit = report["fits"].get(prec)
        ax_law(ax, sub, fit, "qat_delta", "delta", ("N", "G"))
        title = prec if fit is None else f"{prec}: γ_D={fit['constants']['gamma_D']:.2f} γ_G={fit['constants']['gamma_G']:.2f} γ_N={fit['constants']['gamma_N']:.2f}"
        ax.set_title(title, fontsize=8)
        ax.set_ylabel("δ = L_quant − L_fp")
        ax.legend(fontsize=6)
    fp = table[table["precision"] == "fp"].drop_duplicates(subset=["N", "D", "seed"])
    ax_law(axes[0][-1], fp, chin, "chinchilla", "loss", ("N",))
    axes[0][-1].set_title("full precision" + (" + Chinchilla fit" if chin else " (too few cells to fit)"), fontsize=8)
    axes[0][-1].set_ylabel("held-out loss")
    axes[0][-1].legend(fontsize=6)
    return save_figure(fig, path, wandb_key, loggers)


register(QATDeltaLaw, study=Study(
    table=qat_table,
    report=lambda table, args: qat_report(table, args.huber_delta, args.bootstrap, args.by, args.level),
    plot=lambda table, report, png, args, loggers: plot_report(table, report, png, loggers=loggers)))
