"""Scaling laws as small classes: parameters, a formula (in log space), initialisation.

A law predicts ``log target`` from a table's input columns; ``sweeps/fit.py`` fits any law the same way
(a Huber loss on log residuals minimised with L-BFGS from every point of a grid of inits, plus an optional OLS start).
A new law is a subclass here: name its ``params``, ``inputs`` and ``target``, write ``log_predict`` in torch,
and give ``init_grid`` (and ``linear_init`` when the law is linear in its parameters after taking logs).
"""
from __future__ import annotations

import itertools
import math
from typing import Mapping

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


# --- accuracy laws fitted to counts (error_law, arXiv 2601.14175) -----------------------------------------------
class _RegGamma(torch.autograd.Function):
    """P(a, x) (``upper=False``) or Q(a, x) = 1 − P(a, x) (``upper=True``), the regularised incomplete gammas, with
    a gradient in both arguments: torch's ``gammainc`` has none in ``a``. ∂/∂x is analytic (± x^(a−1) e^(−x) / Γ(a));
    ∂/∂a is a float64 central difference. It has its own ``vmap`` rule (it is elementwise), so the fitter can batch
    it over starts cheaply."""

    @staticmethod
    def forward(a, x, upper):
        f = torch.special.gammaincc if upper else torch.special.gammainc
        return f(a, x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, x, upper = inputs
        ctx.save_for_backward(a, x)
        ctx.upper = upper

    @staticmethod
    def vmap(info, in_dims, a, x, upper):
        def batched(t, dim):
            return t.movedim(dim, 0) if dim is not None else t.expand(info.batch_size, *t.shape)

        return _RegGamma.apply(batched(a, in_dims[0]), batched(x, in_dims[1]), upper), 0

    @staticmethod
    def backward(ctx, grad):
        a, x = ctx.saved_tensors
        f = torch.special.gammaincc if ctx.upper else torch.special.gammainc
        ad, xd = a.double(), x.double()
        h = 1e-5 * ad.clamp_min(1.0)
        da = ((f(ad + h, xd) - f(ad - h, xd)) / (2 * h)).to(a.dtype)
        dx = torch.exp((a - 1) * torch.log(x) - x - torch.lgamma(a)) * (-1.0 if ctx.upper else 1.0)
        return grad * da, grad * dx, None


def gammainc(a: torch.Tensor, x: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """Regularised lower (or ``upper``) incomplete gamma, differentiable in ``a`` and ``x`` (broadcast)."""
    a, x = torch.broadcast_tensors(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(x, dtype=torch.float64))
    return _RegGamma.apply(a, x, upper)


class AccuracyLaw(Law):
    """Accuracy Acc(n) of a task of complexity n, fitted to counts: ``k`` right out of ``m`` trials per row.

    The objective is the binomial deviance 2 Σ [k log(k / m p) + (m − k) log((m − k) / m (1 − p))], i.e. the
    negative log-likelihood Σ k log p + (m − k) log(1 − p) up to a constant, so rows with k = 0 (or k = m) stay in.
    A subclass gives ``log_acc`` and ``log_err`` (log p and log(1 − p), each computed stably on its own)."""

    inputs = ("n",)
    target = "acc"
    counts = ("k", "m")  # count columns the objective reads; the fitter keeps rows with target ≤ 0 for such laws
    corner = ("n",)      # the held-out rows: the largest n

    def log_acc(self, theta, n):
        raise NotImplementedError

    def log_err(self, theta, n):
        raise NotImplementedError

    def log_predict(self, theta, X):
        return self.log_acc(theta, X["n"])

    def objective(self, theta, X, logy, delta):
        k, m = X["k"], X["m"]
        lp, lq = self.log_acc(theta, X["n"]), self.log_err(theta, X["n"])
        # x log(x / y) with 0 log 0 = 0; the clamps keep the masked branch finite under autograd
        term = lambda c, logp: torch.where(c > 0, c * (torch.log(c.clamp_min(1e-300) / m) - logp), torch.zeros_like(c))
        return 2.0 * (term(k, lp) + term(m - k, lq)).sum()


class ErrorGammaLaw(AccuracyLaw):
    """Acc(n) = P(a, 1/(r n)) with a = q/2 (``shape = "q_half"``) or a = q (``"q"``): a q-dimensional isotropic
    error walk of per-token variance σ² stays inside the logit margin τ (r = 2σ²/τ²). Parameters (log r, log q).
    For large r n, Acc ≈ (1/(r n))^a / Γ(a + 1): a power-law tail, not the exponential (1 − p)^n."""

    name = "error_gamma"
    params = ("log_r", "log_q")
    shape = "q_half"

    # the box the fit searches (log r, log q): beyond it the data says nothing new (a curve that is all right or
    # all wrong pushes the optimum to infinity); clamping stops the walk there, with a zero gradient
    bounds = ((-25.0, 10.0), (math.log(0.02), math.log(500.0)))

    def a(self, theta):
        return torch.exp(theta[1].clamp(*self.bounds[1])) / (2.0 if self.shape == "q_half" else 1.0)

    def _p(self, theta, n, upper):
        x = 1.0 / (torch.exp(theta[0].clamp(*self.bounds[0])) * n)
        return gammainc(self.a(theta).expand_as(x), x, upper)

    def log_acc(self, theta, n):
        return torch.log(self._p(theta, n, False).clamp_min(1e-300))

    def log_err(self, theta, n):
        return torch.log(self._p(theta, n, True).clamp_min(1e-300))

    def init_grid(self):
        return [np.array(t, dtype=np.float64) for t in
                itertools.product(np.log([1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0]), np.log([0.3, 1.0, 3.0, 10.0, 30.0]))]

    def constants(self, theta):
        c = super().constants(theta)
        c.update(r=float(np.exp(theta[0])), q=float(np.exp(theta[1])))
        return c


class ErrorGammaQLaw(ErrorGammaLaw):
    """The same law with q, not q/2, in the shape slot (the paper's convention is not public: both are reported)."""

    name = "error_gamma_q"
    shape = "q"


class ExponentialLaw(AccuracyLaw):
    """Independent per-token errors: Acc(n) = (1 − p)^n, p = sigmoid(z). One parameter."""

    name = "exponential"
    params = ("logit_p",)

    def log_acc(self, theta, n):
        return -n * torch.nn.functional.softplus(theta[0].clamp(-40.0, 40.0))  # log(1 − p) = −softplus(z)

    def log_err(self, theta, n):
        return torch.log((-torch.expm1(self.log_acc(theta, n))).clamp_min(1e-300))

    def init_grid(self):
        return [np.array([z]) for z in (-9.0, -6.0, -4.0, -2.0, 0.0, 2.0)]

    def constants(self, theta):
        return {"logit_p": float(theta[0]), "p": float(1.0 / (1.0 + np.exp(-theta[0])))}


class LogisticLogNLaw(AccuracyLaw):
    """A logistic in log n: Acc(n) = sigmoid(α − β log n). Two parameters."""

    name = "logistic_log_n"
    params = ("alpha", "beta")

    def logit(self, theta, n):
        return theta[0].clamp(-50.0, 50.0) - theta[1].clamp(-30.0, 30.0) * torch.log(n)  # a box, as the gamma law's

    def log_acc(self, theta, n):
        return -torch.nn.functional.softplus(-self.logit(theta, n))

    def log_err(self, theta, n):
        return -torch.nn.functional.softplus(self.logit(theta, n))

    def init_grid(self):
        return [np.array(t, dtype=np.float64) for t in itertools.product((-2.0, 0.0, 3.0, 8.0), (0.0, 1.0, 3.0, 6.0))]


LAWS: dict[str, type[Law]] = {cls.name: cls for cls in (QATDeltaLaw, ChinchillaLaw)}
LAWS.update({cls.name: cls for cls in (ErrorGammaLaw, ErrorGammaQLaw, ExponentialLaw, LogisticLogNLaw)})


def get_law(name: str) -> Law:
    if name not in LAWS:
        raise ValueError(f"unknown law {name!r}: choose one of {', '.join(sorted(LAWS))} (sweeps/laws.py)")
    return LAWS[name]()
