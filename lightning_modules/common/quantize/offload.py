"""Quantizing and evaluating a model larger than one GPU: the weights stay in host memory and one block at a time
visits the GPU (the way GPTQ implementations run a 70B model on one 80 GB card).

- ``BlockwiseRunner`` is the driver's view of the model under ``offload``: the calibration batches' inputs to the
  first block are computed once (embeddings on the GPU), kept in host memory, and carried block by block — the
  full-precision model's and the quantized model's separately in sequential mode. While block *i* is quantized, it
  (and its reference copy) sit on the GPU and every input the driver needs (a layer's, a norm's for residual
  compensation, the attention probabilities for the BOS fix, ``o_proj``'s for the ε search) is captured by running
  that block alone on the cached hidden states. The driver's arithmetic is unchanged: the same groups, statistics
  and budget as the in-memory path (``tests/test_watersic_tiny.py`` checks the weights agree), at the cost of one
  forward per block instead of one per layer group through every earlier block.
- ``stream_blocks`` makes any whole-model forward (the evaluation's) run on one GPU: everything outside the blocks
  moves to the GPU, and each block moves there for its own forward and back after it.
"""
from __future__ import annotations

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device as _to  # tensors in nested kwargs

from lightning_modules.common.quantize.calibration import MomentCollector, _Stop, stop_at

SIDES = ("model", "reference")


def blocks(model) -> list[torch.nn.Module]:
    """The repeated transformer blocks: the first non-empty ModuleList."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
            return list(mod)
    raise ValueError(f"{type(model).__name__} has no ModuleList of blocks to quantize")


def move_outside_blocks(model, device) -> None:
    """Every parameter and buffer that is not inside a block, to ``device`` (in place: tied weights stay tied)."""
    inside = {id(m) for b in blocks(model) for m in b.modules()}
    for mod in model.modules():
        if id(mod) in inside:
            continue
        for p in mod._parameters.values():
            if p is not None:
                p.data = p.data.to(device)
        for k, b in mod._buffers.items():
            if b is not None:
                mod._buffers[k] = b.to(device)


def _output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def block_inputs(model, batches: list[dict], device) -> tuple[list[torch.Tensor], list[dict]]:
    """Each batch's input to the first block and the keyword arguments the model passes every block (mask, positions,
    rotary embeddings), in host memory: the model runs up to its first block (on ``device``) and stops there."""
    first = blocks(model)[0]
    hidden, kwargs = [], []

    def hook(mod, args, kw):
        x = args[0] if args else kw["hidden_states"]
        hidden.append(x.detach().cpu())
        kwargs.append(_to({k: v for k, v in kw.items() if k != "hidden_states"}, "cpu"))
        raise _Stop

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for b in batches:
            try:
                mask = b.get("attention_mask")
                model(input_ids=b["input_ids"].to(device), use_cache=False,
                      **({} if mask is None else {"attention_mask": mask.to(device)}))
            except _Stop:
                pass
    finally:
        handle.remove()
    if len(hidden) != len(batches):
        raise RuntimeError("the forward pass never reached the first block")
    if len({getattr(b, "attention_type", None) for b in blocks(model)}) > 1:
        raise ValueError(f"{type(model).__name__} mixes attention types across blocks (sliding and full): the "
                         "offloaded driver passes every block the first one's mask; run it without model.offload")
    return hidden, kwargs


class BlockwiseRunner:
    """The driver's capture functions for one block at a time (module doc). ``stages`` yields each block's index;
    between two yields the driver quantizes that block's groups, and the runner then carries the hidden states past
    it (before quantizing, in plain mode, whose statistics are all the full-precision model's)."""

    def __init__(self, model, reference, batches: list[dict], device, sequential: bool, eager_weights: bool):
        self.model, self.reference, self.batches, self.device = model, reference, batches, torch.device(device)
        self.sequential = sequential
        move_outside_blocks(model, self.device)
        hidden, self.kwargs = block_inputs(model, batches, self.device)
        self.hidden = {"model": hidden, "reference": [h.clone() for h in hidden] if sequential else None}
        self.eager_kwargs = self.kwargs
        if eager_weights and getattr(reference.config, "_attn_implementation", None) != "eager":
            impl = model.config._attn_implementation
            model.set_attn_implementation("eager")  # the explicit causal mask eager attention needs
            try:
                self.eager_kwargs = block_inputs(model, batches, self.device)[1]
            finally:
                model.set_attn_implementation(impl)
        move_outside_blocks(model, "cpu")
        self.layers = {"model": blocks(model), "reference": blocks(reference) if sequential else None}
        self.index = -1

    def _run(self, side: str, i: int, kwargs: dict | None = None):
        block = self.layers[side][self.index]
        kw = _to(self.kwargs[i] if kwargs is None else kwargs, self.device)
        return _output(block(self.hidden[side][i].to(self.device), **kw))

    def capture(self, side: str, module, i: int) -> torch.Tensor:
        """The input of ``module`` (inside the current block) on batch ``i``, for the quantized model or the
        full-precision reference."""
        return stop_at(module, lambda: self._run(side, i))

    def attention_probs(self, attn, i: int) -> torch.Tensor:
        """The reference block's attention probabilities on batch ``i`` (eager attention returns them)."""
        impl = self.reference.config._attn_implementation
        if impl != "eager":
            self.reference.set_attn_implementation("eager")
        try:
            return stop_at(attn, lambda: self._run("reference", i, self.eager_kwargs[i]), output_index=1)
        finally:
            if impl != "eager":
                self.reference.set_attn_implementation(impl)

    def plain_moments(self, keys: dict, stats_device, weights: list) -> tuple[dict, dict]:
        """Σ of each group's input over the batches, the block still in full precision, carrying the hidden states
        past it on the way (plain mode)."""
        with MomentCollector(keys, device=stats_device) as col:
            for i in range(len(self.batches)):
                col.weight = weights[i]
                self.hidden["model"][i] = self._run("model", i).cpu()
        return col.moments(), col.counts

    def stages(self):
        for index in range(len(self.layers["model"])):
            self.index = index
            here = [self.layers[s][index] for s in SIDES if self.layers[s] is not None]
            for block in here:
                block.to(self.device)
            try:
                yield index
                if self.sequential:  # the quantized block and its reference carry their own hidden states on
                    for side in SIDES:
                        self.hidden[side] = [self._run(side, i).cpu() for i in range(len(self.batches))]
            finally:
                for block in here:
                    block.to("cpu")


def stream_blocks(model, device) -> list:
    """Let whole-model forwards run on one GPU with the blocks in host memory: the rest moves to ``device``, and each
    block visits it for its own forward. Returns the hook handles (``h.remove()`` ends the streaming)."""
    device = torch.device(device)
    move_outside_blocks(model, device)

    def arrive(mod, args):
        mod.to(device)

    def leave(mod, args, out):
        mod.to("cpu")

    handles = []
    for block in blocks(model):
        handles += [block.register_forward_pre_hook(arrive), block.register_forward_hook(leave)]
    return handles
