"""Tell transformers that DeepSpeed ZeRO-3 is on while the module builds its backbone.

Lightning's DeepSpeedStrategy builds the model in ``configure_model`` inside ``deepspeed.zero.Init``, which
partitions every parameter as it is created; transformers' weight init then indexes an empty shard and fails
(``index 1 is out of bounds for dimension 0 with size 0``). With an ``HfDeepSpeedConfig`` alive, transformers
skips that init and re-initialises each module with its parameters gathered (``initialize_weights_zero3``), and
``from_pretrained`` loads straight into the partitions. ``run`` adds this callback whenever the strategy is
DeepSpeed; it does nothing below stage 3.

The config stays alive for the whole run (``generate`` reads it), so a model loaded later with ``from_pretrained``
would be partitioned too, with no engine to gather it: a frozen helper (a reward model, a judge, an encoder) or an
unsharded copy for export is built inside :func:`unpartitioned`.
"""
from __future__ import annotations

import contextlib

import lightning as L


@contextlib.contextmanager
def unpartitioned():
    """Models built inside are whole: transformers' ZeRO-3 loading path and any active ``deepspeed.zero.Init``
    (Lightning's, around ``configure_model``) are off for the block and back on after it. A no-op without DeepSpeed."""
    from transformers.integrations import deepspeed as hf_ds

    try:
        from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context
    except ImportError:  # no DeepSpeed: nothing is partitioned
        yield
        return
    ref = hf_ds._hf_deepspeed_config_weak_ref
    shutdown_init_context()
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref
        restore_init_context()


class HFZero3Init(L.Callback):
    def __init__(self) -> None:
        self._hf_config = None  # transformers holds only a weakref: this keeps it alive for the run

    def setup(self, trainer, pl_module, stage: str) -> None:
        strategy = trainer.strategy
        if not getattr(strategy, "zero_stage_3", False):
            return
        from transformers.integrations.deepspeed import HfDeepSpeedConfig

        strategy._init_config_if_needed()  # what model_sharded_context does next; idempotent
        self._hf_config = HfDeepSpeedConfig(strategy.config)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._hf_config is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            self._hf_config = None
