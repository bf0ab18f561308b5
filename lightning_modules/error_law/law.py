"""Accuracy laws of error accumulation (arXiv 2601.14175), fitted to counts, with their sweep table, report and plot.

``Acc(n)`` of a task of complexity ``n`` fitted by binomial maximum likelihood to ``k`` right of ``m`` per row
(:class:`ErrorGammaLaw`, the paper's; :class:`ExponentialLaw` and :class:`LogisticLogNLaw`, the alternatives);
:func:`error_report` fits every one per (task, format) group and predicts the largest ``n`` held out::

    python -m sweeps.fit <multirun dir> --law error_gamma
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import torch

from sweeps.fit import fit_law
from sweeps.laws import Law, Study, get_law, register
from sweeps.plot import save_figure


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



def error_table(jobs: list[dict]) -> pd.DataFrame:
    """One row per (job, task, format, n) of an error_law job (``results.error_law.rows``): n, k right of m,
    acc, plus the job's model, seed and overrides (so a sweep's cells stay apart)."""
    rows = []
    for job in jobs:
        res = job["metrics"].get("results", {}).get("error_law")
        if not res:
            continue
        extra = {k: v for k, v in job["flat"].items() if k in ("seed",) or "." in k}  # the overrides
        for r in res["rows"]:
            rows.append({**extra, "model": res.get("model"), **r, "job": job["dir"]})
    return pd.DataFrame(rows)


ERROR_LAWS = ("error_gamma", "error_gamma_q", "exponential", "logistic_log_n")


def binomial_stats(law: Law | str, theta, df: pd.DataFrame) -> dict:
    """Goodness of fit of an accuracy law on count rows (n, k, m): deviance, Pearson χ², AIC = deviance + 2·params
    (the binomial AIC up to a constant of the data, so laws compare on the same rows) and the mean |Acc − k/m|."""
    law = get_law(law) if isinstance(law, str) else law
    X = {c: torch.tensor(df[c].to_numpy(dtype=np.float64)) for c in (*law.inputs, *law.counts)}
    th = torch.as_tensor(np.asarray(theta, dtype=np.float64))
    with torch.no_grad():
        dev = float(law.objective(th, X, None, 0.0))
        p = torch.exp(law.log_acc(th, X["n"])).numpy()
    k, m = df["k"].to_numpy(dtype=np.float64), df["m"].to_numpy(dtype=np.float64)
    var = np.clip(m * p * (1 - p), 1e-12, None)
    return {"deviance": dev, "chi2": float(((k - m * p) ** 2 / var).sum()), "aic": dev + 2 * len(law.params),
            "rows": len(df), "mean_abs_err": float(np.abs(p - k / m).mean())}


def error_report(table: pd.DataFrame, laws=ERROR_LAWS, by=("task", "format")) -> dict:
    """Per ``by`` group of count rows (n, k, m): every law fitted by binomial maximum likelihood on all rows (its
    constants, deviance, χ², AIC) and again without the largest n, which it then predicts (held-out deviance and
    |Acc − k/m| there); a group whose answers are all right or all wrong is skipped. ``best`` names the law with the lowest AIC and the one with the lowest held-out deviance."""
    table = table.assign(acc=table["k"] / table["m"])
    keys = [c for c in by if c in table]
    out: dict = {"groups": {}, "skipped": {}}
    for name, sub in (table.groupby(keys, dropna=False) if keys else [((), table)]):
        label = "/".join(map(str, name if isinstance(name, tuple) else (name,))) or "all"
        sub = sub.groupby("n", as_index=False)[["k", "m"]].sum().assign(acc=lambda t: t["k"] / t["m"])
        if (sub["k"] == 0).all() or (sub["k"] == sub["m"]).all():  # every law fits it perfectly: nothing to compare
            out["skipped"][label] = (f"degenerate: every answer {'wrong' if (sub['k'] == 0).all() else 'right'} at "
                                     f"n = {sorted(sub['n'].tolist())}; move n_grid (or train longer) so accuracy spans")
            continue
        group: dict = {}
        hold = sub["n"].to_numpy() == sub["n"].max()
        for law_name in laws:
            law = get_law(law_name)
            try:
                full = fit_law(law, sub, holdout=None)
                part = fit_law(law, sub, holdout=hold) if len(sub) > len(law.params) + 1 else None
            except ValueError as err:
                out["skipped"][f"{label} {law_name}"] = str(err)
                continue
            entry = {"constants": full.constants, "theta": full.theta, **binomial_stats(law, full.theta, sub)}
            if part is not None:
                held = binomial_stats(law, part.theta, sub[hold])
                entry.update(heldout_n=float(sub["n"].max()), heldout_deviance=held["deviance"],
                             heldout_abs_err=held["mean_abs_err"], heldout_constants=part.constants)
            group[law_name] = entry
        if group:
            out["groups"][label] = {"laws": group, "rows": sub.to_dict("records"),
                                    "best_aic": min(group, key=lambda k: group[k]["aic"]),
                                    "best_heldout": min((k for k in group if "heldout_deviance" in group[k]),
                                                        key=lambda k: group[k]["heldout_deviance"], default=None)}
    return out


def error_markdown(report: dict) -> str:
    lines = ["| group | law | constants | deviance | χ² | AIC | held-out n | held-out deviance | held-out abs err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, g in report["groups"].items():
        for name, f in g["laws"].items():
            consts = ", ".join(f"{k}={v:.4g}" for k, v in f["constants"].items() if not k.startswith(("log_", "logit_")))
            held = [f"{f[k]:.4g}" if k in f else "—" for k in ("heldout_n", "heldout_deviance", "heldout_abs_err")]
            lines.append(f"| {label} | {name} | {consts} | {f['deviance']:.4g} | {f['chi2']:.4g} | {f['aic']:.4g} | "
                         + " | ".join(held) + " |")
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | skipped: {why} | | | | | | | |")
    return "\n".join(lines) + "\n"


def plot_accuracy(report: dict, path, law: str = "error_gamma", others=("exponential", "logistic_log_n"),
                  wandb_key: str = "error_law/fit", loggers=()):
    """Accuracy against n, one panel per group of :func:`error_report`: the measured k/m with binomial
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
    return save_figure(fig, path, wandb_key, loggers)



def report(table: pd.DataFrame, args) -> dict:
    """``--law error_gamma`` (or any count law): that law and the other accuracy laws per (model, task, format)."""
    by = tuple(c for c in ("model", "task", "format") if c in table and table[c].nunique(dropna=False) > 1) or ("task", "format")
    return error_report(table, (args.law, *(law for law in ERROR_LAWS if law != args.law)), by=by)


register(ErrorGammaLaw, ErrorGammaQLaw, ExponentialLaw, LogisticLogNLaw, study=Study(
    table=error_table, report=report, markdown=error_markdown,
    plot=lambda table, report, png, args, loggers: plot_accuracy(report, png, law=args.law, loggers=loggers)))
