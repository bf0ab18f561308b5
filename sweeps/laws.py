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


# --- data laws over quality buckets, mixtures and repetition (infolaw, ../shared/papers/infolaw.md) ------------
def _bucket_names(buckets) -> tuple[str, ...]:
    """``buckets``: names (a list, or one comma-separated string) or a count (named 0..K-1)."""
    if isinstance(buckets, int):
        return tuple(str(k) for k in range(buckets))
    names = tuple(b.strip() for b in buckets.split(",")) if isinstance(buckets, str) else tuple(map(str, buckets))
    if not names or len(set(names)) != len(names):
        raise ValueError(f"buckets={buckets!r}: give distinct bucket names (the table's w_<name>, U_<name> columns)")
    return names
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




def repetition(e: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """f(e; R*) = e up to one epoch, then 1 + R*(1 − exp(−(e − 1)/R*)): slope 1 at e = 1, saturating at 1 + R*."""
    return torch.where(e <= 1, e, 1 + R * -torch.expm1(-(e - 1).clamp_min(0) / R))


class InfoLaw(Law):
    """InfoLaw (the spec's [INF] form): information I = Σ_k ρ_k U_k f(e_k; N) with e_k = w_k D / U_k and the
    scale-dependent saturation R*(N) = R₀ (N/N₀)^(−η); L = E + A/N^α + B/I^β (``form: additive``) or
    E + (A/N^(α/β) + B/I)^β (``joint``). Density ρ_k = exp(θ s_k) from the quality scores (``density: score``) or
    free per bucket with the first fixed to 1 (``free``). Inputs: N, D and per-bucket columns w_<k>, U_<k>."""

    name = "infolaw"
    # the fit's objective is ~1e-6 near the optimum and the valley along (a, α) is long: SciPy's absolute gtol
    # (1e-5) would stop the polish far from it
    polish_options = {"gtol": 1e-14, "ftol": 1e-15, "maxiter": 20000}
    FORMS = ("additive", "joint")
    DENSITIES = ("score", "free")

    def __init__(self, buckets=("hq", "lq"), quality=None, density: str = "score", form: str = "additive",
                 n0: float = 3e5):
        self.buckets = _bucket_names(buckets)
        if form not in self.FORMS:
            raise ValueError(f"form={form!r}: choose one of {', '.join(self.FORMS)}")
        if density not in self.DENSITIES:
            raise ValueError(f"density={density!r}: choose one of {', '.join(self.DENSITIES)}")
        if density == "score":
            if quality is None or len(quality) != len(self.buckets):
                raise ValueError(f"density=score needs one quality score per bucket {list(self.buckets)}, got {quality!r}")
            self.quality = torch.tensor([float(q) for q in quality], dtype=torch.float64)
        self.density, self.form, self.n0 = density, form, float(n0)
        dens = ("theta",) if density == "score" else tuple(f"log_rho_{k}" for k in self.buckets[1:])
        self.params = (*dens, "log_R0", "eta", "a", "b", "e", "alpha", "beta")
        self.inputs = ("N", "D", *(f"w_{k}" for k in self.buckets), *(f"U_{k}" for k in self.buckets))
        self.target = "loss"

    def _split(self, theta):
        nd = len(self.params) - 7
        return theta[:nd], theta[nd:]

    def log_rho(self, dens: torch.Tensor) -> torch.Tensor:
        if self.density == "score":
            return dens[0] * self.quality
        return torch.cat([torch.zeros(1, dtype=dens.dtype), dens])

    def information(self, theta, X) -> torch.Tensor:
        dens, (log_r0, eta, *_) = self._split(theta)
        R = torch.exp(log_r0 - eta * torch.log(X["N"] / self.n0))
        rho = torch.exp(self.log_rho(dens))
        I = 0.0
        for k, name in enumerate(self.buckets):
            U = X[f"U_{name}"]
            I = I + rho[k] * U * repetition(X[f"w_{name}"] * X["D"] / U, R)
        return I

    def log_predict(self, theta, X):
        _, (_, _, a, b, e, alpha, beta) = self._split(theta)
        logN, logI = torch.log(X["N"]), torch.log(self.information(theta, X))
        if self.form == "additive":
            terms = [a - alpha * logN, b - beta * logI]
        else:
            terms = [beta * torch.logsumexp(torch.stack([a - alpha / beta * logN, b - logI]), dim=0)]
        return torch.logsumexp(torch.stack([*terms, e.expand_as(logN)]), dim=0)

    def frozen(self, X):
        return {"eta": 0.0} if len(np.unique(np.asarray(X["N"]))) < 2 else {}

    def init_grid(self):
        # 2 x 2 x 2 x 2 x 2 (x 2 per free density) starts: the batched L-BFGS is the fit's cost
        dens = [(0.0, 2.0)] * (len(self.params) - 7)
        return [np.array(t, dtype=np.float64) for t in itertools.product(
            *dens, (np.log(2.0), np.log(10.0)), (0.25,), (3.0, 8.0), (3.0, 8.0), (0.5,), (0.3, 0.7), (0.3, 0.7))]

    def constants(self, theta):
        c = super().constants(theta)
        c.update(R0=float(np.exp(c["log_R0"])), A=float(np.exp(c["a"])), B=float(np.exp(c["b"])), E=float(np.exp(c["e"])))
        if self.density == "free":
            c.update({f"rho_{k}": float(np.exp(c[f"log_rho_{k}"])) for k in self.buckets[1:]})
        return c

    def best_recipe(self, theta, N: float, D: float, U, steps: int = 200) -> np.ndarray:
        """The weights w on the simplex that maximise I (so minimise L) at (N, D, U): L-BFGS gradient steps on
        softmax logits (I is concave in w, as f is concave: one optimum)."""
        t = torch.as_tensor(np.asarray(theta, dtype=np.float64))
        U = torch.as_tensor(np.asarray(U, dtype=np.float64))
        logits = torch.zeros(len(self.buckets), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([logits], lr=1.0, max_iter=steps, tolerance_grad=1e-12, tolerance_change=1e-15,
                                line_search_fn="strong_wolfe")
        full = lambda v: torch.full((), float(v), dtype=torch.float64)

        def closure():
            opt.zero_grad()
            w = torch.softmax(logits, 0)
            X = {"N": full(N), "D": full(D), **{f"w_{k}": w[i] for i, k in enumerate(self.buckets)},
                 **{f"U_{k}": U[i] for i, k in enumerate(self.buckets)}}
            loss = -self.information(t, X) / D
            loss.backward()
            return loss

        opt.step(closure)
        return torch.softmax(logits, 0).detach().numpy()


def best_recipe(theta, N: float, D: float, U, s, **options) -> np.ndarray:
    """``InfoLaw(buckets=len(U), quality=s, **options).best_recipe(theta, N, D, U)``: the I-maximising weights."""
    return InfoLaw(buckets=len(U), quality=s, **options).best_recipe(theta, N, D, U)


class MuennighoffLaw(Law):
    """Data-constrained Chinchilla (Muennighoff et al. 2023): L = E + A/N′^α + B/D′^β with the effective data
    D′ = U + U R_D* (1 − exp(−R_D/R_D*)), R_D = D/U − 1 (D′ = D within the first epoch); U = Σ_k U_k, no quality.
    ``excess_params``: also N′ = U_N + U_N R_N* (1 − exp(−R_N/R_N*)), U_N = min(N, U/tokens_per_param),
    R_N = N/U_N − 1. Their fitted R_D* ≈ 15.4 and R_N* ≈ 5.3 are in the init grid."""

    name = "muennighoff"

    def __init__(self, buckets=("hq", "lq"), excess_params: bool = False, tokens_per_param: float = 20.0):
        self.buckets, self.excess_params, self.tokens_per_param = _bucket_names(buckets), excess_params, tokens_per_param
        self.params = ("a", "b", "e", "alpha", "beta", "log_RD", *(("log_RN",) if excess_params else ()))
        self.inputs = ("N", "D", *(f"U_{k}" for k in self.buckets))
        self.target = "loss"

    def log_predict(self, theta, X):
        a, b, e, alpha, beta, log_rd = theta[:6]
        U = sum(X[f"U_{k}"] for k in self.buckets)
        Dp = U * repetition(X["D"] / U, torch.exp(log_rd))  # = U + U R*(1 − exp(−R_D/R*)), D before an epoch ends
        N = X["N"]
        if self.excess_params:
            UN = torch.minimum(N, U / self.tokens_per_param)
            N = UN * repetition(N / UN, torch.exp(theta[6]))
        terms = torch.stack([a - alpha * torch.log(N), b - beta * torch.log(Dp), e.expand_as(N)])
        return torch.logsumexp(terms, dim=0)

    def init_grid(self):
        rn = ((np.log(5.3),),) if self.excess_params else ()
        return [np.array(t, dtype=np.float64) for t in itertools.product(
            (0.0, 5.0, 10.0), (0.0, 5.0, 10.0), (0.0, 1.0), (0.3, 0.7), (0.3, 0.7), (np.log(2.0), np.log(15.4)), *rn)]

    def constants(self, theta):
        c = super().constants(theta)
        c.update(A=float(np.exp(c["a"])), B=float(np.exp(c["b"])), E=float(np.exp(c["e"])), R_D=float(np.exp(c["log_RD"])))
        if self.excess_params:
            c["R_N"] = float(np.exp(c["log_RN"]))
        return c


class MixingLaw(Law):
    """A data-mixing law without repetition (Ye et al. 2024's exponential in the weights on top of Chinchilla):
    L = E + A/N^α + B/D^β + k·exp(Σ_j t_j w_j); t of the last bucket is 0 (Σ w = 1 makes one t redundant)."""

    name = "mixing"

    def __init__(self, buckets=("hq", "lq")):
        self.buckets = _bucket_names(buckets)
        self.params = ("a", "b", "e", "alpha", "beta", "log_k", *(f"t_{k}" for k in self.buckets[:-1]))
        self.inputs = ("N", "D", *(f"w_{k}" for k in self.buckets))
        self.target = "loss"

    def log_predict(self, theta, X):
        a, b, e, alpha, beta, log_k = theta[:6]
        mix = log_k + sum(theta[6 + j] * X[f"w_{k}"] for j, k in enumerate(self.buckets[:-1]))
        terms = torch.stack([a - alpha * torch.log(X["N"]), b - beta * torch.log(X["D"]), e.expand_as(X["N"]),
                             mix.expand_as(X["N"])])
        return torch.logsumexp(terms, dim=0)

    def init_grid(self):
        ts = [(-2.0, 2.0)] * (len(self.buckets) - 1)
        return [np.array(t, dtype=np.float64) for t in itertools.product(
            (0.0, 5.0, 10.0), (0.0, 5.0, 10.0), (0.0, 1.0), (0.3, 0.7), (0.3, 0.7), (-3.0, 0.0), *ts)]

    def constants(self, theta):
        c = super().constants(theta)
        c.update(A=float(np.exp(c["a"])), B=float(np.exp(c["b"])), E=float(np.exp(c["e"])), k=float(np.exp(c["log_k"])))
        return c


LAWS: dict[str, type[Law]] = {cls.name: cls for cls in (QATDeltaLaw, ChinchillaLaw, InfoLaw, MuennighoffLaw, MixingLaw)}
LAWS.update({cls.name: cls for cls in (ErrorGammaLaw, ErrorGammaQLaw, ExponentialLaw, LogisticLogNLaw)})


def get_law(name: str, **options) -> Law:
    """The law ``name``; ``options`` go to its constructor (buckets, quality scores, variant: see each class)."""
    if name not in LAWS:
        raise ValueError(f"unknown law {name!r}: choose one of {', '.join(sorted(LAWS))} (sweeps/laws.py)")
    try:
        return LAWS[name](**options)
    except TypeError as err:
        raise ValueError(f"law {name!r} does not take options {sorted(options)}: {err}") from None
