"""grpo_tiny, rloo_tiny and ps_ppo_tiny run end to end through run.py's path; the reward rises (slow)."""
import math

import pytest
import torch

from tests.helpers import SMOKE_WARMUP, compose, run_experiment


def recomputed_accuracy(experiment: str, overrides, tiny_lm_dir, state_dict) -> dict[str, float]:
    """Greedy exact-match accuracy of the given weights on the run's val and test problems, recomputed apart from
    the module: one prompt at a time (no padding) with ``transformers``' own ``generate``."""
    from hydra.utils import instantiate
    from transformers import AutoModelForCausalLM

    from lightning_modules.common.rl.rewards import exact_match_reward

    cfg = compose(experiment, list(overrides))
    dm = instantiate(cfg.data, _convert_="all")
    dm.setup()
    tok = dm.tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir))
    model.load_state_dict({k.removeprefix("model."): v for k, v in state_dict.items() if k.startswith("model.")})
    model.eval()
    out = {}
    for split, dataset in (("val", dm.val_set), ("test", dm.test_set)):
        right = 0
        for item in dataset:
            ids = torch.tensor([item["prompt_ids"]])
            with torch.no_grad():
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=cfg.model.max_new_tokens, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id)
            right += exact_match_reward(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True), item["answer"])
        out[split] = right / len(dataset)
    return out


@pytest.mark.parametrize("experiment", ["ps_ppo_tiny", "grpo_tiny", "rloo_tiny"])
def test_rl_tiny_smoke(experiment, tmp_path, tiny_lm_dir):
    # beyond debug=smoke: a smaller evaluation and the small cached warm-up (SMOKE_WARMUP, shared with hista's)
    overrides = ("debug=smoke", "data.n_val=16", *SMOKE_WARMUP)
    value, metrics = run_experiment(experiment, tmp_path, overrides=overrides)
    assert metrics["status"] == "ok" and metrics["global_step"] == 20
    final = metrics["final"]
    assert math.isfinite(final["train/loss"]) and math.isfinite(final["train/grad_norm"])
    assert 0 < final["train/response_length"] <= 16
    ratio = final["train/tokens_ratio"]
    if experiment == "ps_ppo_tiny":  # one step's sample of E[C]/T = (1 + p_full)/2 + O(1/T) ~ 0.63
        assert 0.2 < ratio < 1.0 and final["train/max_weight"] <= 1 / 0.2 + 1e-4
    else:
        assert ratio == 1.0 and final["train/max_weight"] == 1.0
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert state["global_step"] == 20 and any(k.startswith("model.") for k in state["state_dict"])
    # the reported accuracies are those of the final weights on the held-out val and test problems
    acc = recomputed_accuracy(experiment, overrides, tiny_lm_dir, state["state_dict"])
    assert value == pytest.approx(acc["val"]) and final["val/accuracy"] == pytest.approx(acc["val"])
    assert final["test/accuracy"] == pytest.approx(acc["test"])


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
