"""Export the trained backbone in transformers format (``save_pretrained``), with its tokenizer.

Sharded strategies hold only a slice of each weight per rank; the full weights are gathered first, on every
rank (a collective), and rank 0 writes them: ZeRO-3 through ``deepspeed.zero.GatheredParameters``, FSDP2
(DTensor parameters) through ``get_model_state_dict(full_state_dict=True)``.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import lightning as L


def _is_dtensor_model(model) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


class ExportPretrained(L.Callback):
    """``publish_as``: the cached tiny model (``datamodules/common/tiny_models.py``) this export is, when the run is
    that model's experiment as configured (``python run.py`` builds ``tiny-lm`` this way).
    ``at_steps``: also write snapshots during training, ``<dirpath>_step<N>`` after optimizer step N (the sources of
    a growth sunk-cost study)."""

    def __init__(self, dirpath: str, publish_as: str | None = None, at_steps: list[int] | None = None):
        self.dirpath = Path(dirpath)
        self.publish_as = publish_as
        self.at_steps = set(at_steps or ())

    def on_train_start(self, trainer, pl_module):
        self._snapshot(trainer, pl_module)  # step 0: the initialisation

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._snapshot(trainer, pl_module)

    def _snapshot(self, trainer, pl_module) -> None:
        step = trainer.global_step
        if step in self.at_steps:  # the first batch end after optimizer step N (once, also under accumulation)
            self.at_steps.discard(step)
            self._save(trainer, pl_module, self.dirpath.with_name(f"{self.dirpath.name}_step{step}"))

    def on_train_end(self, trainer, pl_module):
        self._save(trainer, pl_module, self.dirpath)
        if trainer.global_rank == 0 and self.publish_as:
            from hydra.core.hydra_config import HydraConfig

            from datamodules.common.tiny_models import publish

            hc = HydraConfig.get()
            publish(self.publish_as, self.dirpath, hc.runtime.choices.get("experiment"), list(hc.overrides.task))

    def _save(self, trainer, pl_module, dirpath: Path) -> None:
        model = getattr(pl_module, "export_model", lambda: pl_module.model)()
        state_dict = None
        gather = contextlib.nullcontext()
        if getattr(trainer.strategy, "zero_stage_3", False):
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)
        elif _is_dtensor_model(model):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        with gather:
            if trainer.global_rank == 0:
                dirpath.mkdir(parents=True, exist_ok=True)
                model.save_pretrained(str(dirpath), state_dict=state_dict)
        if trainer.global_rank != 0:
            return
        dm = trainer.datamodule
        if dm is not None and getattr(dm, "tokenizer", None) is not None:
            dm.tokenizer.save_pretrained(str(dirpath))
