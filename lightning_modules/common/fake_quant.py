"""Fake-quantized linear layers for quantization-aware training (QAT), with per-module overrides.

``FakeQuantLinear`` fake-quantizes its weight in groups of ``w_group_size`` along the input dimension and its
input activation per token in groups of ``a_group_size`` along the hidden dimension, then runs the ordinary
matmul; gradients reach the full-precision weights through the straight-through estimator (see
``callbacks/kernels/fake_quant.py`` for the grids and the STE, and the Triton kernel used on CUDA).
Any bit widths: 16 means "leave in full precision", so W4A4, W4A16 and W16A4 are one layer.

``input_scale`` (optional, per input channel; set by ``set_input_scales``): the input is divided by s before its
quantizer and the weight multiplied by s, so the product is unchanged and the activation grid sees x/s (AWQ's
smoothing, dllmquant's W4A4).

``quantize_model(model, QuantSpec(...))`` swaps every ``nn.Linear`` of a model in place, except the LM head
(``skip``); embeddings are not linear layers and stay in full precision. ``overrides`` maps a module-name
pattern (fnmatch) to changed fields, e.g. the QAT-law paper's fix ``{"*down_proj": {"a_bits": 8}}``
(FC2 input at 8 bits).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from callbacks.kernels.fake_quant import fake_quant


@dataclass
class QuantSpec:
    """How to fake-quantize the linear layers of a model.

    w_bits / a_bits: weight / input-activation bits (>= 16: full precision).
    group_size: G for both (``w_group_size`` / ``a_group_size`` override one of them; -1 = whole row).
    w_symmetric / a_symmetric: absmax grid (True) or min-max grid with a rounded zero-point (False).
    clip_ratio: the range is clip_ratio × (absmax | min, max); 1.0 = plain absmax/min-max (nothing clips).
    overrides: {module-name pattern: {field: value}}, applied in order, later patterns win.
    skip: module-name patterns left as plain nn.Linear (the LM head).
    impl: auto (Triton on CUDA) | triton | torch.
    """

    w_bits: int = 4
    a_bits: int = 4
    group_size: int = 128
    w_group_size: int | None = None
    a_group_size: int | None = None
    w_symmetric: bool = True
    a_symmetric: bool = True
    clip_ratio: float = 1.0
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    skip: tuple[str, ...] = ("lm_head", "*.lm_head")
    impl: str = "auto"

    def for_module(self, name: str) -> "QuantSpec":
        spec = self
        for pattern, changes in self.overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                unknown = set(changes) - {f.name for f in dataclasses.fields(QuantSpec)}
                if unknown:
                    raise ValueError(f"quant override {pattern!r} sets unknown fields {sorted(unknown)}; "
                                     "use w_bits, a_bits, group_size, w_group_size, a_group_size, w_symmetric, "
                                     "a_symmetric, clip_ratio")
                spec = dataclasses.replace(spec, **changes)
        return spec


class FakeQuantLinear(nn.Linear):
    """``nn.Linear`` whose weight and input are fake-quantized in the forward pass (STE backward)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, w_bits: int = 4, a_bits: int = 4,
                 w_group_size: int = 128, a_group_size: int = 128, w_symmetric: bool = True,
                 a_symmetric: bool = True, clip_ratio: float = 1.0, impl: str = "auto", device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._set(self, w_bits, a_bits, w_group_size, a_group_size, w_symmetric, a_symmetric, clip_ratio, impl)

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: QuantSpec) -> "FakeQuantLinear":
        """A fake-quant layer sharing ``linear``'s parameters (no copy)."""
        g = spec.group_size
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        cls._set(new, spec.w_bits, spec.a_bits, spec.w_group_size or g, spec.a_group_size or g,
                 spec.w_symmetric, spec.a_symmetric, spec.clip_ratio, spec.impl)
        return new

    @staticmethod
    def _set(new, w_bits, a_bits, w_group_size, a_group_size, w_symmetric, a_symmetric, clip_ratio, impl):
        new.w_bits, new.a_bits = int(w_bits), int(a_bits)
        new.w_group_size, new.a_group_size = int(w_group_size), int(a_group_size)
        new.w_symmetric, new.a_symmetric = bool(w_symmetric), bool(a_symmetric)
        new.clip_ratio, new.impl = float(clip_ratio), impl
        for what, g, bits in (("w_group_size", new.w_group_size, new.w_bits), ("a_group_size", new.a_group_size, new.a_bits)):
            if bits < 16 and g > 0 and new.in_features % g:
                raise ValueError(f"{what}={g} does not divide in_features={new.in_features}: choose a group size "
                                 f"that divides the layer's input dimension")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = getattr(self, "input_scale", None)  # AWQ's per-input-channel s: the activation quantizer sees x/s
        if s is not None:
            x = x / s.to(x)
        x = fake_quant(x, self.a_bits, self.a_group_size, self.a_symmetric, self.clip_ratio, self.impl)
        w = fake_quant(self.weight, self.w_bits, self.w_group_size, self.w_symmetric, self.clip_ratio, self.impl)
        if s is not None:
            w = w * s.to(w)  # (W·diag s)(x/s) = Wx: only the quantizer sees the scaled input
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, w{self.w_bits}a{self.a_bits}, G_w={self.w_group_size}, "
                f"G_a={self.a_group_size}, sym_w={self.w_symmetric}, sym_a={self.a_symmetric}")


def quant_spec(value: QuantSpec | Mapping[str, Any] | None) -> QuantSpec:
    if value is None:
        return QuantSpec()
    if isinstance(value, QuantSpec):
        return value
    unknown = set(value) - {f.name for f in dataclasses.fields(QuantSpec)}
    if unknown:
        raise ValueError(f"unknown quantization fields {sorted(unknown)}: see QuantSpec in lightning_modules/common/fake_quant.py")
    kw = dict(value)
    if "skip" in kw:
        kw["skip"] = tuple(kw["skip"])
    return QuantSpec(**kw)


def quantize_model(model: nn.Module, spec: QuantSpec | Mapping[str, Any] | None = None) -> dict[str, FakeQuantLinear]:
    """Swap every ``nn.Linear`` of ``model`` (but the skipped ones) for a ``FakeQuantLinear``, in place.

    Returns {module name: new layer}. Layers whose spec is 16/16 bits are left alone.
    """
    spec = quant_spec(spec)
    replaced: dict[str, FakeQuantLinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or any(fnmatch.fnmatchcase(full, p) for p in spec.skip):
                continue
            s = spec.for_module(full)
            if s.w_bits >= 16 and s.a_bits >= 16:
                continue
            new = FakeQuantLinear.from_linear(child, s)
            setattr(module, child_name, new)
            replaced[full] = new
    return replaced


def set_input_scales(layers: Mapping[str, nn.Module], scales: Mapping[str, torch.Tensor]) -> None:
    """Give each named ``FakeQuantLinear`` its per-input-channel ``input_scale`` (AWQ's s, from the driver)."""
    for name, s in scales.items():
        if name not in layers:
            raise ValueError(f"input scale for {name}, which is not a fake-quantized layer")
        layers[name].input_scale = torch.as_tensor(s).detach().to(layers[name].weight.dtype)
