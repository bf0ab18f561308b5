"""Bad input gets one clear line naming the fix, before any expensive work; a diverging run stops at the first
non-finite loss and keeps its last good checkpoint."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import compose

ROOT = Path(__file__).resolve().parents[1]


def _run(overrides, tmp_path):
    from runner import run

    return run(compose("lm_tiny", [*overrides, "callbacks.progress_bar=null"], output_dir=tmp_path))


def _one_line(err: BaseException) -> str:
    msg = str(err)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def _nothing_built(tmp_path: Path) -> None:
    # only the failure record: no checkpoints, logs or exports (the error came before anything was built)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
    assert json.loads((tmp_path / "metrics.json").read_text())["status"].startswith("failed")


def test_unknown_experiment_lists_known_ones():
    proc = subprocess.run([sys.executable, "run.py", "experiment=no_such_paper_tiny"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, HYDRA_FULL_ERROR="0"))
    assert proc.returncode != 0
    err = proc.stderr
    assert "Could not find 'experiment/no_such_paper_tiny'" in err
    assert "Available options in 'experiment'" in err
    for known in ("lm_tiny", "lm_llama7b"):
        assert f"\t{known}\n" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("overrides,match", [
    (["task=train"], "task='train': choose one of fit, test, fit_test, validate"),
    (["trainer=fsdp", "trainer.devices=1"], "trainer=fsdp with trainer.devices=1"),
    (["trainer=deepspeed_zero3", "trainer.accelerator=cpu"], "DeepSpeed needs GPUs"),
    (["+trainer.strategy=deepspeed_stage_3"], "DeepSpeed needs GPUs"),  # Lightning's string form too
    (["trainer=fsdp", "trainer.strategy.tensor_parallel_size=2"], "trainer=fsdp with tensor_parallel_size>1"),
    (["backbone.pretrained=/no/such/checkpoint"], "backbone.pretrained='/no/such/checkpoint' does not exist"),
    (["ckpt_path=/no/such.ckpt"], "ckpt_path='/no/such.ckpt' does not exist"),
])
def test_bad_config_fails_fast_with_one_line(overrides, match, tmp_path):
    from runner import ConfigError

    with pytest.raises(Exception, match=match.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as info:
        _run(overrides, tmp_path)
    _one_line(info.value)
    if "pretrained" not in match:
        assert isinstance(info.value, ConfigError)
    _nothing_built(tmp_path)


def test_deepspeed_on_cpu_allowed_only_when_asked(tmp_path):
    from runner import check_config

    cfg = compose("lm_tiny", ["trainer=deepspeed_zero3", "trainer.accelerator=cpu", "+allow_deepspeed_cpu=true",
                              "trainer.strategy._target_=callbacks.deepspeed_cpu.CPUDeepSpeedStrategy"])
    check_config(cfg)  # the test-only escape hatch passes the check


def test_pretraining_scale_in_memory_data_refused_before_anything_is_built(tmp_path):
    from runner import ConfigError, run

    # lm_llama7b's recipe with in-memory data, on one CPU rank: 100000 steps x (4 x 1 x 4 accumulation) x 4096 tokens
    cfg = compose("lm_llama7b", ["data=corpus", "trainer=cpu", "callbacks.progress_bar=null"], output_dir=tmp_path)
    with pytest.raises(ConfigError) as info:
        run(cfg)
    msg = _one_line(info.value)
    assert f"{100000 * 16 * 4096:.3g} tokens" in msg and "max_in_memory_tokens=1e+09" in msg
    assert "data=shards" in msg and "python -m datamodules.common.shards --files" in msg
    _nothing_built(tmp_path)


def test_in_memory_token_limit_counts_the_global_batch_and_can_be_raised():
    from runner import ConfigError, check_config

    check_config(compose("lm_llama7b", ["trainer=cpu"]))  # as shipped it streams shards: no limit
    check_config(compose("lm_tiny"))
    # lm_tiny is 8 x 256 tokens a step: 1e9 tokens are 488281.25 steps on one rank, 244140.6 on two
    check_config(compose("lm_tiny", ["trainer.max_steps=488281"]))
    for over in (["trainer.max_steps=488282"], ["trainer.max_steps=244141", "trainer.accumulate_grad_batches=2"],
                 ["trainer.max_steps=244141", "trainer.num_nodes=2"]):
        with pytest.raises(ConfigError, match="data=shards"):
            check_config(compose("lm_tiny", over))
    check_config(compose("lm_tiny", ["trainer.max_steps=488282", "max_in_memory_tokens=2e9"]))
    check_config(compose("lm_tiny", ["trainer.max_steps=488282", "task=test"]))  # nothing trains


def test_malformed_data_record_names_file_and_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "first document"}\n{"text": "second"}\n{"text": "third, cut off\n{"text": "fourth"}\n')
    with pytest.raises(Exception, match=rf"{data}:3: malformed JSON record") as info:
        _run(["data.source=files", f"data.files={data}", "task=fit", "trainer.max_steps=1"], tmp_path / "run")
    _one_line(info.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_nan_guard_stops_and_keeps_last_good_checkpoint(tmp_path):
    from callbacks.nan_guard import NonFiniteLossError

    # lr 1e4 (warmup to it over 50 steps): finite loss for two steps, then NaN
    overrides = ["task=fit", "trainer.max_steps=10", "trainer.val_check_interval=1", "data.max_val_sequences=8",
                 "trainer.log_every_n_steps=1", "model.optimizer.lr=1.0e4"]
    with pytest.raises(NonFiniteLossError, match=r"is (nan|inf|non-finite) at step \d+: stopping; the last good checkpoint is kept") as info:
        _run(overrides, tmp_path)
    _one_line(info.value)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["status"].startswith("failed: NonFiniteLossError")
    stopped_at = metrics["global_step"]
    assert stopped_at < 10

    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert 0 < ckpt["global_step"] <= stopped_at
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())
    # "good": the saved weights still give a finite loss (the diverged ones were never written)
    from omegaconf import OmegaConf

    from lightning_modules.common.lm import CausalLMModule

    cfg = compose("lm_tiny", overrides)
    module = CausalLMModule(backbone=OmegaConf.to_container(cfg.backbone, resolve=True))
    module.configure_model()
    module.load_state_dict(ckpt["state_dict"])
    x = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert math.isfinite(module.model(input_ids=x, labels=x).loss.item())
