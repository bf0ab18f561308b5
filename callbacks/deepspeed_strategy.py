"""Lightning's DeepSpeedStrategy with the loss divided by the accumulation steps once.

Under automatic optimisation Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` (its closure)
and hands it to ``DeepSpeedEngine.backward``, which divides it by ``gradient_accumulation_steps`` again (its
``scale_wrt_gas``, on by default; Lightning sets those steps to ``accumulate_grad_batches``): every accumulated
gradient came out ``accumulate_grad_batches`` times too small, so a clip threshold (``gradient_clip_val``, HiCI's
own) acted on a gradient 16 times smaller than the recipe's in ``hici_llama7b`` (known since Lightning issue #6170).
Here the engine no longer rescales; the paper-scale DeepSpeed trainers (``conf/trainer/deepspeed_zero*.yaml``) and
the CPU strategy of tests and dry runs (``callbacks/deepspeed_cpu.py``) use it. Manual optimisation takes no
Lightning accumulation, so nothing changes there.

Lightning also clears every module's hooks before it builds the engine of a test / validate loop (to drop the
training engine's ZeRO-3 hooks). transformers installs its output-capturing hooks once per model and marks it
(``_output_capturing_hooks_installed``), so after the clearing a model returned no hidden states: LLaVA's image
features index them and ``real_vqa_llava15_7b`` stopped at its first test batch (``tuple index out of range``).
Here the marks are cleared with the hooks, and transformers installs them again at the next forward.
"""
from __future__ import annotations

from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy


class DeepSpeedStrategy(LightningDeepSpeedStrategy):
    def backward(self, closure_loss, optimizer, *args, **kwargs):
        kwargs.setdefault("scale_wrt_gas", False)  # Lightning's closure already divided by the accumulation steps
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _initialize_deepspeed_inference(self, model) -> None:
        super()._initialize_deepspeed_inference(model)
        for module in model.modules():  # Lightning removed transformers' capturing hooks: let them be installed again
            if getattr(module, "_output_capturing_hooks_installed", False):
                module._output_capturing_hooks_installed = False
