"""A value head on a frozen actor's last-layer states, fitted by regression (the PPO critic SVEB compares with).

Every response token's state is labelled with its response's reward (the critic's SFT target with the actor
frozen); :meth:`ValueHead.fit` solves that least-squares problem in closed form (ridge, with an intercept), so a
fit is exact and deterministic. Its prediction at a token is V(prefix up to that token).
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
