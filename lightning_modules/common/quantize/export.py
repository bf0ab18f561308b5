"""Export a quantized model in the packed 4-bit format (``callbacks/kernels/w4a16.py``), really 4-bit on disk and
in memory, and load it back; every quantized ``nn.Linear`` becomes a ``PackedLinear`` (the W4A16 matmul:
Triton on CUDA, the PyTorch reference elsewhere).

The driver keeps each layer's ``AffineGrid`` (scale and zero per group; the quantizer reports it) but not its codes:
``pack_model`` reads the codes back off the fake-quantized weight, c = round(Ŵ·s_in / scale + zero), and refuses a
weight that is not on its grid (more than ``tol`` of a step away: the model changed after quantization), so the packed
layer decodes to the quantizer's Ŵ up to the rounding of the scale (stored in ``scale_dtype``, fp32 by default: at one
group per row this side information costs 64 bits per row, so the packed model equals the fake-quantized one).

Which quantizers export (their Ŵ lies on a uniform grid of at most 16 levels with a scale and zero per group):
- ``rtn``, ``gptq`` (and ``gptq_dllmquant``, DLLMQuant's CGQ being GPTQ on token-weighted statistics): the per-row
  absmax grid of 2^R levels, so R ≤ 4 (even levels are mid-rise, zero m − ½; one group per row);
- ``huffman_gptq``: 2^{R+1} − 1 levels, so R ≤ 3 at the nominal grid; its rate-targeted grid has 2⌈2^r − 1⌉ + 1
  levels and exports only where that is ≤ 16 (checked per layer); packing drops its entropy coding (4 bits a code);
- ``awq`` (dllmquant): the grid of Ŵ·diag(s), the layer dividing its input by s (``PackedLinear.input_scale``).
Which cannot, with one line naming why (``Quantizer.no_grid_reason``): ``watersic`` (unbounded, entropy-coded integer
codes with per-column steps and row/column rescalers; WaterSIC-FT retrains the rescalers) and any method that reports
no grid; a grid of more than 16 levels fails naming the layer.

On disk (``save_packed``): ``model.safetensors`` (the packed buffers, every other tensor as it is, tied weights once),
``buffers.safetensors`` (non-persistent buffers), ``config.json`` (the transformers config) and ``packed.json`` (the
packed layers and the format). ``load_packed`` builds the model on the meta device, swaps in the packed layers and
assigns the tensors, so loading never allocates the full-precision weights. It returns the transformers model: a
masked diffusion backbone (dllmquant) is wrapped again, ``MaskedDiffusionLM(load_packed(dir), mask_token_id)``.
A packed layer has no ``weight`` (code that reads ``.weight`` of a block linear, e.g. LoRA on top, needs the
full-precision model).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from callbacks.kernels.w4a16 import LEVELS, PackedLinear
from lightning_modules.common.quantize.base import AffineGrid, Quantizer

FORMAT = "paperlab-int4-affine-v1"
MANIFEST = "packed.json"
WEIGHTS = "model.safetensors"
BUFFERS = "buffers.safetensors"  # the non-persistent buffers (rotary frequencies), restored exactly


def grid_codes(weight: torch.Tensor, grid: AffineGrid, input_scale: torch.Tensor | None = None,
               tol: float = 0.05, name: str = "layer") -> torch.Tensor:
    """The integer codes (uint8) of a weight that lies on ``grid``; one line naming the layer when it does not."""
    if grid.levels > LEVELS:
        raise ValueError(f"{name}: its grid has {grid.levels} levels, a 4-bit code holds {LEVELS}: export a rate "
                         "with at most 16 levels (R ≤ 4 for rtn/gptq, R ≤ 3 for huffman_gptq)")
    w = weight.detach().double().cpu()
    if input_scale is not None:
        w = w * input_scale.double().cpu()
    rows, groups = grid.scale.shape
    w = w.reshape(rows, groups, -1)  # (row, group, member): the grid broadcasts over each group's members
    scale, zero = grid.scale.double()[..., None], grid.zero.double()[..., None]
    live = scale != 0  # zeroed rows (driver's zero_out_rows) decode to 0 with any code
    c = torch.where(live, w / torch.where(live, scale, 1.0) + zero, 0.0).reshape(weight.shape)
    codes = torch.round(c)
    off = float((c - codes).abs().max()) if c.numel() else 0.0
    if off > tol or codes.min() < 0 or codes.max() > grid.levels - 1:
        raise ValueError(f"{name}: the weight is not on its quantizer's grid ({off:.3g} of a step away, codes "
                         f"{int(codes.min())}..{int(codes.max())}): export right after quantization, before any "
                         "change to the weights")
    return codes.to(torch.uint8)


def pack_model(model: nn.Module, grids: dict[str, AffineGrid], input_scales: dict[str, torch.Tensor] | None = None,
               scale_dtype: torch.dtype = torch.float32, quantizer: Quantizer | None = None,
               impl: str = "auto") -> list[str]:
    """Replace every linear named in ``grids`` by its ``PackedLinear`` in place; returns their names."""
    if not grids:
        name = quantizer.name if quantizer is not None else "the quantizer"
        reason = quantizer.no_grid_reason if quantizer is not None else Quantizer.no_grid_reason
        raise ValueError(f"export_packed: {name} cannot be packed to 4 bits: {reason}; export rtn, gptq or awq "
                         "results, or unset model.export_packed")
    mods = dict(model.named_modules())
    input_scales = input_scales or {}
    for name, grid in grids.items():
        lin = mods.get(name)
        if type(lin) is not nn.Linear:  # a subclass (FakeQuantLinear) adds behaviour packing would drop
            raise ValueError(f"export_packed: {name} is a {type(lin).__name__}, not a plain nn.Linear: export the "
                             "weight-only quantized model")
        s_in = input_scales.get(name)
        codes = grid_codes(lin.weight, grid, s_in, name=name)
        dtype = lin.weight.dtype
        packed = PackedLinear.from_codes(codes, grid.scale, grid.zero,
                                         None if lin.bias is None else lin.bias.detach().cpu(),
                                         None if s_in is None else s_in.cpu(), scale_dtype=scale_dtype,
                                         dtype=dtype, impl=impl).to(lin.weight.device)
        parent, _, child = name.rpartition(".")
        setattr(mods[parent] if parent else model, child, packed)
    return list(grids)


def pack_skeleton(model: nn.Module, group_size: int | None = None, scale_dtype: torch.dtype = torch.float32,
                  dtype: torch.dtype | None = None) -> list[str]:
    """Swap every linear the driver quantizes (those inside the repeated blocks) for an empty ``PackedLinear`` on
    the meta device (``group_size`` None: one group per row, as the rtn/gptq export): the packed model's size by
    ``storage_bytes`` without any weights, e.g. of a paper-scale model from ``build_backbone(spec, meta=True)``."""
    from lightning_modules.common.quantize.driver import blocks

    names = {id(m): n for n, m in model.named_modules()}
    linears = [(names[id(m)], m) for blk in blocks(model) for m in blk.modules() if type(m) is nn.Linear]
    for name, lin in linears:
        layer = PackedLinear(lin.in_features, lin.out_features, group_size or lin.in_features, lin.bias is not None,
                             scale_dtype=scale_dtype, dtype=dtype or lin.weight.dtype, device="meta")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
    return [n for n, _ in linears]


def storage_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, each storage once (tied weights count once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.device, t.untyped_storage().data_ptr()) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def save_packed(model: nn.Module, path: str | Path, packed: list[str]) -> Path:
    """Write the packed model (module doc) to the directory ``path``."""
    from safetensors.torch import save_file, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    save_model(model, str(path / WEIGHTS), metadata={"format": FORMAT})  # tied weights are written once
    persistent = set(model.state_dict())
    transient = {n: b.contiguous() for n, b in model.named_buffers() if n not in persistent}  # rotary frequencies
    save_file(transient, str(path / BUFFERS))
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "packed": packed}, indent=1))
    return path


def load_packed(path: str | Path, device: str = "cpu", impl: str = "auto") -> nn.Module:
    """The model ``save_packed`` wrote, with its packed layers, on ``device`` (eval mode)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}, this code reads {FORMAT}")
    tensors = load_file(str(path / WEIGHTS), device=device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    mods = dict(model.named_modules())
    for name in manifest["packed"]:
        lin = mods[name]
        scales = tensors[f"{name}.scales"]
        layer = PackedLinear(lin.in_features, lin.out_features, lin.in_features // scales.shape[1],
                             lin.bias is not None, f"{name}.input_scale" in tensors, scales.dtype, device="meta",
                             impl=impl)
        parent, _, child = name.rpartition(".")
        setattr(mods[parent] if parent else model, child, layer)
    _, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if unexpected:
        raise ValueError(f"{path}: tensors the model does not have: {unexpected[:5]}")
    model.tie_weights()  # the tied copies, written once
    for name, buf in load_file(str(path / BUFFERS), device=device).items():
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent)._buffers[child] = buf
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{path}: tensors missing from the checkpoint: {left[:5]}")
    return model.eval()
