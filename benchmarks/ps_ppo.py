"""PS-PPO vs full-trajectory GRPO, side by side in one invocation (issue 5 benchmark).

Arms (same warmed-up tiny policy, same seed -> same prompt stream, same number of updates):
  grpo            full trajectories
  ps_ppo p=0.1    mixture_full cutoffs, E[C]/T ~ (1 + 0.1)/2
  ps_ppo p=0.2    mixture_full cutoffs, E[C]/T ~ (1 + 0.2)/2
Each arm runs ``run.py`` in its own subprocess (``model.measure_activations=true`` counts the bytes autograd
saves per micro-batch with saved-tensor hooks; on GPU ``max_memory_allocated`` is logged too). Reported per arm:
response tokens backpropagated per update (ΣC_i) against ΣT_i, prompt tokens, update-pass wall time per update,
peak saved-activation MB (largest micro-batch), saved-activation MB summed over an update's micro-batches,
variance of the pre-clip gradient norm across updates, reward over the first and last quarter of updates, and
final greedy accuracy; then ratios against GRPO.

    python -m benchmarks.ps_ppo                  # 30 updates, micro-batch 4 rows
    python -m benchmarks.ps_ppo --updates 40 --group-size 8 --experiment-args data.n_train=16 data.n_val=16 \
        model.optimizer.lr=1e-4                  # the figures in the report (fixed pool of 16 prompts)
    python -m benchmarks.ps_ppo --updates 200 --micro-batch 1 --experiment-args data.task=word_problems
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_arm(name: str, experiment: str, extra: list[str], args, out: Path) -> dict:
    import pandas as pd

    cmd = [sys.executable, str(ROOT / "run.py"), f"experiment={experiment}", f"hydra.run.dir={out}",
           f"trainer.max_steps={args.updates}", f"trainer.val_check_interval={args.updates}", "logger=csv",
           "callbacks.progress_bar=null", "callbacks.model_checkpoint=null", "model.measure_activations=true",
           f"model.micro_batch_size={args.micro_batch}", f"data.batch_size={args.prompts}",
           f"model.group_size={args.group_size}", f"seed={args.seed}", "task=fit", *extra, *args.experiment_args]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"arm {name} failed:\n{proc.stderr[-3000:]}")
    log = pd.read_csv(next(out.rglob("metrics.csv")))
    tr = log.dropna(subset=["train/reward"])
    q = max(1, len(tr) // 4)
    metrics = json.loads((out / "metrics.json").read_text())
    return {"arm": name, "updates": len(tr),
            "resp_tokens_bp": tr["train/tokens_backprop"].mean(), "resp_tokens_full": tr["train/tokens_full"].mean(),
            "prompt_tokens": tr["train/prompt_tokens"].mean(), "update_s": tr["train/update_s"].iloc[1:].mean(),
            "saved_act_mb": tr["train/saved_act_mb"].max(), "saved_act_mb_sum": tr["train/saved_act_mb_sum"].mean(),
            "grad_norm_var": tr["train/grad_norm"].var(),
            "max_weight": tr["train/max_weight"].max(), "reward_first": tr["train/reward"].iloc[:q].mean(),
            "reward_last": tr["train/reward"].iloc[-q:].mean(),
            "val_accuracy": metrics["final"].get("val/accuracy", float("nan"))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--prompts", type=int, default=4, help="prompts per update")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per forward/backward (sorted by kept length)")
    p.add_argument("--p-full", type=float, nargs="+", default=[0.1, 0.2])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experiment-args", nargs="*", default=[], help="extra overrides for every arm")
    args = p.parse_args(argv)
    arms = [("grpo", "grpo_tiny", [])] + [(f"ps_ppo p={q}", "ps_ppo_tiny", [f"model.p_full={q}"]) for q in args.p_full]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ps_ppo_bench-") as tmp:
        for i, (name, exp, extra) in enumerate(arms):
            rows.append(run_arm(name, exp, extra, args, Path(tmp) / f"arm{i}"))
            print(f"done: {name}", file=sys.stderr)
    base = rows[0]
    cols = ["arm", "resp_tokens_bp", "resp_tokens_full", "prompt_tokens", "update_s", "saved_act_mb", "saved_act_mb_sum",
            "grad_norm_var",
            "max_weight", "reward_first", "reward_last", "val_accuracy"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(r[c] if isinstance(r[c], str) else f"{r[c]:.4g}" for c in cols))
    print("\nratios vs grpo:")
    for r in rows[1:]:
        print(f"  {r['arm']}: tokens {r['resp_tokens_bp'] / base['resp_tokens_bp']:.3f}x  "
              f"time {r['update_s'] / base['update_s']:.3f}x  peak act {r['saved_act_mb'] / base['saved_act_mb']:.3f}x  "
              f"act summed over micro-batches {r['saved_act_mb_sum'] / base['saved_act_mb_sum']:.3f}x  "
              f"gnvar {r['grad_norm_var'] / max(base['grad_norm_var'], 1e-12):.3f}x  "
              f"reward(last quarter) {r['reward_last']:.3f} vs {base['reward_last']:.3f}")
    return rows


if __name__ == "__main__":
    main()
