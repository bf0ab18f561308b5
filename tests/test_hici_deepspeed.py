"""HiCI's HiCI-only gradient clip under DeepSpeed ZeRO (CPU processes through callbacks/deepspeed_cpu.py).

Under ZeRO-2/3 ``p.grad`` is not the full gradient and Lightning's DeepSpeed precision plugin ignores clipping, so
the module reads and writes full gradients with ``safe_get_full_grad`` / ``safe_set_full_grad``. With plain SGD
(lr 1) one optimizer step moves each parameter by exactly its (clipped) gradient, so the step itself shows what
DeepSpeed applied: HiCI parameters moved by a vector of norm CLIP, the others by their unclipped gradient.
"""
import os

import pytest
import torch

pytestmark = pytest.mark.slow
CLIP = 0.01  # the recipe's 0.3 does not bite on this tiny model's small HiCI gradients at init


@pytest.mark.parametrize("stage,accumulate", [(2, 1), (3, 1), (2, 2)])
def test_hici_clip_survives_deepspeed_zero(stage, accumulate, tmp_path):
    """``accumulate`` 2: DeepSpeed accumulates inside its engine and Lightning calls the optimizer hooks on every
    micro-batch; the clip must wait for the boundary (the full gradient does not exist before it: the paper-scale
    recipe's 16-step accumulation stopped at its first micro-batch)."""
    import lightning as L
    from functools import partial

    from lightning_modules.hici.module import HiCILongContextLM, is_hici_param
    from callbacks.deepspeed_cpu import CPUDeepSpeedStrategy

    os.environ.setdefault("MASTER_PORT", str(29500 + stage + 10 * accumulate))
    spec = dict(family="llama", pretrained=None, dtype="float32", attn_implementation="sdpa",
                config=dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    hici = dict(heads=4, bottleneck_dim=32, compress_dim=8, expand_dim=32, integrator_heads=4, causal_mode="none")
    x = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(0))

    def fresh():
        torch.manual_seed(0)
        m = HiCILongContextLM(spec, optimizer=partial(torch.optim.SGD, lr=1.0), hici=hici, hici_lr=1.0,
                              hici_grad_clip=CLIP)
        m.configure_model()  # built right after seeding: both copies start from the same weights
        return m

    # reference: the same model's full gradients without any clipping, computed directly
    ref = fresh()
    ref.compute_loss({"input_ids": x, "labels": x}).backward()
    before = {n: p.detach().clone() for n, p in ref.model.named_parameters() if p.requires_grad}
    grads = {n: p.grad.detach().clone() for n, p in ref.model.named_parameters() if p.requires_grad}
    hici_norm = torch.linalg.vector_norm(torch.stack([g.norm() for n, g in grads.items() if is_hici_param(n)]))
    assert hici_norm > CLIP  # the clip must bite for this test to mean anything

    module = fresh()
    seen = {}

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # runs before the module's own hook
            seen["p.grad_is_full"] = all(p.grad is not None and p.grad.numel() == p.numel()
                                         for p in pl_module.hici_parameters())

    loader = torch.utils.data.DataLoader([{"input_ids": x[i], "labels": x[i]} for i in range(2)],
                                         batch_size=2 // accumulate)  # the same two rows per optimizer step
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=CPUDeepSpeedStrategy(stage=stage), precision="32-true",
                        max_steps=1, accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Probe()], default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=loader)

    from deepspeed.utils import safe_get_full_fp32_param

    moved_hici, moved_other = [], []
    for name, p in module.model.named_parameters():
        if name not in before:
            continue
        delta = before[name] - safe_get_full_fp32_param(p).detach().reshape(before[name].shape)
        (moved_hici if is_hici_param(name) else moved_other).append((delta, grads[name]))
    assert moved_hici and moved_other
    hici_step = torch.linalg.vector_norm(torch.stack([d.norm() for d, _ in moved_hici]))
    assert hici_step.item() == pytest.approx(CLIP, rel=1e-3)  # clipped over the full HiCI gradient
    coef = CLIP / hici_norm
    for d, g in moved_hici:
        torch.testing.assert_close(d, g * coef, atol=1e-5, rtol=1e-3)
    for d, g in moved_other:  # LoRA / embeddings / norms: unclipped
        torch.testing.assert_close(d, g, atol=1e-5, rtol=1e-3)
    if stage == 3:
        assert seen["p.grad_is_full"] is False  # what makes the DeepSpeed accessors necessary


def test_long_context_eval_and_export_on_every_rank_under_two_process_zero3(tmp_path, tiny_lm_dir):
    """ZeRO-3 with 2 CPU processes: the long-context evaluation runs on every rank, and its figures equal a
    single-process recomputation from the exported `full` model, which is gathered from the partitions before it is
    written and equals the one built from the converted checkpoint (see tests/test_hici_fsdp.py)."""
    import json

    from hydra.utils import instantiate
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict
    from transformers import AutoModelForCausalLM

    from tests.helpers import compose
    from tests.test_hici import SMOKE, full_model_figures
    from tests.test_strategies import STRATEGIES, run_py

    run_dir = tmp_path / "zero3"
    proc = run_py(["experiment=hici_tiny", *SMOKE, *STRATEGIES["deepspeed_zero3"], "trainer.max_steps=4",
                   "trainer.val_check_interval=4", "logger=csv"], run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["global_step"] == 4
    convert_zero_checkpoint_to_fp32_state_dict(str(run_dir / "checkpoints" / "last.ckpt"), str(tmp_path / "fp32.ckpt"))
    cfg = compose("hici_tiny", list(SMOKE))  # the run's model and data (the strategy does not enter them)
    module = instantiate(cfg.model, _convert_="all")
    module.configure_model()
    module.load_state_dict(torch.load(tmp_path / "fp32.ckpt", map_location="cpu", weights_only=False)["state_dict"])
    want_weights = module.full_model().state_dict()
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf_full").state_dict()
    assert exported.keys() == want_weights.keys()
    for k in want_weights:
        torch.testing.assert_close(exported[k], want_weights[k], msg=k)
    want = full_model_figures(run_dir, SMOKE, "hici_tiny")
    assert {k: metrics["results"][k] for k in want} == pytest.approx(want, rel=1e-4)
