"""Lightning's DeepSpeedStrategy on CPU processes, for tests and ``debug=dryrun`` (DeepSpeed itself trains on CPU
with gloo).

Lightning refuses a CPU accelerator for DeepSpeed; three overrides lift that:

- ``setup_environment``: skip the "only CUDA GPUs" check;
- ``setup_distributed``: skip the CUDA device-index validation;
- ``_setup_model_and_optimizer``: hand ``deepspeed.initialize`` the local rank as device rank (a CPU device has
  no index);

and, for validate/test without an optimizer, ``_initialize_deepspeed_inference`` gets the same device-rank fix.

Use from a config (runner.check_config refuses DeepSpeed on CPU unless told this is a test or a dry run)::

    python run.py experiment=lm_tiny trainer=deepspeed_zero3 trainer.accelerator=cpu trainer.devices=2 \
        trainer.precision=32-true trainer.strategy._target_=callbacks.deepspeed_cpu.CPUDeepSpeedStrategy \
        +allow_deepspeed_cpu=true

with ``DS_ACCELERATOR=cpu`` in the environment (set here too, before DeepSpeed is imported) and
``TORCH_EXTENSIONS_DIR`` in the user cache (DeepSpeed compiles a communication op on first use, ~30-70 s).
"""
from __future__ import annotations

import argparse
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
    os.environ.get("PAPERLAB_CACHE", os.path.expanduser("~/.cache/paperlab")), "torch_extensions"))

from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from lightning.fabric.utilities.seed import reset_seed  # noqa: E402

from callbacks.deepspeed_strategy import DeepSpeedStrategy  # noqa: E402  (the loss divided by accumulation once)


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeedStrategy that accepts CPU devices (gloo process group); ZeRO stages 1-3 as configured."""

    def setup_environment(self) -> None:
        # DeepSpeedStrategy.setup_environment refuses anything but CUDAAccelerator; go straight to DDP's.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        # As DeepSpeedStrategy.setup_distributed, minus _validate_device_index_selection (CUDA indices only).
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        params = filter(lambda p: p.requires_grad, model.parameters())
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=params,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model) -> None:
        # validate/test without an optimizer: the same device-rank fix for Lightning's inference engine.
        import deepspeed

        original = deepspeed.initialize

        def initialize(*args, **kwargs):
            ns = kwargs.get("args")
            if ns is not None and getattr(ns, "device_rank", None) is None:
                ns.device_rank = self.local_rank
            return original(*args, **kwargs)

        deepspeed.initialize = initialize
        try:
            super()._initialize_deepspeed_inference(model)
        finally:
            deepspeed.initialize = original
