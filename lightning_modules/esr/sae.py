"""Sparse autoencoders on a residual stream: the model, a trainer on cached activations, and loaders that read the
public release files directly (``sae-lens`` is never imported: it pins transformers 4).

``SAE``: f(x) = act((x − b_dec·[apply_b_dec_to_input]) W_enc + b_enc), x̂ = f W_dec + b_dec, with ``act`` ReLU or
JumpReLU (f = z·[z > threshold], per latent). W_dec is (d_sae, d_in): row i is latent i's decoder direction.

Loaders (each checks shapes, one line naming the file on a mismatch):

- :func:`load_saelens`: a SAELens directory, ``cfg.json`` (d_in, d_sae, architecture standard | jumprelu,
  apply_b_dec_to_input, hook_name) + ``sae_weights.safetensors`` (W_enc (d_in, d_sae), W_dec, b_enc, b_dec,
  threshold for jumprelu). :func:`save_saelens` writes the same layout (the tiny SAE is cached in it).
- :func:`load_gemmascope`: a GemmaScope ``params.npz`` (W_enc, W_dec, b_enc, b_dec, threshold; JumpReLU, b_dec not
  subtracted from the input).
- :func:`load_goodfire`: a Goodfire Llama SAE (``.pth`` / ``.pt`` torch state dict or ``.safetensors``):
  ``encoder_linear.{weight (d_sae, d_in), bias}``, ``decoder_linear.{weight (d_in, d_sae), bias}``; ReLU,
  input not centred.

:func:`load_sae` dispatches on ``format`` (``saelens | gemmascope | goodfire``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from datamodules.common.errors import MissingPathError

ACTIVATIONS = ("relu", "jumprelu")
FORMATS = ("saelens", "gemmascope", "goodfire")


class SAE(nn.Module):
    def __init__(self, d_in: int, d_sae: int, activation: str = "relu", apply_b_dec_to_input: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"sae.activation={activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        self.d_in, self.d_sae, self.activation = d_in, d_sae, activation
        self.apply_b_dec_to_input = apply_b_dec_to_input
        self.W_enc = nn.Parameter(torch.zeros(d_in, d_sae))
        self.W_dec = nn.Parameter(torch.zeros(d_sae, d_in))
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.b_dec = nn.Parameter(torch.zeros(d_in))
        self.register_buffer("threshold", torch.zeros(d_sae))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.W_enc.dtype)
        z = (x - self.b_dec if self.apply_b_dec_to_input else x) @ self.W_enc + self.b_enc
        return z * (z > self.threshold) if self.activation == "jumprelu" else torch.relu(z)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        return f @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    def direction(self, i) -> torch.Tensor:
        """Unit decoder direction(s) W_dec[i] / ‖W_dec[i]‖."""
        w = self.W_dec[i]
        return w / w.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    def check_input(self, hidden_size: int) -> None:
        if self.d_in != hidden_size:
            raise ValueError(f"SAE input size d_in={self.d_in} differs from the model's hidden_size={hidden_size}: "
                             "load the SAE trained on this model")


def fit_stats(sae: SAE, x: torch.Tensor) -> dict:
    """Held-out quality: variance explained 1 − ‖x − x̂‖²/‖x − mean‖², mean L0, share of latents never active."""
    with torch.no_grad():
        f = sae.encode(x)
        x_hat = sae.decode(f)
        fvu = ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
        return {"variance_explained": float(1 - fvu), "l0": float((f > 0).sum(-1).float().mean()),
                "dead_fraction": float(((f > 0).sum(0) == 0).float().mean())}


def train_sae(acts: torch.Tensor, d_sae: int, l1: float = 5e-3, steps: int = 2000, batch_size: int = 512,
              lr: float = 1e-3, seed: int = 0, resample_every: int = 250) -> SAE:
    """A ReLU SAE on cached activations (N, d_in): loss = MSE + l1 · Σ_i f_i ‖W_dec[i]‖ on inputs scaled to unit mean
    norm (folded back into the weights at the end); b_dec starts at the mean; latents dead over the last
    ``resample_every`` steps are re-initialised on the worst-reconstructed inputs (the standard recipe). Grad mode is
    switched on here: a test-only run first trains its SAE inside Lightning's inference mode."""
    with torch.inference_mode(False), torch.enable_grad():
        return _train_sae(acts.float().clone(), d_sae, l1, steps, batch_size, lr, seed, resample_every)


def _train_sae(acts: torch.Tensor, d_sae: int, l1: float, steps: int, batch_size: int, lr: float, seed: int,
               resample_every: int) -> SAE:
    g = torch.Generator().manual_seed(seed)
    scale = acts.norm(dim=-1).mean().clamp_min(1e-8)
    x_all = acts / scale
    d_in = x_all.shape[1]
    sae = SAE(d_in, d_sae, "relu", apply_b_dec_to_input=True)
    with torch.no_grad():
        w = torch.randn(d_sae, d_in, generator=g)
        sae.W_dec.copy_(w / w.norm(dim=-1, keepdim=True) * 0.1)
        sae.W_enc.copy_(sae.W_dec.t())
        sae.b_dec.copy_(x_all.mean(0))
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    fired = torch.zeros(d_sae, dtype=torch.bool)
    for step in range(steps):
        x = x_all[torch.randint(len(x_all), (batch_size,), generator=g)]
        f = sae.encode(x)
        x_hat = sae.decode(f)
        loss = ((x_hat - x) ** 2).sum(-1).mean() + l1 * (f * sae.W_dec.norm(dim=-1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        fired |= (f > 0).any(0)
        if resample_every and (step + 1) % resample_every == 0 and step + 1 < steps * 0.8:
            dead = (~fired).nonzero().flatten()
            if len(dead):
                with torch.no_grad():
                    err = ((sae(x) - x) ** 2).sum(-1)
                    pick = x[torch.multinomial(err + 1e-12, len(dead), replacement=True, generator=g)] - sae.b_dec
                    pick = pick / pick.norm(dim=-1, keepdim=True).clamp_min(1e-8)
                    sae.W_dec[dead] = pick * 0.2
                    sae.W_enc[:, dead] = pick.t()
                    sae.b_enc[dead] = 0.0
                for s in opt.state.values():  # fresh moments for everything (simple and safe)
                    s["exp_avg"].zero_(), s["exp_avg_sq"].zero_()
            fired.zero_()
    with torch.no_grad():  # back to the raw activation scale: f is unchanged, x̂ scales with x
        sae.W_dec.mul_(scale)
        sae.b_dec.mul_(scale)
        sae.W_enc.div_(scale)
    return sae.requires_grad_(False)


# --- release files ---------------------------------------------------------------------------------------------------
def _build(path, tensors: dict, activation: str, apply_b_dec: bool) -> SAE:
    d_in, d_sae = tensors["W_enc"].shape
    shapes = {"W_dec": (d_sae, d_in), "b_enc": (d_sae,), "b_dec": (d_in,), "threshold": (d_sae,)}
    for name, shape in shapes.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ValueError(f"{path}: {name} has shape {tuple(tensors[name].shape)}, expected {shape} "
                             f"(W_enc is {d_in} x {d_sae})")
    sae = SAE(d_in, d_sae, activation, apply_b_dec)
    with torch.no_grad():
        for name in ("W_enc", "W_dec", "b_enc", "b_dec", "threshold"):
            if name in tensors:
                getattr(sae, name).copy_(torch.as_tensor(tensors[name]).float())
    return sae.requires_grad_(False)


def load_saelens(path: str | Path) -> SAE:
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / "cfg.json", path / "sae_weights.safetensors"
    for f in (cfg_file, weights):
        if not f.exists():
            raise MissingPathError(f"{f} missing — point model.sae.path at a SAELens SAE directory (cfg.json and "
                                   "sae_weights.safetensors)")
    cfg = json.loads(cfg_file.read_text())
    arch = cfg.get("architecture", "standard")
    if arch not in ("standard", "jumprelu"):
        raise ValueError(f"{cfg_file}: architecture {arch!r} is not supported (standard | jumprelu)")
    tensors = load_file(str(weights))
    sae = _build(weights, tensors, "relu" if arch == "standard" else "jumprelu", cfg.get("apply_b_dec_to_input", True))
    if (cfg.get("d_in"), cfg.get("d_sae")) != (sae.d_in, sae.d_sae):
        raise ValueError(f"{cfg_file}: d_in/d_sae {cfg.get('d_in')}/{cfg.get('d_sae')} disagree with the weights "
                         f"({sae.d_in}/{sae.d_sae})")
    return sae


def save_saelens(sae: SAE, path: str | Path, **extra) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: getattr(sae, k).detach().contiguous() for k in ("W_enc", "W_dec", "b_enc", "b_dec")}
    if sae.activation == "jumprelu":
        tensors["threshold"] = sae.threshold.contiguous()
    save_file(tensors, str(path / "sae_weights.safetensors"))
    cfg = {"d_in": sae.d_in, "d_sae": sae.d_sae, "architecture": "standard" if sae.activation == "relu" else "jumprelu",
           "apply_b_dec_to_input": sae.apply_b_dec_to_input, **extra}
    (path / "cfg.json").write_text(json.dumps(cfg, indent=1))
    return path


def load_gemmascope(path: str | Path) -> SAE:
    import numpy as np

    path = Path(path)
    if path.is_dir():
        path = path / "params.npz"
    if not path.exists():
        raise MissingPathError(f"{path} missing — point model.sae.path at a GemmaScope params.npz "
                               "(layer_L/width_16k/canonical)")
    with np.load(path) as z:
        tensors = {k: torch.from_numpy(z[k]) for k in z.files}
    missing = {"W_enc", "W_dec", "b_enc", "b_dec", "threshold"} - set(tensors)
    if missing:
        raise ValueError(f"{path}: missing arrays {sorted(missing)} (a GemmaScope params.npz has W_enc, W_dec, b_enc, "
                         "b_dec, threshold)")
    return _build(path, tensors, "jumprelu", apply_b_dec=False)


def load_goodfire(path: str | Path) -> SAE:
    path = Path(path)
    if not path.exists():
        raise MissingPathError(f"{path} missing — point model.sae.path at a Goodfire SAE .pth state dict "
                               "(encoder_linear, decoder_linear)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    need = ("encoder_linear.weight", "encoder_linear.bias", "decoder_linear.weight", "decoder_linear.bias")
    if any(k not in state for k in need):
        raise ValueError(f"{path}: expected keys {list(need)}, found {sorted(state)[:6]}")
    tensors = {"W_enc": state["encoder_linear.weight"].t(), "b_enc": state["encoder_linear.bias"],
               "W_dec": state["decoder_linear.weight"].t(), "b_dec": state["decoder_linear.bias"]}
    return _build(path, tensors, "relu", apply_b_dec=False)


LOADERS = {"saelens": load_saelens, "gemmascope": load_gemmascope, "goodfire": load_goodfire}


def load_sae(format: str, path: str | Path) -> SAE:
    if format not in LOADERS:
        raise ValueError(f"sae.format={format!r}: choose one of {', '.join(FORMATS)}")
    return LOADERS[format](path)
