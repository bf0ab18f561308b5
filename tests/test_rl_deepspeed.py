"""The RL module's gradient clip under DeepSpeed ZeRO (CPU processes through callbacks/deepspeed_cpu.py).

Manual optimisation forbids ``trainer.gradient_clip_val``, so Lightning would configure the engine with
``gradient_clipping: 0`` (no clip) while the module skips its own clip under ZeRO (partitioned gradients). The
module's ``setup`` hands ``model.max_grad_norm`` to the engine. Planted: a huge loss through the module's own
``_step``; with plain SGD (lr 1) one step moves the weights by exactly the gradient DeepSpeed applied, which must
be the full gradient rescaled to norm CLIP.
"""
import os
from functools import partial

import pytest
import torch

CLIP = 0.5


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_rl_clip_reaches_deepspeed_engine(stage, tmp_path):
    import lightning as L

    from lightning_modules.common.rl.module import RLModule
    from callbacks.deepspeed_cpu import CPUDeepSpeedStrategy

    os.environ.setdefault("MASTER_PORT", str(29510 + stage))
    spec = dict(family="llama", pretrained=None, dtype="float32", attn_implementation="sdpa",
                config=dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": x, "labels": x}

    class Planted(RLModule):  # the RL module's optimizer step, fed a planted huge loss instead of a rollout
        def training_step(self, batch, batch_idx):
            self.manual_backward(1e4 * self.compute_loss(batch))
            self._step()

    def fresh():
        torch.manual_seed(0)
        m = Planted(spec, optimizer=partial(torch.optim.SGD, lr=1.0), max_grad_norm=CLIP)
        m.configure_model()
        return m

    ref = fresh()
    (1e4 * ref.compute_loss(batch)).backward()
    before = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in ref.model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert norm > 10 * CLIP  # the clip must bite

    module = fresh()
    loader = torch.utils.data.DataLoader([{k: v[i] for k, v in batch.items()} for i in range(2)], batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=CPUDeepSpeedStrategy(stage=stage), precision="32-true",
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=loader)
    assert trainer.strategy.config["gradient_clipping"] == CLIP

    from deepspeed.utils import safe_get_full_fp32_param

    deltas = {n: before[n] - safe_get_full_fp32_param(p).detach().reshape(before[n].shape)
              for n, p in module.model.named_parameters()}
    step = torch.linalg.vector_norm(torch.stack([d.norm() for d in deltas.values()]))
    assert step.item() == pytest.approx(CLIP, rel=1e-3)
    for n, d in deltas.items():  # the same direction: the full gradient, rescaled
        torch.testing.assert_close(d, grads[n] * (CLIP / norm), atol=1e-6, rtol=1e-3)


def test_deepspeed_clip_conflict_is_one_line():
    from types import SimpleNamespace

    from lightning_modules.common.rl.module import RLModule

    class DeepSpeedStrategy(SimpleNamespace):  # only the name and the config matter to setup
        pass

    m = RLModule(dict(family="llama", pretrained=None), max_grad_norm=1.0)
    m._trainer = SimpleNamespace(strategy=DeepSpeedStrategy(config={"gradient_clipping": 0.3}), gradient_clip_val=None)
    with pytest.raises(ValueError, match="set only model.max_grad_norm"):
        m.setup("fit")
    m._trainer.strategy.config = {}
    m.setup("fit")
    assert m._trainer.strategy.config["gradient_clipping"] == 1.0
    # at ZeRO-3 the config is already formatted when setup runs (callbacks.deepspeed_hf.HFZero3Init): Lightning wrote
    # its own default, trainer.gradient_clip_val or 0.0 (null under manual optimisation); that is no conflict
    m._trainer.strategy.config = {"gradient_clipping": 0.0}
    m.setup("fit")
    assert m._trainer.strategy.config["gradient_clipping"] == 1.0
