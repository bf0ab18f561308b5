"""The LM base module every paper subclasses.

A paper overrides one or two hooks, not the loop:

- ``build_model()``: return the (patched) backbone; the default builds ``backbone`` as specified.
- ``compute_loss(batch)``: return the training loss; the default is next-token cross-entropy.
- ``param_groups()``: the optimizer's parameter groups; the default is weight decay on matrices only.

The backbone is built in ``configure_model`` (not ``__init__``) so DeepSpeed ZeRO-3 and FSDP2 can
shard it as it is created; tests that want the model without a trainer call ``module.configure_model()``.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import lightning as L
import torch

from lightning_modules.common.backbone import build_backbone, count_parameters, numel


def _plain(obj):
    """Hyperparameters as plain containers, so checkpoints load with ``weights_only=True``."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(obj, (DictConfig, ListConfig)):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


class CausalLMModule(L.LightningModule):
    """Next-token language modelling on a transformers causal LM.

    Args:
        backbone: a backbone spec (see ``lightning_modules.common.backbone``).
        optimizer: a partial optimizer (``_partial_: true``), called with the parameter groups.
        scheduler: a partial LR scheduler called with the optimizer, or None; stepped every step.
        weight_decay: applied to matrices (dim >= 2) only; norms, biases and gains are left alone.
    """

    def __init__(self, backbone: Mapping[str, Any], optimizer: Callable | None = None,
                 scheduler: Callable | None = None, weight_decay: float = 0.0):
        super().__init__()
        self.backbone_spec = _plain(backbone)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.weight_decay = weight_decay
        # Partials are not plain data; the run dir's config.yaml records them instead.
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.hparams["backbone"] = self.backbone_spec
        self.model = None
        self._val_sum = self._val_count = None

    # --- model -----------------------------------------------------------------------------------
    def build_model(self):
        return build_backbone(self.backbone_spec)

    def configure_model(self) -> None:
        if self.model is None:
            # from_pretrained returns eval mode; follow the module's own mode so dropout trains as configured
            self.model = self.build_model().train(self.training)
        mesh = getattr(self, "device_mesh", None)
        if mesh is not None:  # FSDP2 through ModelParallelStrategy: shard each decoder layer, then the root
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self.model, FSDPModule):  # already sharded (test after fit calls this hook again)
                return
            if "tensor_parallel" in mesh.mesh_dim_names and mesh["tensor_parallel"].size() > 1:
                raise ValueError("trainer=fsdp with tensor_parallel_size>1: paperlab modules shard with FSDP2 over data "
                                 "parallelism only; set trainer.strategy.tensor_parallel_size=1")
            layers = self.decoder_layers()
            if not layers:
                raise ValueError(f"trainer=fsdp cannot shard {type(self.model).__name__}: no repeated decoder layers found; "
                                 "use trainer=ddp or a DeepSpeed trainer")
            dp_mesh = mesh["data_parallel"] if "data_parallel" in mesh.mesh_dim_names else mesh
            for layer in layers:
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)

    def decoder_layers(self) -> list[torch.nn.Module]:
        """The repeated transformer blocks (what FSDP shards and activation checkpointing wraps)."""
        for mod in self.model.modules():
            if isinstance(mod, torch.nn.ModuleList) and len(mod) > 0:
                return list(mod)
        return []

    def forward(self, input_ids, attention_mask=None, **kw):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kw)

    # --- loss ------------------------------------------------------------------------------------
    def compute_loss(self, batch) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                            use_cache=False).logits
        # transformers' own loss, its sum over the batch's target count floored at 1: a batch with no target (an SFT
        # prompt filling seq_len cut the answer off) gives 0 with zero gradients, not NaN, and no host sync per step
        labels = batch["labels"]
        targets = (labels[:, 1:] != -100).sum().clamp_min(1)
        return self.model.loss_function(logits, labels, vocab_size=logits.shape[-1], num_items_in_batch=targets)

    def training_step(self, batch, batch_idx):
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=batch["input_ids"].shape[0])
        return loss

    @torch.no_grad()
    def token_nll(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed next-token NLL and the number of predicted tokens (labels of -100 are ignored)."""
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False).logits
        labels = batch["labels"][:, 1:]
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        mask = labels != -100
        nll = -logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        return (nll * mask).sum(), mask.sum()

    def on_validation_epoch_start(self):
        self._val_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self._val_count = torch.zeros((), device=self.device, dtype=torch.float64)

    def validation_step(self, batch, batch_idx):
        s, n = self.token_nll(batch)
        self._val_sum += s.double()
        self._val_count += n.double()

    def on_validation_epoch_end(self):
        total, count = self._val_sum, self._val_count
        if self.trainer.world_size > 1:
            total, count = self.trainer.strategy.reduce(total, reduce_op="sum"), self.trainer.strategy.reduce(count, reduce_op="sum")
        loss = (total / count.clamp_min(1)).float()
        # token-weighted over the whole split, not a mean of batch means
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss), prog_bar=False, sync_dist=False)

    def on_test_epoch_start(self):
        self.on_validation_epoch_start()

    def test_step(self, batch, batch_idx):
        self.validation_step(batch, batch_idx)

    def on_test_epoch_end(self):
        total, count = self._val_sum, self._val_count
        if self.trainer.world_size > 1:
            total, count = self.trainer.strategy.reduce(total, reduce_op="sum"), self.trainer.strategy.reduce(count, reduce_op="sum")
        loss = (total / count.clamp_min(1)).float()
        self.log("test/loss", loss)
        self.log("test/ppl", torch.exp(loss))

    # --- optimisation ----------------------------------------------------------------------------
    def param_groups(self) -> list[dict]:
        """The optimizer factory's groups; a method that groups parameters its own way (LLR: one group per
        module) overrides this."""
        decay, no_decay = [], []
        for _, p in self.trainer.model.named_parameters() if self._trainer is not None else self.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.ndim >= 2 else no_decay).append(p)
        return [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def configure_optimizers(self):
        if self.optimizer_factory is None:
            raise ValueError(f"{type(self).__name__} has no optimizer: set model.optimizer in the config")
        optimizer = self.optimizer_factory(params=[g for g in self.param_groups() if g["params"]])
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def parameter_counts(self) -> dict[str, int]:
        if self.model is None:
            return {}
        return {"params/total": count_parameters(self.model),
                "params/non_embedding": count_parameters(self.model, non_embedding=True),
                "params/trainable": sum(numel(p) for p in self.model.parameters() if p.requires_grad)}


def warmup_cosine(optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warmup to the peak LR at step ``warmup_steps``, then cosine decay to ``min_ratio`` of it at step
    ``total_steps``, steps counted from 1 as in the released codes (GaLore / LLR): optimizer step t gets
    t/warmup_steps, then min_ratio + (1 - min_ratio)·½(1 + cos(π (t - warmup)/(total - warmup))).

    LambdaLR calls the multiplier with the number of scheduler steps taken so far, which Lightning counts from 0
    (the optimizer step t runs with the multiplier at t - 1), hence the ``+ 1``."""

    def factor(step: int) -> float:
        t = step + 1
        if t < warmup_steps:
            return t / warmup_steps
        progress = min(1.0, (t - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
