"""Scaling laws as small classes: parameters, a formula (in log space), initialisation.

A law predicts ``log target`` from a table's input columns; ``sweeps/fit.py`` fits any law the same way
(a Huber loss on log residuals minimised with L-BFGS from every point of a grid of inits, plus an optional OLS start).
A new law is a subclass here: name its ``params``, ``inputs`` and ``target``, write ``log_predict`` in torch,
and give ``init_grid`` (and ``linear_init`` when the law is linear in its parameters after taking logs).
"""
from __future__ import annotations

import itertools
from typing import Mapping

import numpy as np
import torch


class Law:
    name: str = "law"
    params: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    target: str = ""
    huber_delta: float = 1e-3

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

    def frozen(self, X: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Parameters that the data cannot identify, held at a value (e.g. the exponent of a constant input)."""
        return {}

    def constants(self, theta: np.ndarray) -> dict[str, float]:
        return dict(zip(self.params, map(float, theta)))

    def predict(self, theta, X: Mapping[str, np.ndarray]) -> np.ndarray:
        t = torch.as_tensor(np.asarray(theta, dtype=np.float64))
        Xt = {k: torch.tensor(np.asarray(X[k], dtype=np.float64)) for k in self.inputs}  # a copy: inputs may be read-only
        return torch.exp(self.log_predict(t, Xt)).numpy()


class QATDeltaLaw(Law):
    """QAT error of Chen et al. (arXiv 2505.14302): δ = k · D^γ_D · (log₂ G)^γ_G / N^γ_N.

    ``log δ = log k + γ_D log D + γ_G log log₂ G − γ_N log N`` is linear in (log k, γ's): OLS gives the start.
    Signs the paper reports: γ_N > 0 (∂δ/∂N < 0), γ_D > 0, γ_G > 0.
    """

    name = "qat_delta"
    params = ("log_k", "gamma_D", "gamma_G", "gamma_N")
    inputs = ("N", "D", "G")
    target = "delta"
    _exponent_of = {"gamma_D": "D", "gamma_G": "G", "gamma_N": "N"}

    @staticmethod
    def features(X):
        lib = torch if isinstance(X["N"], torch.Tensor) else np
        return lib.log(X["D"]), lib.log(lib.log2(X["G"])), -lib.log(X["N"])

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


LAWS: dict[str, type[Law]] = {cls.name: cls for cls in (QATDeltaLaw, ChinchillaLaw)}


def get_law(name: str) -> Law:
    if name not in LAWS:
        raise ValueError(f"unknown law {name!r}: choose one of {', '.join(sorted(LAWS))} (sweeps/laws.py)")
    return LAWS[name]()
