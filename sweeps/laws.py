"""Scaling laws as small classes, and the registry the papers fill.

A law predicts ``log target`` from a table's input columns; ``sweeps/fit.py`` fits any law the same way
(a Huber loss on log residuals minimised with L-BFGS from every point of a grid of inits, plus an optional OLS start).
A new law is a subclass of :class:`Law`: name its ``params``, ``inputs`` and ``target``, write ``log_predict`` in
torch, and give ``init_grid`` (and ``linear_init`` when the law is linear in its parameters after taking logs).

Laws live with their papers (``lightning_modules/<paper>/law.py``) and register themselves with :func:`register`,
optionally with a :class:`Study`: how that paper's sweep becomes a table, a report and a plot. :func:`get_law` finds
them by name (``python -m sweeps.fit … --law qat_delta``); only the Chinchilla law, which several papers fit as their
baseline, lives here.
"""
from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch


class Law:
    name: str = "law"
    params: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    target: str = ""
    counts: tuple[str, ...] = ()  # count columns (e.g. k right of m) the objective reads; rows with target ≤ 0 stay
    corner: tuple[str, ...] = ("N", "D")  # inputs whose largest values form the held-out corner
    huber_delta: float = 1e-3
    heldout_max: bool = False  # reports show the max held-out error beside the mean

    def log_predict(self, theta: torch.Tensor, X: Mapping[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def objective(self, theta: torch.Tensor, X: Mapping[str, torch.Tensor], logy: torch.Tensor,
                  delta: float) -> torch.Tensor:
        """What the fit minimises: a Huber loss on log residuals (override for another objective; it must be
        plain torch on one ``theta``, as the fitter batches it over starts with ``torch.func.vmap``)."""
        r = self.log_predict(theta, X) - logy
        a = r.abs()
        return torch.where(a <= delta, 0.5 * r ** 2, delta * (a - 0.5 * delta)).sum()

    def init_grid(self) -> list[np.ndarray]:
        """Starting points over every parameter; the fit runs L-BFGS from each of them."""
        raise NotImplementedError

    def linear_init(self, X: Mapping[str, np.ndarray], y: np.ndarray) -> np.ndarray | None:
        """A closed-form start (OLS on the log target) where the law allows one."""
        return None

    def check(self, X: Mapping[str, np.ndarray]) -> None:
        """Refuse inputs the law cannot hold, with one line naming the fix (called before every fit)."""

    def frozen(self, X: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Parameters that the data cannot identify, held at a value (e.g. the exponent of a constant input)."""
        return {}

    def constants(self, theta: np.ndarray) -> dict[str, float]:
        return dict(zip(self.params, map(float, theta)))

    def predict(self, theta, X: Mapping[str, np.ndarray]) -> np.ndarray:
        t = torch.as_tensor(np.asarray(theta, dtype=np.float64))
        Xt = {k: torch.tensor(np.asarray(X[k], dtype=np.float64)) for k in self.inputs}  # a copy: inputs may be read-only
        return torch.exp(self.log_predict(t, Xt)).numpy()



class ChinchillaLaw(Law):
    """L = A/N^α + B/D^β + E, fitted as log L = LSE(a − α log N, b − β log D, e) (Hoffmann et al. 2022;
    Besiroglu et al. 2024's replication: Huber δ = 1e-3 on log residuals, L-BFGS from a grid of inits)."""

    name = "chinchilla"
    params = ("a", "b", "e", "alpha", "beta")
    inputs = ("N", "D")
    target = "loss"

    def log_predict(self, theta, X):
        a, b, e, alpha, beta = theta
        terms = torch.stack([a - alpha * torch.log(X["N"]), b - beta * torch.log(X["D"]), e.expand_as(X["N"])])
        return torch.logsumexp(terms, dim=0)

    def init_grid(self):
        return [np.array(t, dtype=np.float64) for t in itertools.product(
            (0.0, 5.0, 10.0, 20.0), (0.0, 5.0, 10.0, 20.0), (-1.0, 0.0, 1.0, 1.5), (0.0, 0.5, 1.0), (0.0, 0.5, 1.0))]

    def constants(self, theta):
        c = super().constants(theta)
        c.update(A=float(np.exp(theta[0])), B=float(np.exp(theta[1])), E=float(np.exp(theta[2])))
        return c



@dataclass(frozen=True)
class Study:
    """How a paper's sweep is read and reported, for the laws it registers; a hook left ``None`` is the generic one
    (``sweeps.fit``). Hooks: ``table(jobs) -> DataFrame`` (collected jobs to rows), ``options(table, law) -> dict``
    (constructor options read off the table), ``report(table, args) -> dict`` (the fits and claims),
    ``markdown(report) -> str``, ``plot(table, report, png, args, loggers)``."""

    table: Callable | None = None
    options: Callable | None = None
    report: Callable | None = None
    markdown: Callable | None = None
    plot: Callable | None = None


LAWS: dict[str, type[Law]] = {}
STUDIES: dict[str, Study] = {}  # law name -> its paper's study
_DISCOVERED = False


def register(*laws: type[Law], study: Study | None = None) -> None:
    """Make ``laws`` known by their ``name`` (a paper's ``law.py`` calls this when imported)."""
    for law in laws:
        LAWS[law.name] = law
        STUDIES[law.name] = study or Study()


def discover() -> None:
    """Import every paper's ``law.py`` once, so their laws are registered (shared code names no paper)."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    root = Path(__file__).resolve().parents[1] / "lightning_modules"
    for path in sorted(root.glob("*/law.py")):
        importlib.import_module(f"lightning_modules.{path.parent.name}.law")


def law_class(name: str) -> type[Law]:
    discover()
    if name not in LAWS:
        raise ValueError(f"unknown law {name!r}: choose one of {', '.join(sorted(LAWS))} "
                         "(laws live in lightning_modules/<paper>/law.py)")
    return LAWS[name]


def study_for(name: str) -> Study:
    law_class(name)
    return STUDIES[name]


def get_law(name: str, **options) -> Law:
    """The law ``name``; ``options`` go to its constructor (buckets, quality scores, variant: see each class)."""
    cls = law_class(name)
    try:
        return cls(**options)
    except TypeError as err:
        raise ValueError(f"law {name!r} does not take options {sorted(options)}: {err}") from None


register(ChinchillaLaw)
