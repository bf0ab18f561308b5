"""A simple figure from a per-arm table (``benchmarks.schema.arms_table``), for benchmarks with no figure of their
own: grouped bars, one group per row (the first column names the arm), one bar per chosen numeric column."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence


def bars(table: dict, path: str | Path, columns: Sequence[str] | None = None, ylabel: str | None = None,
         title: str | None = None, hline: float | None = None) -> Path:
    """Draw ``table``'s numeric ``columns`` (default: every column after the first with a number) per row into a
    PNG at ``path``; ``hline``: a reference level (chance, a threshold). Cells that are None are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = list(table["columns"])
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    chosen = list(columns) if columns else [c for i, c in enumerate(cols[1:], 1)
                                            if any(num(r[i]) for r in table["rows"])]
    if not chosen:
        raise ValueError(f"bars: no numeric column in {cols}")
    idx = [cols.index(c) for c in chosen]
    labels = [str(r[0]) for r in table["rows"]]
    width = 0.8 / len(chosen)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(labels) * max(1, len(chosen) / 2)), 3.6))
    for j, (c, i) in enumerate(zip(chosen, idx)):
        xs = [k + (j - (len(chosen) - 1) / 2) * width for k, r in enumerate(table["rows"]) if num(r[i])]
        ys = [r[i] for r in table["rows"] if num(r[i])]
        ax.bar(xs, ys, width, label=c)
    if hline is not None:
        ax.axhline(hline, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(labels)), labels, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel(ylabel or (chosen[0] if len(chosen) == 1 else "value"))
    ax.set_title(title or table["caption"], fontsize=9)
    if len(chosen) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
