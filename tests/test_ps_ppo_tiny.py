"""grpo_tiny, rloo_tiny and ps_ppo_tiny run end to end through run.py's path; the reward rises (slow)."""
import math

import pytest
import torch

from tests.helpers import run_experiment


@pytest.mark.parametrize("experiment", ["ps_ppo_tiny", "grpo_tiny", "rloo_tiny"])
def test_rl_tiny_smoke(experiment, tmp_path, tiny_lm_dir):
    value, metrics = run_experiment(experiment, tmp_path, overrides=("debug=smoke", "data.n_val=16"))
    assert metrics["status"] == "ok" and metrics["global_step"] == 20
    final = metrics["final"]
    assert math.isfinite(final["train/loss"]) and math.isfinite(final["train/grad_norm"])
    assert 0.0 <= value <= 1.0 and 0.0 <= final["test/accuracy"] <= 1.0
    assert 0 < final["train/response_length"] <= 16
    ratio = final["train/tokens_ratio"]
    if experiment == "ps_ppo_tiny":  # one step's sample of E[C]/T = (1 + p_full)/2 + O(1/T) ~ 0.63
        assert 0.2 < ratio < 1.0 and final["train/max_weight"] <= 1 / 0.2 + 1e-4
    else:
        assert ratio == 1.0 and final["train/max_weight"] == 1.0
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert state["global_step"] == 20 and any(k.startswith("model.") for k in state["state_dict"])


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["ps_ppo_tiny", "grpo_tiny"])
def test_rl_tiny_reward_rises(experiment, tmp_path, tiny_lm_dir):
    """60 RL steps on a fixed pool of 16 prompts (G=8): the sampled-rollout reward of the last 15 steps beats the
    first 15 (the warmed-up policy is right ~85% of the time at temperature 1; RL sharpens it)."""
    import pandas as pd

    run_experiment(experiment, tmp_path, overrides=("trainer.val_check_interval=60", "data.n_train=16", "data.n_val=16",
                                                    "model.group_size=8", "model.optimizer.lr=1e-4"))
    log = pd.read_csv(next(tmp_path.rglob("metrics.csv")))
    r = log["train/reward"].dropna().to_numpy()
    assert len(r) >= 50
    assert r[-15:].mean() > r[:15].mean() + 0.02, (r[:15].mean(), r[-15:].mean())
