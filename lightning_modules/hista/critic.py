"""A value head on a frozen actor's last-layer states, fitted by regression (the PPO critic SVEB compares with).

Every response token's state is labelled with its response's reward (the critic's SFT target with the actor
frozen); :meth:`ValueHead.fit` solves that least-squares problem in closed form (ridge, with an intercept), so a
fit is exact and deterministic. Its prediction at a token is V(prefix up to that token). :meth:`ValueHead.fit_cv`
picks the ridge by held-out squared error, holding out whole groups (problems), so the critic is as good as its
features allow rather than over- or under-regularised by a guess.
"""
from __future__ import annotations

import torch


class ValueHead(torch.nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden.to(self.proj.weight.dtype)).squeeze(-1)

    @torch.no_grad()
    def fit(self, features: torch.Tensor, targets: torch.Tensor, ridge: float = 1e-3) -> "ValueHead":
        """Least squares ``min ‖X w + b − y‖² + ridge ‖w‖²`` over states X (n, H) and targets y (n,)."""
        if features.ndim != 2 or features.shape[0] != targets.numel() or features.shape[0] == 0:
            raise ValueError(f"ValueHead.fit needs (n, H) features and n targets, got {tuple(features.shape)} "
                             f"and {targets.numel()}")
        X = features.double()
        mu, ybar = X.mean(0), targets.double().mean()
        Xc, yc = X - mu, targets.double().view(-1) - ybar
        A = Xc.T @ Xc + ridge * torch.eye(X.shape[1], dtype=X.dtype)
        w = torch.linalg.solve(A, Xc.T @ yc)
        self.proj.weight.copy_(w.view(1, -1).to(self.proj.weight.dtype))
        self.proj.bias.fill_(float(ybar - mu @ w))
        return self

    @torch.no_grad()
    def fit_cv(self, features: torch.Tensor, targets: torch.Tensor, groups: torch.Tensor,
               ridges=(1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3, 1e4), holdout: float = 0.2) -> "ValueHead":
        """:meth:`fit` with the ridge of least held-out MSE on a ``holdout`` share of the groups, then refit on all."""
        ids = torch.unique(groups)
        held = torch.isin(groups, ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
                                      [:max(1, int(len(ids) * holdout))]])
        if held.all() or not held.any():
            return self.fit(features, targets, ridges[len(ridges) // 2])
        err = [float(((self.fit(features[~held], targets[~held], r)(features[held]) - targets[held]) ** 2).mean())
               for r in ridges]
        self.ridge = ridges[min(range(len(ridges)), key=err.__getitem__)]
        return self.fit(features, targets, self.ridge)
