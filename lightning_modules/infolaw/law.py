"""Data laws over quality buckets, mixtures and repetition (infolaw, ../shared/papers/infolaw.md), with their sweep
table, law options and plot: :class:`InfoLaw` (the paper's), :class:`MuennighoffLaw` and :class:`MixingLaw` (its
baselines), fitted by ``sweeps.fit`` to the table :func:`infolaw_table` collects (one row per mixture job)::

    python -m sweeps.fit logs/multirun/infolaw_tiny --law infolaw --holdout w_hq=0.7 --holdout D=max \\
        --out sweeps/results/infolaw_tiny
"""
from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import torch

from sweeps.fit import law_options
from sweeps.laws import Law, Study, get_law, register
from sweeps.plot import save_figure


def _bucket_names(buckets) -> tuple[str, ...]:
    """``buckets``: names (a list, or one comma-separated string) or a count (named 0..K-1)."""
    if isinstance(buckets, int):
        return tuple(str(k) for k in range(buckets))
    names = tuple(b.strip() for b in buckets.split(",")) if isinstance(buckets, str) else tuple(map(str, buckets))
    if not names or len(set(names)) != len(names):
        raise ValueError(f"buckets={buckets!r}: give distinct bucket names (the table's w_<name>, U_<name> columns)")
    return names


def repetition(e: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """f(e; R*) = e up to one epoch, then 1 + R*(1 − exp(−(e − 1)/R*)): slope 1 at e = 1, saturating at 1 + R*."""
    return torch.where(e <= 1, e, 1 + R * -torch.expm1(-(e - 1).clamp_min(0) / R))


class InfoLaw(Law):
    """InfoLaw (the spec's [INF] form): information I = Σ_k ρ_k U_k f(e_k; N) with e_k = w_k D / U_k and the
    scale-dependent saturation R*(N) = R₀ (N/N₀)^(−η); L = E + A/N^α + B/I^β (``form: additive``) or
    E + (A/N^(α/β) + B/I)^β (``joint``). Density ρ_k = exp(θ s_k) from the quality scores (``density: score``) or
    free per bucket with the first fixed to 1 (``free``). Inputs: N, D and per-bucket columns w_<k>, U_<k>."""

    name = "infolaw"
    heldout_max = True  # the paper reports the mean and the max held-out error
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
    ``excess_params``: also N′ = U_N + U_N R_N* (1 − exp(−R_N/R_N*)), U_N = min(N, U_D/tokens_per_param) with
    U_D = min(D, U) the unique tokens seen (their paper's definition: a run inside its first epoch has seen D, not
    the whole pool), R_N = N/U_N − 1. Their fitted R_D* ≈ 15.4 and R_N* ≈ 5.3 are in the init grid."""

    name = "muennighoff"
    heldout_max = True  # the paper reports the mean and the max held-out error

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
            UN = torch.minimum(N, torch.minimum(X["D"], U) / self.tokens_per_param)
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
    heldout_max = True  # the paper reports the mean and the max held-out error

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


DATA_LAWS = ("infolaw", "muennighoff", "mixing")


def data_law_options(table: pd.DataFrame, law: str) -> dict:
    """The bucket names (from the w_<k> columns) and, for InfoLaw, each bucket's quality score s_<k>."""
    buckets = [c[2:] for c in table.columns if c.startswith("w_")]
    if not buckets:
        raise ValueError(f"law {law!r} needs per-bucket columns w_<k>, U_<k> (infolaw_table builds them)")
    options: dict = {"buckets": buckets}
    if law == "infolaw" and all(f"s_{k}" in table for k in buckets):
        options["quality"] = [float(table[f"s_{k}"].iloc[0]) for k in buckets]
    return options



def infolaw_table(jobs: list[dict]) -> pd.DataFrame:
    """One row per job from ``results.infolaw``: N, D, per bucket w_k, U_k, s_k, D_k, e_k, and the clean test loss."""
    rows = [{**job["metrics"]["results"]["infolaw"], "seed": job["seed"], "job": job["dir"]}
            for job in jobs if job["metrics"].get("results", {}).get("infolaw")]
    return pd.DataFrame(rows)



def plot_mixture(table: pd.DataFrame, law, theta, path, bucket: str, loggers=(), key: str = "infolaw/fit"):
    """Loss against the weight of ``bucket`` (one panel per N, one colour per D): the measured cells and the fitted
    data law (``law``: an instance, as its options carry the buckets) along the weight of that bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ns, Ds = sorted(table["N"].unique()), sorted(table["D"].unique())
    others = [c[2:] for c in table.columns if c.startswith("w_") and c != f"w_{bucket}"]
    colours = plt.cm.viridis(np.linspace(0, 0.9, max(1, len(Ds))))
    fig, axes = plt.subplots(1, len(Ns), figsize=(4.2 * len(Ns), 3.8), squeeze=False)
    grid = np.linspace(0.02, 0.98, 60)
    for ax, n in zip(axes[0], Ns):
        for c, d in zip(colours, Ds):
            sub = table[(table["N"] == n) & (table["D"] == d)].sort_values(f"w_{bucket}")
            ax.scatter(sub[f"w_{bucket}"], sub["loss"], color=c, s=14, label=f"D={d / 1e6:.2g}M")
            if theta is not None and len(sub):
                first = sub.iloc[0]
                X = {col: np.full_like(grid, float(first[col])) for col in law.inputs if col in sub}
                X[f"w_{bucket}"] = grid
                for o in others:  # the rest split in the table's proportions
                    X[f"w_{o}"] = (1 - grid) * float(first[f"w_{o}"]) / max(1e-12, 1 - float(first[f"w_{bucket}"]))
                ax.plot(grid, law.predict(theta, X), color=c, lw=1)
        ax.set(xlabel=f"w_{bucket}", ylabel="held-out loss", title=f"N={n / 1e3:.0f}k")
        ax.legend(fontsize=6)
    return save_figure(fig, path, key, loggers)



def plot(table: pd.DataFrame, report: dict, png, args, loggers):
    law = get_law(args.law, **law_options(table, args))
    return plot_mixture(table, law, report["fits"][args.law]["theta"], png, law.buckets[0], loggers=loggers)


register(InfoLaw, MuennighoffLaw, MixingLaw, study=Study(table=infolaw_table, options=data_law_options, plot=plot))
