"""Grow a trained MoE checkpoint (depth by layer copying, width by noisy expert duplication), then keep training.

``build_model`` loads ``growth.source``, applies the operators of ``lightning_modules.growth.operators`` in
``growth.order`` (``depth_first``: the paper's 17B -> 35B -> 70B run) and returns the grown model; continued
pretraining is the base module's loop with a fresh optimizer (the growth edits weights only). ``metrics.json``'s
``parameters`` record the source and grown sizes, the active parameters N_a and the compute: 6·N_a·D of the
continued training, the source's 6·N_a·D (from ``growth.source_tokens``) and its Chinchilla point
F_c = 6·N_a·(20·N_a), past which the paper finds interposition ahead of stacking.

Under DeepSpeed ZeRO-3 every rank would otherwise hold the whole grown model: global rank 0 grows it once into
``growth.grown_dir`` (weights only, like the paper's offline checkpoint-growth tool) and every rank then loads that
checkpoint straight into its partitions.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from callbacks.deepspeed_hf import unpartitioned
from lightning_modules.growth import operators as ops
from lightning_modules.common.backbone import build_backbone
from lightning_modules.common.lm import CausalLMModule, _plain

ORDERS = ("depth_first", "width_first")


def chinchilla_flops(active_params: int) -> float:
    """F_c = 6·N_a·D with D = 20·N_a tokens (Chinchilla-optimal)."""
    return 6.0 * active_params * 20 * active_params


def grow_in_order(model, g: Mapping[str, Any]) -> dict:
    """Apply the enabled operators of ``growth`` config ``g`` to ``model`` in place, in ``g.order``; returns the maps
    applied (``depth_index``, ``expert_order``)."""
    maps = {}
    steps = ("depth", "width") if g.get("order", "depth_first") == "depth_first" else ("width", "depth")
    for step in steps:
        cfg = {k: v for k, v in g.get(step, {}).items() if k != "enabled"}
        if not g.get(step, {}).get("enabled"):
            continue
        if step == "depth":
            maps["depth_index"] = ops.grow_depth(model, **cfg)
        else:
            maps["expert_order"] = ops.grow_width(model, seed=g.get("seed", 0), **cfg)
    return maps


class GrowthModule(CausalLMModule):
    """Args (beyond ``CausalLMModule``'s):
        growth: ``source`` (a checkpoint dir, hub id or ``tiny-moe``), ``order``, ``depth`` (``enabled``, ``method``,
            ``factor``, ``ignore_first``, ``ignore_last``, ``zerofy_output``, ``weight_multiplier``,
            ``multiplier_scope``; defaults and the release's choices in ``operators.py``), ``width``
            (``enabled``, ``factor``, ``alpha``, ``sigma_over``, ``placement``, ``router_init``), ``seed`` (noise),
            ``source_tokens`` (tokens the source was trained on; null = unknown).
    """

    def __init__(self, backbone: Mapping[str, Any], growth: Mapping[str, Any], optimizer: Callable | None = None,
                 scheduler: Callable | None = None, weight_decay: float = 0.0):
        super().__init__(backbone, optimizer, scheduler, weight_decay)
        self.growth = _plain(growth)
        self._check(self.growth, self.backbone_spec.get("config") or {})
        self.source_counts: dict[str, int] = {}
        self.results: dict[str, list] = {}  # metrics.json's results: the maps applied and the per-layer norm curves
        self.tokens_seen = 0

    @staticmethod
    def _check(g: Mapping[str, Any], source: Mapping[str, Any]) -> None:
        """Bad growth settings, one line each, before the source is loaded (``source``: the backbone's recorded
        architecture; the operators check the loaded model again)."""
        if not g.get("source"):
            raise ValueError("model.growth.source is missing: set backbone.pretrained=<source checkpoint dir> "
                             "(or tiny-moe for the toy source)")
        if g.get("order", "depth_first") not in ORDERS:
            raise ValueError(f"model.growth.order={g.get('order')!r}: choose one of {', '.join(ORDERS)}")
        depth, width = g.get("depth", {}), g.get("width", {})
        if not depth.get("enabled") and not width.get("enabled"):
            raise ValueError("growth grows nothing: set model.growth.depth.enabled=true and/or model.growth.width.enabled=true "
                             "(training from scratch is model=lm)")
        if depth.get("enabled"):
            ops.check_factor(depth.get("factor", 2), "depth")
            ignored = depth.get("ignore_first", 0) + depth.get("ignore_last", 0)
            layers = source.get("num_hidden_layers")
            if layers and ignored >= layers:
                raise ValueError(f"model.growth.depth.ignore_first + ignore_last = {ignored} leaves none of the {layers} "
                                 f"layers to copy: make their sum < {layers}")
        if width.get("enabled"):
            ops.check_factor(width.get("factor", 2), "width")
            if source and not (source.get("num_local_experts") or source.get("num_experts")):
                raise ValueError("width growth needs an MoE source (the backbone has no experts): grow a dense model "
                                 "in depth only (model.growth.width.enabled=false)")

    def build_model(self):
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        if not is_deepspeed_zero3_enabled():
            return self.grow()
        out = Path(self.growth["grown_dir"])
        if self.trainer.global_rank == 0 and not (out / "config.json").exists():
            with unpartitioned():
                self.grow().save_pretrained(str(out))
        self.trainer.strategy.barrier("growth")
        return build_backbone({**self.backbone_spec, "pretrained": str(out)})

    def grow(self):
        """The source, loaded and grown in ``growth.order``."""
        g = self.growth
        model = build_backbone({**self.backbone_spec, "pretrained": g["source"]})
        self.source_counts = ops.parameter_counts(model)
        self.results = {"norm_profile_source": ops.layer_norm_profile(model)}
        self.results.update(grow_in_order(model, g))
        self.results["norm_profile_grown"] = ops.layer_norm_profile(model)
        return model

    @classmethod
    def preflight_model(cls, model_cfg: Mapping[str, Any], backbone):
        """The meta source grown as ``grow`` grows it (``common/preflight.py``): the grown model trains in full."""
        from lightning_modules.common.preflight import Trained, count_text

        def size() -> str:
            counts = ops.parameter_counts(backbone)
            return f"{count_text(counts['total'])} ({count_text(counts['active'])} active)"

        source = size()
        grow_in_order(backbone, model_cfg["growth"])
        return Trained(backbone, notes=[f"grown from {source} to {size()}"])

    def training_step(self, batch, batch_idx):
        self.tokens_seen += batch["input_ids"].numel()
        return super().training_step(batch, batch_idx)

    def parameter_counts(self) -> dict[str, int]:
        out = super().parameter_counts()
        if self.model is None:
            return out
        active, src_active = ops.parameter_counts(self.model)["active"], self.source_counts.get("active", 0)
        world = self.trainer.world_size if self._trainer is not None else 1
        out.update({"growth/source_total": self.source_counts.get("total", 0), "growth/source_active": src_active,
                    "growth/active": active, "growth/flops": 6.0 * active * self.tokens_seen * world,
                    "growth/source_chinchilla_flops": chinchilla_flops(src_active)})
        if self.growth.get("source_tokens"):
            out["growth/source_flops"] = 6.0 * src_active * self.growth["source_tokens"]
        return out
