"""Fitted law curves against the measured points (PNG; also to the given loggers, e.g. the sweep's W&B run).

``plot_report(table, report, path)``: for the QAT report one panel per quantized precision (δ against D, log-log,
one colour per N, one marker per G, the fitted law as lines through the measured D range) plus, when fitted,
the full-precision loss against D with its Chinchilla curve. ``plot_law(ax, law, theta, ...)`` draws any law.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sweeps.laws import get_law

_MARKERS = "os^DvP*X"


def _ax_law(ax, table: pd.DataFrame, fit: dict | None, law_name: str, target: str, series: tuple[str, ...]):
    import matplotlib.pyplot as plt

    law = get_law(law_name)
    Ns = sorted(table["N"].unique())
    colours = plt.cm.viridis(np.linspace(0, 0.9, max(1, len(Ns))))
    others = [s for s in series if s != "N"]
    groups = sorted(table[others[0]].unique()) if others else [None]
    dgrid = np.geomspace(table["D"].min(), table["D"].max(), 50)
    for i, n in enumerate(Ns):
        for j, g in enumerate(groups):
            sub = table[(table["N"] == n) & ((table[others[0]] == g) if others else True)]
            if sub.empty:
                continue
            pos = sub[sub[target] > 0]
            ax.scatter(pos["D"], pos[target], color=colours[i], marker=_MARKERS[j % len(_MARKERS)],
                       label=f"N={n / 1e3:.0f}k" + (f", {others[0]}={g}" if others else ""))
            if fit is not None:
                X = {"N": np.full_like(dgrid, n), "D": dgrid}
                if others:
                    X[others[0]] = np.full_like(dgrid, g)
                ax.plot(dgrid, law.predict(fit["theta"], X), color=colours[i], lw=1,
                        ls=("-", "--", ":", "-.")[j % 4])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("D (training tokens)")


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
        _ax_law(ax, sub, fit, "qat_delta", "delta", ("N", "G"))
        title = prec if fit is None else f"{prec}: γ_D={fit['constants']['gamma_D']:.2f} γ_G={fit['constants']['gamma_G']:.2f} γ_N={fit['constants']['gamma_N']:.2f}"
        ax.set_title(title, fontsize=8)
        ax.set_ylabel("δ = L_quant − L_fp")
        ax.legend(fontsize=6)
    fp = table[table["precision"] == "fp"].drop_duplicates(subset=["N", "D", "seed"])
    _ax_law(axes[0][-1], fp, chin, "chinchilla", "loss", ("N",))
    axes[0][-1].set_title("full precision" + (" + Chinchilla fit" if chin else " (too few cells to fit)"), fontsize=8)
    axes[0][-1].set_ylabel("held-out loss")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    from lightning_modules.common.dashboard import log_figure

    log_figure(wandb_key, fig, loggers)  # closes it
    return path



def plot_accuracy(report: dict, path, law: str = "error_gamma", others=("exponential", "logistic_log_n"),
                  wandb_key: str = "error_law/fit", loggers=()):
    """Accuracy against n, one panel per group of ``sweeps.fit.error_report``: the measured k/m with binomial
    standard errors and the fitted ``law`` (solid) and ``others`` (dashed) over the measured range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = report["groups"]
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(4.0 * max(1, len(groups)), 3.4), squeeze=False)
    for ax, (label, g) in zip(axes[0], groups.items()):
        rows = pd.DataFrame(g["rows"])
        acc = rows["k"] / rows["m"]
        ax.errorbar(rows["n"], acc, yerr=np.sqrt(acc * (1 - acc) / rows["m"]), fmt="o", ms=3, color="k", label="measured")
        grid = np.linspace(rows["n"].min(), rows["n"].max(), 100)
        for name in (law, *others):
            if name in g["laws"]:
                ax.plot(grid, get_law(name).predict(g["laws"][name]["theta"], {"n": grid}),
                        ls="-" if name == law else "--", lw=1, label=f"{name} (dev {g['laws'][name]['deviance']:.3g})")
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("n (items processed)")
        ax.set_ylabel("exact-match accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    from lightning_modules.common.dashboard import log_figure

    log_figure(wandb_key, fig, loggers)  # closes it
    return path
