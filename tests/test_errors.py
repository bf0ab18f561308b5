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


def _cli(overrides, tmp_path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    """``python run.py <overrides>`` as a user types it (Hydra's short errors, not HYDRA_FULL_ERROR's traces)."""
    run_dir = tmp_path / "run"
    full = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run([sys.executable, "run.py", *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**full, "OMP_NUM_THREADS": "1", **env})
    return proc, run_dir


def _the_one_line(proc: subprocess.CompletedProcess, run_dir: Path) -> str:
    """The one stderr line of a failed run, checked against what the run recorded; nothing was built."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    line = lines[0]
    assert line.startswith("error: ") and " — " in line, line  # error: <what> — <the fix>
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "failed: " + line[len("error: "):]
    # no checkpoints, logs or exports: only Hydra's record, the log and the failure record
    assert {p.name for p in run_dir.iterdir()} <= {".hydra", "run.log", "metrics.json"}
    return line


# Every error the runner raises before anything is built (runner.check_config, one case per raise site), and the
# three a new user meets first (issue 43): each one line on stderr naming its fix, non-zero exit, nothing built.
# Two raise sites import Lightning to decide (~10 s a subprocess): they run in-process below, through the same path.
CASES = {
    "task": (["task=train"], "choose one of fit, test, fit_test, validate"),
    "optimized_mode": (["optimized_mode=maximum"], "choose min (lower is better) or max"),
    "gpu_without_cuda": (["trainer=gpu"], "use trainer=cpu"),
    "fsdp_one_device": (["trainer=fsdp", "trainer.devices=1"], "set trainer.devices>=2"),
    "fsdp_tensor_parallel": (["trainer=fsdp", "trainer.strategy.tensor_parallel_size=2"],
                             "set trainer.strategy.tensor_parallel_size=1"),
    "deepspeed_on_cpu": (["trainer=deepspeed_zero3", "trainer.accelerator=cpu"],
                         "on CPU use trainer=ddp or trainer=fsdp"),
    "deepspeed_string_on_cpu": (["+trainer.strategy=deepspeed_stage_3"], "on CPU use trainer=ddp or trainer=fsdp"),
    "missing_checkpoint_dir": (["backbone.pretrained=/no/such/checkpoint"], "pass backbone.pretrained=<dir with config.json"),
    "missing_ckpt_path": (["ckpt_path=/no/such.ckpt"], "or ckpt_path=last to resume"),
    "seed_not_an_integer": (["seed=abc"], "pass one, e.g. seed=1"),  # a typo in a swept value
    "token_limit_not_a_number": (["max_in_memory_tokens=lots"], "pass a number of tokens (e.g. 1e9)"),
    # a constructor's ValueError that names a config value (the project's convention, hundreds of sites)
    "bad_value_in_a_constructor": (["data.val_fraction=0.8", "data.test_fraction=0.5"], "change data.val_fraction"),
    "no_data_files": (["data.source=files", "data.files={tmp}/none/*.txt"], "set data.files=<path, glob or folder>"),
    "tiny_model_not_built": (["experiment=hici_tiny"], "run `python -m datamodules.common.tiny_models build tiny-lm`"),
    "no_hub": (["experiment=grpo_qwen25_7b", "trainer=cpu"], "pass backbone.pretrained=<local dir>"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_user_error_is_one_line_naming_the_fix(case, tmp_path):
    if case == "gpu_without_cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    overrides, fix = CASES[case]
    env = {}
    if case == "tiny_model_not_built":  # a fresh cache: tiny-lm is not built yet, and a user's shell builds nothing
        env.update(PAPERLAB_CACHE=str(tmp_path / "cache"), PAPERLAB_BUILD_TINY_MODELS="0")
    if case == "no_hub":  # a node without hub access and an empty hub cache
        env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"))
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    if not any(o.startswith("experiment=") for o in overrides):
        overrides = ["experiment=lm_tiny", *overrides]
    line = _the_one_line(*_cli(overrides, tmp_path, **env))
    assert fix in line, line
    if case == "no_hub":
        assert "HF_HUB_OFFLINE" in line
    if case == "tiny_model_not_built":
        assert not list((tmp_path / "cache").glob("tiny_models/*/*/config.json"))  # and nothing was built there


def test_not_a_number_is_one_line_before_anything_is_built(tmp_path):
    from runner import ConfigError

    with pytest.raises(ConfigError) as info:
        _run(["model.optimizer.lr=abc"], tmp_path)
    msg = _one_line(info.value)
    assert "model.optimizer.lr='abc' is not a number" in msg and "pass one, e.g. model.optimizer.lr=0.001" in msg
    _nothing_built(tmp_path)


def test_full_error_shows_the_trace(tmp_path):
    proc, _ = _cli(["experiment=lm_tiny", "task=train"], tmp_path, HYDRA_FULL_ERROR="1")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ConfigError: task='train' is not a task" in proc.stderr


def test_user_errors_are_told_from_bugs(monkeypatch):
    from hydra.errors import InstantiationException

    import datamodules.common.errors as errors
    from datamodules.common.errors import ConfigError, user_error

    fixable = ConfigError("x=1 is wrong — set x=2")
    try:  # Hydra wraps an error raised in a constructor
        raise InstantiationException("Error in call to target 'm.M':\nConfigError(...)") from fixable
    except InstantiationException as err:
        assert user_error(err) is fixable
    try:  # an error raised while handling a fixable one is a bug of its own
        try:
            raise fixable
        except ConfigError:
            raise KeyError("bug")  # noqa: B904 - the point: raised while handling, not from it
    except KeyError as err:
        assert user_error(err) is None
    assert user_error(RuntimeError("bug")) is None
    # a ValueError naming a config value is the config's; one that names none (or a subclass) stays a bug
    told = user_error(ValueError("model.loss_type='x': choose one of ppo, dapo"))
    assert isinstance(told, ConfigError) and str(told).endswith("— change model.loss_type (in the experiment's config "
                                                                 "or on the command line)")
    assert user_error(ValueError("shapes (3,) and (4,) do not align")) is None
    assert user_error(ValueError("x=1 is odd")) is None  # not a dotted config key
    # a missing module that an extra of pyproject.toml provides names its pip line; a project module is a bug
    monkeypatch.setattr(errors, "_installed", lambda name: False)
    assert "pip install -c constraints.txt -e '.[instemb]'" in str(user_error(ModuleNotFoundError(name="mteb")))
    assert user_error(ModuleNotFoundError(name="lightning_modules.no_such_paper")) is None
    monkeypatch.setattr(errors, "_installed", lambda name: True)  # installed, but without that submodule: a bug
    assert user_error(ModuleNotFoundError(name="mteb.no_such_module")) is None


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


def test_hub_loaders_name_their_key_and_hf_hub_offline(tmp_path):
    """Every loader that meets a missing hub (or a dir without the files) says so in one line naming its config key;
    the test session runs with HF_HUB_OFFLINE=1, so a hub id is a hub that cannot be reached."""
    from datamodules.common.errors import PretrainedNotFoundError
    from datamodules.common.tokenizer import load_tokenizer
    from lightning_modules.common.backbone import build_backbone
    from lightning_modules.common.embedding import load_encoder
    from lightning_modules.common.judge import HFLocalJudge

    hub_id = "no-such-org/no-such-model"
    for load, key in ((lambda: load_tokenizer(hub_id), "data.tokenizer.pretrained"),
                      (lambda: build_backbone({"family": "llama", "pretrained": hub_id}), "backbone.pretrained"),
                      (lambda: load_encoder(hub_id, key="model.dpp.encoder"), "model.dpp.encoder"),
                      (lambda: HFLocalJudge(path=hub_id).reply("2 + 2?"), "judge.path")):
        with pytest.raises(PretrainedNotFoundError) as info:
            load()
        msg = _one_line(info.value)
        assert f"{key}={hub_id!r}" in msg and f"{key}=<local dir>" in msg and "HF_HUB_OFFLINE" in msg, msg
    # a local dir without the files (transformers 5 raises a ValueError there), named with its key
    with pytest.raises(PretrainedNotFoundError, match=r"data\.tokenizer\.pretrained=.* holds no loadable tokenizer "
                                                      r"\((ValueError|OSError): .*\) — point data\.tokenizer\.pretrained "
                                                      r"at a dir"):
        load_tokenizer(str(tmp_path))


def test_in_memory_token_limit_counts_the_global_batch_and_can_be_raised(monkeypatch):
    import datamodules.common.errors as errors
    from runner import ConfigError, check_config

    monkeypatch.setattr(errors, "_offline", lambda: False)  # its tokenizer is a hub id: as on a node with the hub
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
