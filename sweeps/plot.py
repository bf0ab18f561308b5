"""Fitted law curves against the measured points (PNG; also to the given loggers, e.g. the sweep's W&B run).

``ax_law(ax, table, fit, law, target, series)`` draws any law of (N, D, …) against D on one axis (one colour per N,
one marker per value of a second series); ``plot_fit`` is the generic figure of ``sweeps.fit`` (a paper's study may
draw its own, with ``save_figure`` to write and log it).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from sweeps.laws import get_law

_MARKERS = "os^DvP*X"


def ax_law(ax, table: pd.DataFrame, fit: dict | None, law_name: str, target: str, series: tuple[str, ...]):
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


def save_figure(fig, path, key: str, loggers=()) -> Path:
    """Lay out, write ``path`` (PNG) and log the figure under ``key`` to ``loggers``; closes it."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    from lightning_modules.common.dashboard import log_figure

    log_figure(key, fig, loggers)  # closes it
    return path


def plot_fit(table: pd.DataFrame, report: dict, path, args, loggers=()) -> Path:
    """The law's target against D with its fitted curves (one colour per N)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    law = get_law(args.law)
    fig, ax = plt.subplots(figsize=(4.6, 3.8))
    ax_law(ax, table, report["fits"].get(args.law), args.law, law.target, ("N",))
    ax.set_ylabel(law.target)
    ax.legend(fontsize=6)
    return save_figure(fig, path, f"{args.law}/fit", loggers)
