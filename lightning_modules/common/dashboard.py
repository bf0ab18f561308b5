"""Tables and figures for the dashboards: one call writes to every logger of the run that can hold it.

``log_table(name, rows, loggers)`` and ``log_figure(name, fig, loggers)`` take a module's ``self.loggers`` (or a
trainer's): W&B gets a ``wandb.Table`` / ``wandb.Image``; TensorBoard a figure and the table as markdown text;
the CSV logger writes ``tables/<name>.csv`` (and ``figures/<name>.png``) in its run dir. With no logger that can
hold it, nothing happens. Only rank 0 writes (Lightning's loggers are rank-zero already; the files are not).

Also ``run_config(cfg)``: the composed config as W&B and the other loggers receive it, resolved, without secrets.
"""
from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

SECRET = re.compile(r"(api_?key|token|secret|password|credential)", re.IGNORECASE)


def run_config(cfg) -> dict:
    """The resolved config minus every key that looks like a secret (W&B shows the config to anyone on the project)."""
    from omegaconf import OmegaConf

    def scrub(node):
        if isinstance(node, dict):
            return {k: scrub(v) for k, v in node.items() if not SECRET.search(str(k))}
        if isinstance(node, list):
            return [scrub(v) for v in node]
        return node

    out = scrub(OmegaConf.to_container(cfg, resolve=True))
    try:  # the experiment and every group choice, for W&B's filters (the composed config has no such key)
        from hydra.core.hydra_config import HydraConfig

        choices = {k: v for k, v in HydraConfig.get().runtime.choices.items() if not k.startswith("hydra")}
        out = {"experiment": choices.get("experiment"), "choices": choices, **out}
    except ValueError:
        pass
    return out


def _kind(logger) -> str:
    # By class name, so that neither wandb nor tensorboard is imported for a run that does not use it.
    return {"WandbLogger": "wandb", "TensorBoardLogger": "tensorboard", "CSVLogger": "csv"}.get(type(logger).__name__, "")


def _rank_zero() -> bool:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def log_table(name: str, rows: Iterable[Mapping[str, Any]], loggers: Sequence = (), step: int | None = None) -> None:
    """Log ``rows`` (dicts; the columns are the union of their keys, in first-seen order) as table ``name``."""
    rows = [dict(r) for r in rows]
    if not rows or not _rank_zero():
        return
    columns = list(dict.fromkeys(k for r in rows for k in r))
    data = [[r.get(c) for c in columns] for r in rows]
    for lg in loggers or ():
        kind = _kind(lg)
        if kind == "wandb":
            lg.log_table(key=name, columns=columns, data=data, step=step)
        elif kind == "tensorboard":
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in data]
            lg.experiment.add_text(name, "\n".join(lines), global_step=step or 0)
        elif kind == "csv":
            path = Path(lg.log_dir) / "tables" / f"{_file_name(name)}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(columns)
                writer.writerows(data)


def log_figure(name: str, fig, loggers: Sequence = (), step: int | None = None, close: bool = True) -> None:
    """Log a matplotlib figure as ``name`` (a W&B image, a TensorBoard figure, a PNG beside the CSV logs)."""
    try:
        if not _rank_zero():
            return
        for lg in loggers or ():
            kind = _kind(lg)
            if kind == "wandb":
                lg.log_image(key=name, images=[_rgb(fig)], step=step)
            elif kind == "tensorboard":
                lg.experiment.add_figure(name, fig, global_step=step or 0, close=False)
            elif kind == "csv":
                path = Path(lg.log_dir) / "figures" / f"{_file_name(name)}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                fig.savefig(path, dpi=100)
    finally:
        if close:
            import matplotlib.pyplot as plt

            plt.close(fig)


def figure(**kwargs):
    """A matplotlib figure and axes on the non-interactive backend (no display on a cluster node)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(**kwargs)


def heatmap(name: str, values, loggers: Sequence = (), xlabel: str = "", ylabel: str = "", step: int | None = None,
            xticks: Sequence | None = None, yticks: Sequence | None = None) -> None:
    """A 2-D array as a heat map with a colour bar: the common case of the papers' per-layer / per-head plots."""
    import numpy as np

    if not any(_kind(lg) for lg in loggers or ()):
        return
    values = np.asarray(values, dtype=float)
    fig, ax = figure(figsize=(max(4, 0.4 * values.shape[1] + 2), max(3, 0.3 * values.shape[0] + 1.5)))
    im = ax.imshow(values, aspect="auto", cmap="viridis")
    fig.colorbar(im, ax=ax)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=name)
    if xticks is not None:
        ax.set_xticks(range(len(xticks)), [str(t) for t in xticks], rotation=45, ha="right")
    if yticks is not None:
        ax.set_yticks(range(len(yticks)), [str(t) for t in yticks])
    fig.tight_layout()
    log_figure(name, fig, loggers, step=step)


def curve(name: str, series: Mapping[str, tuple[Sequence, Sequence]], loggers: Sequence = (), xlabel: str = "",
          ylabel: str = "", step: int | None = None, logx: bool = False) -> None:
    """One line per series (``label -> (x, y)``): the papers' "metric against x" plots."""
    if not any(_kind(lg) for lg in loggers or ()):
        return
    fig, ax = figure(figsize=(5, 3.5))
    for label, (x, y) in series.items():
        ax.plot(list(x), list(y), marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=name)
    if logx:
        ax.set_xscale("log")
    if len(series) > 1:
        ax.legend()
    fig.tight_layout()
    log_figure(name, fig, loggers, step=step)


def _rgb(fig):
    import numpy as np

    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
