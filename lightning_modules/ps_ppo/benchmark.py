"""PS-PPO vs full-trajectory GRPO, side by side in one invocation: compute, peak activation memory, reward.

Arms (same warmed-up tiny policy, same seed -> same prompt stream, same number of updates; grpo_tiny packs like
ps_ppo_tiny since issue 38, the padded arm overrides it):
  grpo padded          full trajectories, each micro-batch padded to its longest row (``model.packing=false``)
  grpo packed          full trajectories, a micro-batch's rows packed into one unpadded row (``model.packing=true``)
  ps_ppo packed p=0.1  mixture_full cutoffs, E[C]/T ~ (1 + 0.1)/2, packed
  ps_ppo packed p=0.2  mixture_full cutoffs, E[C]/T ~ (1 + 0.2)/2, packed
Each arm runs ``run.py`` in its own subprocess (``model.measure_activations=true`` counts the bytes autograd
saves per micro-batch with saved-tensor hooks; on GPU ``max_memory_allocated`` is logged too). Padding makes a
micro-batch cost its longest member, and mixture_full always keeps some full-length row, so only packing lets
activation memory follow the sum of kept tokens. Per arm: response tokens backpropagated per update (ΣC_i) against
ΣT_i, update-pass wall time per update, saved-activation MB (the largest micro-batch of an update, mean ± SE over
updates, and the run's maximum), gradient-norm variance, reward over the last quarter of updates (mean ± SE),
final greedy accuracy; then ratios against GRPO packed. Claims go to ``benchmarks/results/ps_ppo.json``
(target: PS-PPO packed peak ≤ 0.65× GRPO packed at matched reward within noise).

    python -m benchmarks ps_ppo                  # 30 updates, micro-batch 4 rows: 1.4 min measured
    python -m benchmarks ps_ppo --quick          # 4 updates, one PS-PPO arm: proves the pipeline
    python -m benchmarks ps_ppo --updates 40 --group-size 8 --experiment-args data.n_train=16 data.n_val=16 \
        model.optimizer.lr=1e-4                  # a fixed pool of 16 prompts
    python -m benchmarks ps_ppo --updates 200 --micro-batch 1 --experiment-args data.task=word_problems
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURE = ROOT / "outputs" / "benchmarks" / "ps_ppo" / "memory.png"


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
    col = lambda c: [float(x) for x in tr[c]]
    return {"arm": name, "updates": len(tr),
            "resp_tokens_bp": tr["train/tokens_backprop"].mean(), "resp_tokens_full": tr["train/tokens_full"].mean(),
            "prompt_tokens": tr["train/prompt_tokens"].mean(), "update_s": col("train/update_s")[1:] or col("train/update_s"),
            "saved_act_mb": col("train/saved_act_mb"), "saved_act_mb_sum": tr["train/saved_act_mb_sum"].mean(),
            "peak_mem_gb": tr["train/peak_mem_gb"].max() if "train/peak_mem_gb" in tr else float("nan"),
            "grad_norm_var": tr["train/grad_norm"].var(), "max_weight": tr["train/max_weight"].max(),
            "reward_first": tr["train/reward"].iloc[:q].mean(), "reward_last": col("train/reward")[-q:],
            "val_accuracy": metrics["final"].get("val/accuracy", float("nan"))}


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.schema import mean_se

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    names = [r["arm"] for r in rows]
    for ax, key, label in zip(axes, ("saved_act_mb", "update_s", "reward_last"),
                              ("peak saved activations per update (MB)", "update pass per update (s)",
                               "reward, last quarter of updates")):
        stats = [mean_se(r[key]) for r in rows]
        ax.bar(range(len(rows)), [m for m, _, _ in stats], yerr=[se or 0 for _, se, _ in stats], capsize=3,
               color=["0.6", "0.3", "tab:blue", "tab:orange", "tab:green"][:len(rows)])
        ax.set_xticks(range(len(rows)), names, rotation=25, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    from benchmarks.schema import mean_se

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--prompts", type=int, default=4, help="prompts per update")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=4, help="rows per forward/backward (sorted by kept length)")
    p.add_argument("--p-full", type=float, nargs="+", default=[0.1, 0.2])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experiment-args", nargs="*", default=[], help="extra overrides for every arm")
    p.add_argument("--quick", action="store_true", help="4 updates, one PS-PPO arm (p_full 0.2): a pipeline check")
    args = p.parse_args(argv)
    if args.quick:
        args.updates, args.p_full = 4, [0.2]
    arms = [("grpo padded", "grpo_tiny", ["model.packing=false"]), ("grpo packed", "grpo_tiny", ["model.packing=true"])]
    arms += [(f"ps_ppo packed p={q}", "ps_ppo_tiny", [f"model.p_full={q}", "model.packing=true"]) for q in args.p_full]
    rows = []
    with tempfile.TemporaryDirectory(prefix="ps_ppo_bench-") as tmp:
        for i, (name, exp, extra) in enumerate(arms):
            rows.append(run_arm(name, exp, extra, args, Path(tmp) / f"arm{i}"))
            print(f"done: {name}", file=sys.stderr)
    m = lambda r, k: mean_se(r[k])[0]
    cols = ["arm", "resp_tokens_bp", "resp_tokens_full", "prompt_tokens", "update_s", "saved_act_mb", "saved_act_mb_sum",
            "peak_mem_gb", "grad_norm_var", "max_weight", "reward_first", "reward_last", "val_accuracy"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(r[c] if isinstance(r[c], str) else f"{m(r, c) if isinstance(r[c], list) else r[c]:.4g}"
                         for c in cols))
    base = rows[1]
    print("\nratios vs grpo packed:")
    for r in rows[:1] + rows[2:]:
        print(f"  {r['arm']}: tokens {r['resp_tokens_bp'] / base['resp_tokens_bp']:.3f}x  "
              f"time {m(r, 'update_s') / m(base, 'update_s'):.3f}x  "
              f"peak act {m(r, 'saved_act_mb') / m(base, 'saved_act_mb'):.3f}x "
              f"(run max {max(r['saved_act_mb']) / max(base['saved_act_mb']):.3f}x)  "
              f"act summed over micro-batches {r['saved_act_mb_sum'] / base['saved_act_mb_sum']:.3f}x  "
              f"gnvar {r['grad_norm_var'] / max(base['grad_norm_var'], 1e-12):.3f}x  "
              f"reward(last quarter) {m(r, 'reward_last'):.3f} vs {m(base, 'reward_last'):.3f}")
    plot(rows, FIGURE)
    return rows


def claims(rows, argv):
    """Claims for benchmarks/results/ps_ppo.json, judged by benchmarks/stats.py. One seed; every arm draws the same
    prompts at update i (same seed, same stream), so per-update numbers are paired by update: ratios of means with a
    paired delta-method interval over updates, reward differences paired over the last quarter's updates."""
    from benchmarks import stats
    from benchmarks.schema import arms_table, backbone_size, mean_se

    base = next(r for r in rows if r["arm"] == "grpo packed")
    pad = next(r for r in rows if r["arm"] == "grpo padded")
    found = []
    for r in (r for r in rows if r["arm"].startswith("ps_ppo")):
        q = r["arm"].split("p=")[1]
        mem = stats.ratio(r["saved_act_mb"], base["saved_act_mb"], "updates", paired=True)
        floor = (r["prompt_tokens"] + r["resp_tokens_bp"]) / (base["prompt_tokens"] + base["resp_tokens_bp"])
        found.append(stats.claim(
            f"peak_memory_p{q}", "PS-PPO achieves large reductions in training compute and peak GPU memory",
            f"saved-activation peak per update, PS-PPO packed p_full={q} / GRPO packed", mem, expect="<",
            threshold=0.65, n_seeds=1, n_items=len(r["saved_act_mb"]), our_threshold="0.65: issue 13's target",
            paper_value="large reductions in peak GPU memory (abstract; no number)",
            why=f"token floor {floor:.2f} (prompts are never truncated); GRPO padded/packed "
                f"{mean_se(pad['saved_act_mb'])[0] / mean_se(base['saved_act_mb'])[0]:.2f}"))
        t = stats.ratio(r["update_s"], base["update_s"], "updates", paired=True)
        tok = r["resp_tokens_bp"] / base["resp_tokens_bp"]
        found.append(stats.claim(
            f"compute_p{q}", "PS-PPO achieves large reductions in training compute",
            f"update-pass wall time per update, PS-PPO packed p_full={q} / GRPO packed", t, expect="<", threshold=1.0,
            n_seeds=1, n_items=len(r["update_s"]), paper_value="large reductions in training compute (abstract)",
            why=f"{tok:.3f}x the response tokens backpropagated (E[C]/T = {(1 + float(q)) / 2:.2f})"))
        d = stats.paired(r["reward_last"], base["reward_last"], "updates")
        found.append(stats.claim(
            f"accuracy_p{q}", "while maintaining accuracy comparable to strong critic-free baselines",
            f"reward over the last quarter of updates, PS-PPO packed p_full={q} − GRPO packed (paired by update)", d,
            expect=">", threshold=-0.05, n_seeds=1, n_items=len(r["reward_last"]),
            our_threshold="within 5 points of GRPO's reward",
            paper_value="accuracy comparable to critic-free baselines (abstract)",
            why=f"{mean_se(r['reward_last'])[0]:.3f} vs {mean_se(base['reward_last'])[0]:.3f}; final greedy accuracy "
                f"{r['val_accuracy']:.3f} vs {base['val_accuracy']:.3f}"))
    m = lambda r, k: mean_se(r[k])[0]  # noqa: E731
    table = arms_table("per arm (one seed): tokens per update, update time, saved activations, reward and accuracy",
                       ["arm", "response tokens backprop", "response tokens full", "update s", "peak saved MB (mean)",
                        "peak saved MB (max)", "reward first quarter", "reward last quarter", "val accuracy"],
                       [[r["arm"], r["resp_tokens_bp"], r["resp_tokens_full"], m(r, "update_s"), m(r, "saved_act_mb"),
                         max(r["saved_act_mb"]), r["reward_first"], m(r, "reward_last"), r["val_accuracy"]]
                        for r in rows])
    scale = {"model": "tiny-lm (LLaMA, hidden 128) warmed up (grpo_tiny / ps_ppo_tiny)", **backbone_size("ps_ppo_tiny"),
             "data": "the experiments' prompts, same stream for every arm", "steps": f"{base['updates']} updates per arm",
             "seeds": 1, "eval": f"{len(base['saved_act_mb'])} updates (memory, time); reward over the last "
                                 f"{len(base['reward_last'])}"}
    return found, [FIGURE], {"scale": scale, "arms": [table]}


if __name__ == "__main__":
    from benchmarks.schema import run_benchmark

    run_benchmark("ps_ppo", main, claims)
