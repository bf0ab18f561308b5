"""WaterSIC-FT (spec §4.3): the integer codes Z stay frozen; only the diagonal rescalers t (rows) and g (columns) of
every quantized layer, Ŵ = diag(t)·A·diag(g) with A = Z∘α, are trained, by distillation KL(P_fp ‖ P_q) to the
full-precision model. Paper: WikiText-2, AdamW at lr 5e-4 cosine to 5e-6, 10 epochs, batch 8, seq 2048 (70B: lr 5e-5,
4 epochs). The rate does not change (the fp16 scales t and g are already counted as side information).

A is recovered from the quantized weight, A = Ŵ / (t gᵀ) where t_i g_j ≠ 0 (0 elsewhere), so the driver only keeps
the small factors (t, g) per layer. Training runs with ``torch.inference_mode(False)`` and grad enabled, so it can
be called from a Lightning test hook.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize


class DiagRescaled(nn.Module):
    """Parametrization weight = t[:, None] · A · g[None, :] with A frozen and t, g trainable."""

    def __init__(self, weight: torch.Tensor, t: torch.Tensor, g: torch.Tensor):
        super().__init__()
        outer = torch.outer(t, g).to(weight.device, torch.float64)
        a = torch.where(outer != 0, weight.double() / torch.where(outer != 0, outer, 1.0), 0.0)
        self.register_buffer("A", a.to(torch.float32))
        self.t = nn.Parameter(t.detach().to(weight.device, torch.float32).clone())
        self.g = nn.Parameter(g.detach().to(weight.device, torch.float32).clone())

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return (self.t.unsqueeze(1) * self.A * self.g.unsqueeze(0)).to(weight.dtype)


def kl_loss(model, reference, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(P_ref ‖ P_model), in nats."""
    with torch.no_grad():
        lp = torch.log_softmax(reference(input_ids=input_ids, use_cache=False).logits.float(), -1)
    lq = torch.log_softmax(model(input_ids=input_ids, use_cache=False).logits.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()


def finetune_rescalers(model, reference, factors: dict[str, tuple[torch.Tensor, torch.Tensor]], sequences: torch.Tensor,
                       epochs: int = 10, lr: float = 5e-4, lr_min: float = 5e-6, batch_size: int = 8, seed: int = 0,
                       log=print) -> list[float]:
    """Train only the (t, g) of the layers in ``factors`` (name -> (t, g)) on ``sequences`` (N×S token ids) by KL
    distillation to ``reference``; cosine LR from ``lr`` to ``lr_min`` over all steps. The trained weights are
    written back into the layers (parametrizations removed). Returns the mean KL (nats) of each epoch."""
    if not factors:
        raise ValueError("WaterSIC-FT needs the factored layers: quantize with WaterSIC first")
    mods = dict(model.named_modules())
    history: list[float] = []
    with torch.inference_mode(False), torch.enable_grad():
        # parameters touched in inference mode are inference tensors: work on normal copies
        for name, p in list(model.named_parameters()):
            p.data = p.data.clone()
        frozen = [p for p in model.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        params = []
        for name, (t, g) in factors.items():
            par = DiagRescaled(mods[name].weight.detach().clone(), t.clone(), g.clone())
            parametrize.register_parametrization(mods[name], "weight", par)
            params += [par.t, par.g]
        steps = max(1, epochs * math.ceil(len(sequences) / batch_size))
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=lr_min)
        gen = torch.Generator().manual_seed(seed)
        dev = next(model.parameters()).device
        was_training = model.training
        model.eval()  # no dropout: the student matches the teacher's deterministic outputs
        try:
            for epoch in range(epochs):
                order = torch.randperm(len(sequences), generator=gen)
                total, count = 0.0, 0
                for i in range(0, len(sequences), batch_size):
                    batch = sequences[order[i:i + batch_size]].clone().to(dev)
                    loss = kl_loss(model, reference, batch)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    sched.step()
                    total, count = total + float(loss.detach()) * len(batch), count + len(batch)
                history.append(total / count)
                if log:
                    log(f"[watersic-ft] epoch {epoch + 1}/{epochs}: KL {history[-1]:.5f} nats/token")
        finally:
            for name in factors:
                parametrize.remove_parametrizations(mods[name], "weight", leave_parametrized=True)
                mods[name].weight.requires_grad_(False)
            for p in frozen:
                p.requires_grad_(True)
            model.train(was_training)
    return history
