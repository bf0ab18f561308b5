"""Growing a trained MoE checkpoint: more layers (depth) and more experts (width), on the weights only.

Operators on a transformers causal LM, in place, no training code (``lightning_modules/growth`` trains). Where the
spec is silent the authors' release (github Mr-Philo/Orthogonal-Model-Growth: ``growth/algorithm.py`` and the
Megatron script the paper ran, ``integration/megatron/Offline_checkpoint_growth.py``) is the default; our variants
stay behind named switches.

- ``grow_depth``: n decoder layers -> factor·n. *Interposition* puts each copy right after its original
  (l1, l1', l2, l2', ...), *stacking* repeats the whole stack (l1..ln, l1..ln). ``ignore_first`` / ``ignore_last``
  source layers are not duplicated (the release's README: the paper ignores 2 on each side for its 3B and 17B runs;
  0 here, see conf/model/growth.yaml). Stacking follows the release's map for every factor: the first pass holds
  layers [0, n − ignore_last), every later pass layers [ignore_first, n) (for factor 2 this is the same as keeping
  the ignored ends once; for factor > 2 the top ``ignore_last`` layers recur in every later pass).
  ``zerofy_output`` zeroes the copies' residual-branch outputs (attention o_proj, the experts' down_proj), which
  makes the growth function-preserving. A layer's first occurrence is its original, every later one a copy: the
  release instead treats the whole first stacking pass as the originals, so with ``ignore_last`` > 0 it would zero
  the only occurrence of the top layers; ours keeps them, as ``zerofy_output`` exists to preserve the function.
  ``weight_multiplier`` m with ``multiplier_scope``: ``all`` (the release, default) multiplies every tensor of every
  grown decoder layer by m, originals and ignored layers included (embeddings, final norm and head untouched);
  ``copy_outputs`` (ours) multiplies only the copies' output projections, so m interpolates between an identity
  init (m = 0, = ``zerofy_output``) and a plain copy (m = 1) and the source layers keep their function. m = 1 (the
  paper's runs) makes the two the same.
- ``grow_width``: E experts -> factor·E and top-k -> factor·k. Every expert and router row is copied; each copy
  gets N(0, (α σ)²) noise. ``sigma_over``: ``expert`` (the release's per-expert layout, default): σ of the copied
  expert's own tensor, its fused fc1 (gate and up together, as Megatron's ``linear_fc1.weight<i>`` stores them) and
  its fc2; ``matrix`` (ours): σ of each of the expert's gate, up and down matrices separately (noise relative to
  each matrix's own scale when the gate and up halves differ in scale); ``tensor``: σ of the whole stacked tensor of
  all experts (the release's legacy grouped-GEMM layout). The router's σ is its whole matrix's in every case. With
  α = 0 the duplicated pairs tie in the router, both are chosen, each gets half its original's probability
  (renormalised top-k or not), so the output is unchanged.
- ``layer_norm_profile``: the per-layer weight RMS whose smoothness interposition keeps and stacking breaks.

They target transformers 5's MoE layout, ``model.model.layers[i].mlp.gate`` (router weight (E, H), ``top_k``,
``num_experts``) and ``.mlp.experts`` (fused ``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)) as in Mixtral and
OLMoE, and rewrite the config (layer count, expert count, top-k, ``layer_types``) and every attention's
``layer_idx``, so the KV cache and ``save_pretrained`` / ``from_pretrained`` keep working.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_modules.common.backbone import numel, shape

DEPTH_METHODS = ("interposition", "stack")
PLACEMENTS = ("append", "interleave")
SIGMA_OVER = ("expert", "matrix", "tensor")
MULTIPLIER_SCOPES = ("all", "copy_outputs")
ROUTER_INITS = ("copy", "random")
RANDOM_ROUTER_STD = 0.02  # the random-router ablation's N(0, 0.02²)
# Parameters that end a residual branch: zeroing them in a copied layer makes that layer the identity.
_OUTPUT_PROJECTIONS = ("o_proj.weight", "o_proj.bias", "down_proj", "down_proj.weight", "down_proj.bias")
# Load-balancing expert biases (aux-loss-free balancing); expanded and zeroed by width growth.
_EXPERT_BIASES = ("expert_bias", "e_score_correction_bias")


def check_factor(factor, what: str) -> int:
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
        raise ValueError(f"model.growth.{what}.factor={factor!r}: use an integer >= 2 (the paper grows by 2)")
    return factor


def depth_index_map(n_layers: int, method: str = "interposition", factor: int = 2,
                    ignore_first: int = 0, ignore_last: int = 0) -> list[int]:
    """The source layer of every grown layer (0-based). Interposition: layers outside [ignore_first, n - ignore_last)
    are kept once; stacking: the release's passes (module docstring).

    >>> depth_index_map(3)                  # l1 l1' l2 l2' l3 l3'
    [0, 0, 1, 1, 2, 2]
    >>> depth_index_map(3, "stack")         # l1 l2 l3 l1 l2 l3
    [0, 1, 2, 0, 1, 2]
    >>> depth_index_map(4, "stack", factor=3, ignore_first=1, ignore_last=1)  # the release's passes
    [0, 1, 2, 1, 2, 3, 1, 2, 3]
    """
    check_factor(factor, "depth")
    if method not in DEPTH_METHODS:
        raise ValueError(f"model.growth.depth.method={method!r}: choose one of {', '.join(DEPTH_METHODS)}")
    if min(ignore_first, ignore_last) < 0 or ignore_first + ignore_last >= n_layers:
        raise ValueError(f"model.growth.depth.ignore_first + ignore_last = {ignore_first} + {ignore_last} leaves none of the "
                         f"{n_layers} layers to copy: make their sum < {n_layers}")
    if method == "stack":  # the release: one pass of [0, n - ignore_last), then factor - 1 of [ignore_first, n)
        return [*range(n_layers - ignore_last), *list(range(ignore_first, n_layers)) * (factor - 1)]
    body = range(ignore_first, n_layers - ignore_last)
    return [*range(ignore_first), *(i for i in body for _ in range(factor)), *range(n_layers - ignore_last, n_layers)]


def _layers(model) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"growth needs a decoder with model.model.layers; {type(model).__name__} has none")
    return layers


@torch.no_grad()
def grow_depth(model, method: str = "interposition", factor: int = 2, ignore_first: int = 0, ignore_last: int = 0,
               zerofy_output: bool = False, weight_multiplier: float = 1.0, multiplier_scope: str = "all") -> list[int]:
    """Copy decoder layers in place; returns the index map. Copies are deep copies of their source (fresh tensors).
    ``weight_multiplier`` scales every tensor of every grown layer (``multiplier_scope=all``, the release) or only the
    copies' output projections (``copy_outputs``); ``zerofy_output`` then zeroes the copies' output projections."""
    if multiplier_scope not in MULTIPLIER_SCOPES:
        raise ValueError(f"model.growth.depth.multiplier_scope={multiplier_scope!r}: choose one of "
                         f"{', '.join(MULTIPLIER_SCOPES)}")
    layers = _layers(model)
    index = depth_index_map(len(layers), method, factor, ignore_first, ignore_last)
    m = float(weight_multiplier)
    seen, grown = set(), []
    for src in index:
        layer, is_copy = layers[src], src in seen  # a later occurrence is the copy
        if is_copy or (m != 1.0 and multiplier_scope == "all"):
            layer = copy.deepcopy(layer)  # the release multiplies fresh tensors: the source model stays intact
        for name, p in layer.named_parameters():
            if is_copy and name.endswith(_OUTPUT_PROJECTIONS):
                if zerofy_output:
                    p.zero_()
                    continue
                if multiplier_scope == "copy_outputs":
                    p.mul_(m)
            if multiplier_scope == "all" and m != 1.0:
                p.mul_(m)
        seen.add(src)
        grown.append(layer)
    model.model.layers = nn.ModuleList(grown)
    for i, layer in enumerate(grown):  # the KV cache is indexed by layer_idx
        for mod in layer.modules():
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = i
    config = model.config
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in index]
    config.num_hidden_layers = len(grown)
    return index


def moe_blocks(model) -> list[nn.Module]:
    """The MoE blocks (``mlp`` with a router ``gate.weight`` and fused ``experts``) of every decoder layer."""
    return [layer.mlp for layer in _layers(model) if _is_moe(getattr(layer, "mlp", None))]


def _is_moe(block) -> bool:
    return (block is not None and isinstance(getattr(getattr(block, "gate", None), "weight", None), torch.Tensor)
            and hasattr(getattr(block, "experts", None), "gate_up_proj"))


def expert_order(num_experts: int, factor: int = 2, placement: str = "append") -> list[int]:
    """The source expert of every grown expert: append = 0..E-1, 0..E-1; interleave = 0, 0, 1, 1, ..."""
    if placement not in PLACEMENTS:
        raise ValueError(f"model.growth.width.placement={placement!r}: choose one of {', '.join(PLACEMENTS)}")
    if placement == "append":
        return list(range(num_experts)) * factor
    return [e for e in range(num_experts) for _ in range(factor)]


def _copy_flags(order: list[int]) -> torch.Tensor:
    seen, flags = set(), []
    for e in order:
        flags.append(e in seen)
        seen.add(e)
    return torch.tensor(flags)


def _noisy(source: torch.Tensor, order: list[int], alpha: float, sigma: torch.Tensor, gen) -> torch.Tensor:
    """Rows ``order`` of ``source``; copies get N(0, (alpha·sigma)²), sigma broadcast per expert (E, 1, ...)."""
    grown = source[order].clone()
    if alpha and not grown.is_meta:  # a meta model (parameter counting) has no values to perturb
        is_copy = _copy_flags(order).to(source.device)
        noise = torch.randn(grown.shape, generator=gen, dtype=torch.float32).to(grown)
        std = (alpha * sigma[order]).to(grown)
        grown += noise * std * is_copy.view(-1, *[1] * (grown.dim() - 1)).to(grown)
    return grown


def _sigma(weight: torch.Tensor, sigma_over: str, splits: int = 1) -> torch.Tensor:
    """σ per expert, shaped to broadcast over (E, rows, cols): of each expert's tensor (``expert``; a fused gate_up
    as one tensor, as the release's per-expert fc1), of each of its ``splits`` matrices (``matrix``: a fused gate_up
    split back into its gate and up matrices) or of the whole stacked tensor (``tensor``)."""
    w = weight.detach().float()
    E = w.shape[0]
    if sigma_over == "tensor":
        return w.std().expand(E, 1, 1)
    splits = splits if sigma_over == "matrix" else 1
    parts = w.reshape(E, splits, -1, w.shape[-1])
    return parts.std(dim=(2, 3)).repeat_interleave(w.shape[1] // splits, dim=1).unsqueeze(-1)


@torch.no_grad()
def grow_width(model, factor: int = 2, alpha: float = 0.01, sigma_over: str = "expert", placement: str = "append",
               router_init: str = "copy", seed: int = 0) -> list[int]:
    """Duplicate every expert of every MoE block in place (E -> factor·E, top-k -> factor·k); returns the expert order.

    ``router_init=random`` gives the new router rows N(0, 0.02²) instead of noisy copies (the ablation)."""
    check_factor(factor, "width")
    if sigma_over not in SIGMA_OVER:
        raise ValueError(f"model.growth.width.sigma_over={sigma_over!r}: choose one of {', '.join(SIGMA_OVER)}")
    if router_init not in ROUTER_INITS:
        raise ValueError(f"model.growth.width.router_init={router_init!r}: choose one of {', '.join(ROUTER_INITS)}")
    if alpha < 0:
        raise ValueError(f"model.growth.width.alpha={alpha}: the noise scale must be >= 0 (paper: 0.01)")
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError(f"width growth needs an MoE ({type(model).__name__} has no router + experts blocks): "
                         "grow a dense model in depth only (model.growth.width.enabled=false)")
    gen = torch.Generator().manual_seed(seed)
    num_experts = blocks[0].gate.weight.shape[0]
    order = expert_order(num_experts, factor, placement)
    for block in blocks:
        gate, experts = block.gate, block.experts
        router = gate.weight
        router_sigma = router.detach().float().std().expand(num_experts, 1)  # one router matrix: its std
        new_router = _noisy(router, order, alpha, router_sigma, gen)
        if router_init == "random":
            is_copy = _copy_flags(order).to(router.device)
            new_router[is_copy] = torch.randn(new_router[is_copy].shape, generator=gen).to(new_router) * RANDOM_ROUTER_STD
        gate.weight = nn.Parameter(new_router, requires_grad=router.requires_grad)
        for name, splits in (("gate_up_proj", 2), ("down_proj", 1)):
            w = getattr(experts, name)
            setattr(experts, name, nn.Parameter(_noisy(w, order, alpha, _sigma(w, sigma_over, splits), gen),
                                                requires_grad=w.requires_grad))
        for mod in (block, gate, experts):
            if hasattr(mod, "num_experts"):
                mod.num_experts = len(order)
            if hasattr(mod, "top_k"):
                mod.top_k *= factor
            for bias in _EXPERT_BIASES:  # balancing state does not carry over to the new expert set
                b = getattr(mod, bias, None)
                if isinstance(b, torch.Tensor):
                    zeros = torch.zeros(len(order), dtype=b.dtype, device=b.device)
                    setattr(mod, bias, nn.Parameter(zeros, requires_grad=b.requires_grad)
                            if isinstance(b, nn.Parameter) else zeros)
    config = model.config
    config.num_experts_per_tok *= factor
    config.num_experts = len(order)  # Mixtral maps it to num_local_experts, OLMoE stores it
    for attr in ("num_experts", "num_experts_per_tok"):  # the causal-LM head keeps copies for the aux loss
        if hasattr(model, attr):
            setattr(model, attr, getattr(config, attr))
    return order


def parameter_counts(model) -> dict[str, int]:
    """Total and active parameters (all parameters minus the experts a token does not use: (E - k)/E of them)."""
    total = sum(numel(p) for p in model.parameters())  # ZeRO-3 partitions: the full counts, not the local ones
    inactive = 0
    for block in moe_blocks(model):
        E, k = shape(block.gate.weight)[0], block.gate.top_k
        expert_params = sum(numel(p) for p in block.experts.parameters())
        inactive += expert_params * (E - k) // E
    return {"total": total, "active": total - inactive}


@torch.no_grad()
def layer_norm_profile(model) -> list[float]:
    """The RMS of each decoder layer's weight matrices (dim >= 2): the per-layer norm curve of a trained model."""
    profile = []
    for layer in _layers(model):
        mats = [p.detach().float() for p in layer.parameters() if p.dim() >= 2]
        sq = sum(m.pow(2).sum() for m in mats)
        profile.append(float((sq / sum(m.numel() for m in mats)).sqrt()))
    return profile
