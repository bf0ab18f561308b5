"""Hista / Numca (Chen et al., ICML 2026): SVEB value accuracy and GRPO vs Numca vs Hista training, on tiny-lm.

1. **SVEB** (``sveb_tiny``: 1-digit arithmetic, field "number", the warmed-up tiny policy): per problem 32 samples
   → V_grpo, a cut at a random space of the first, 20 continuations → V_mc (T 1.0 by default, see --temperature). MAE(V_est, V_mc) of the group mean,
   Numca, Hista and the regression critics ppo-1 (fitted on training problems) / ppo-n (on 80% of SVEB, scored on
   the rest), with paired standard errors against the group mean, and the noise floor (first n continuations).
2. **Training** at equal prompts and updates (same seed → same prompt stream): ``hista_tiny`` with
   ``model.estimator=grpo|numca|hista``: reward curve, final greedy val accuracy, the token_advantages hook's wall
   time per step against the step's rollout + update time.

Each run is ``run.py`` in its own subprocess. Claims go to ``benchmarks/results/hista.json``.

    python -m benchmarks hista            # full: 32 SVEB problems x (32 + 20) samples, 60 updates per arm: 1.4 min measured
    python -m benchmarks hista --quick    # 4 problems x (8 + 4), 10 updates per arm (a smoke of the pipeline)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURE = ROOT / "outputs" / "benchmarks" / "hista" / "reward.png"
ESTIMATORS = ("grpo", "numca", "hista")


def run(experiment: str, out: Path, overrides: list[str], threads: int) -> dict:
    cmd = [sys.executable, str(ROOT / "run.py"), f"experiment={experiment}", f"hydra.run.dir={out}", "logger=csv",
           "callbacks.progress_bar=null", "callbacks.model_checkpoint=null", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{experiment} {' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "metrics.json").read_text())


def sveb(args, tmp: Path) -> dict:
    over = [f"data.n_test={args.problems}", f"model.group_size={args.samples}", f"model.mcs_num={args.continuations}",
            f"model.critic_problems={args.critic_problems}", f"model.temperature={args.temperature}", f"seed={args.seed}"]
    res = run("sveb_tiny", tmp / "sveb", over, args.threads)["results"]["sveb"]
    return {"metrics": res["metrics"], "cases": res["cases"]}


def train(args, tmp: Path) -> dict:
    import pandas as pd

    arms = {}
    for est in ESTIMATORS:
        out = tmp / f"train_{est}"
        metrics = run("hista_tiny", out, [f"model.estimator={est}", f"trainer.max_steps={args.updates}",
                                          f"trainer.val_check_interval={args.updates}", f"seed={args.seed}",
                                          f"data.n_val={args.n_val}", "task=fit"], args.threads)
        log = pd.read_csv(next(out.rglob("metrics.csv"))).dropna(subset=["train/reward"])
        step_s = (log["train/rollout_s"] + log["train/update_s"]).tolist()
        arms[est] = {"reward": log["train/reward"].tolist(), "val_accuracy": metrics["final"]["val/accuracy"],
                     "advantage_s": log["train/advantage_s"].tolist(), "step_s": step_s}
    return arms


def plot(arms: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for est, a in arms.items():
        r = a["reward"]
        k = max(1, len(r) // 10)
        smooth = [sum(r[max(0, i - k + 1):i + 1]) / len(r[max(0, i - k + 1):i + 1]) for i in range(len(r))]
        ax.plot(range(1, len(r) + 1), smooth, label=f"{est} (val acc {a['val_accuracy']:.3f})")
    ax.set_xlabel("rollout step")
    ax.set_ylabel(f"train reward (running mean of {k})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 problems x (8 + 4) samples, 10 updates per arm")
    p.add_argument("--problems", type=int, default=32)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--continuations", type=int, default=20)
    p.add_argument("--critic-problems", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="SVEB sampling temperature (the paper's 0.7 leaves the warmed-up tiny policy's groups mostly all-right "
                        "or all-wrong, where every estimator is exact)")
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--n-val", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.quick:
        args.problems, args.samples, args.continuations, args.critic_problems = 4, 8, 4, 4
        args.updates, args.n_val = 10, 16
    with tempfile.TemporaryDirectory() as d:
        s = sveb(args, Path(d))
        arms = train(args, Path(d))
    m = s["metrics"]
    print(f"SVEB ({m['cases']} cases, {args.samples} samples, {args.continuations} continuations): MAE against V_mc")
    for k in sorted(x for x in m if x.startswith("mae/")):
        print(f"  {k[4:]:>6}: {m[k]:.4f}" + (f"  (n={m['n/' + k[4:]]})" if f"n/{k[4:]}" in m else ""))
    print("  noise MAE, first n continuations: " + " ".join(f"{v:.3f}" for v in m["noise_mae"]))
    print(f"training, {args.updates} updates each (same prompts):")
    for est, a in arms.items():
        share = sum(a["advantage_s"]) / max(1e-9, sum(a["step_s"]))
        print(f"  {est:>6}: final val acc {a['val_accuracy']:.3f}, mean train reward {sum(a['reward']) / len(a['reward']):.3f}, "
              f"advantage time {1e3 * sum(a['advantage_s']) / len(a['advantage_s']):.1f} ms/step ({share:.1%} of a step)")
    fig = plot(arms, FIGURE)
    return {"sveb": s, "arms": arms, "n_val": args.n_val, "figure": str(fig)}


def paired(cases: list[dict], name: str) -> list[float]:
    """|V_name − V_mc| − |V_grpo − V_mc| per case (the cases with a value for ``name``)."""
    diffs = []
    for c in cases:
        v = c["estimates"].get(name)
        if v is None:
            continue
        mc = sum(c["mc_rewards"]) / len(c["mc_rewards"])
        diffs.append(abs(v - mc) - abs(sum(c["grpo_rewards"]) / len(c["grpo_rewards"]) - mc))
    return diffs


def val_problems(n_val: int) -> int:
    """How many distinct val problems hista_tiny scores: ``n_val`` caps them, the 1-digit split may hold fewer."""
    from datamodules.verifiable import SPLITS, generate_problems
    from runner import compose

    d = compose("hista_tiny", [f"data.n_val={n_val}"]).data  # as VerifiableDataModule.all_problems draws them
    return len(generate_problems(d.task, n_val, d.seed * 7919 + SPLITS.index("val"), d.digits, tuple(d.operations),
                                 "val", d.val_fraction, d.test_fraction))


def claims(res, argv):
    """Claims for benchmarks/results/hista.json, judged by benchmarks/stats.py. One seed: SVEB intervals are over
    its cases (paired against the group mean, t), training accuracy over the val problems (Newcombe; the
    per-problem outcomes are not kept, so unpaired), the overhead over the training steps (bootstrap)."""
    from benchmarks import stats
    from benchmarks.schema import arms_table, backbone_size

    cases, arms, out = res["sveb"]["cases"], res["arms"], []
    q_collapse = "critics in standard approaches like PPO collapse to a coarse group‑average baseline"
    for critic in ("ppo-1", "ppo-n"):
        d = paired(cases, critic)
        out.append(stats.claim(
            f"critic_collapse_{critic.replace('-', '_')}", q_collapse,
            f"SVEB MAE({critic}) − MAE(group mean) against V_mc, paired over cases",
            stats.paired(d, [0.0] * len(d), "cases") if d else stats.single(None), expect=">", n_seeds=1,
            n_items=len(d) or None, paper_value="PPO critics collapse to the group average (abstract)",
            why=f"over {len(d)} cases" if d else "no case held out for this critic"))
    for est in ("numca", "hista"):
        d = paired(cases, est)
        out.append(stats.claim(
            f"sveb_{est}_more_accurate", "both methods yield more accurate state value estimates",
            f"SVEB MAE({est}) − MAE(group mean) against V_mc, paired over cases",
            stats.paired(d, [0.0] * len(d), "cases") if d else stats.single(None), expect="<", n_seeds=1,
            n_items=len(d) or None, paper_value="more accurate state values (abstract)",
            why=f"over {len(d)} cases of 1-digit arithmetic"))
    n_val = val_problems(res["n_val"])
    base = arms["grpo"]["val_accuracy"]
    for est in ("numca", "hista"):
        acc = arms[est]["val_accuracy"]
        out.append(stats.claim(
            f"training_{est}_vs_grpo", "enhance training performance",
            f"final greedy val accuracy, {est} − grpo, equal prompts and updates (one seed)",
            stats.proportion_diff(round(acc * n_val), n_val, round(base * n_val), n_val, "val problems"),
            expect=">", n_seeds=1, n_items=n_val, paper_value="better training performance (abstract)",
            why=f"{est} {acc:.3f} vs grpo {base:.3f} on {n_val} val problems"))
    for est in ("numca", "hista"):
        steps = list(zip(arms[est]["advantage_s"], arms[est]["step_s"]))
        share = stats.resample(steps, lambda xs: sum(a for a, _ in xs) / max(1e-9, sum(b for _, b in xs)), "steps")
        out.append(stats.claim(
            f"overhead_{est}", "without incurring significant computational overhead",
            f"{est}'s token_advantages time / (rollout + update) time, summed over steps", share, expect="<",
            threshold=0.10, n_seeds=1, n_items=len(steps), our_threshold="under 10% of a step's time",
            paper_value="no significant overhead (abstract; no number)",
            why=f"{1e3 * sum(arms[est]['advantage_s']) / len(arms[est]['advantage_s']):.1f} ms per step on CPU"))
    out.append(stats.not_measurable(
        "across_algorithms_and_sizes", "across different RL algorithms and model sizes",
        "training gains over dapo/cispo and 1.5B-7B models", paper_value="gains across RL algorithms and 1.5B–7B models",
        why="one tiny model on CPU; the 3B recipes are hista_qwen25_3b / numca_qwen25_3b"))
    m = res["sveb"]["metrics"]
    tables = [arms_table(f"training, one seed: final greedy val accuracy ({n_val} problems), mean train reward, "
                         "advantage time", ["estimator", "val accuracy", "mean train reward", "advantage ms/step",
                                            "share of a step"],
                         [[e, a["val_accuracy"], sum(a["reward"]) / len(a["reward"]),
                           1e3 * sum(a["advantage_s"]) / len(a["advantage_s"]),
                           sum(a["advantage_s"]) / max(1e-9, sum(a["step_s"]))] for e, a in arms.items()]),
              arms_table(f"SVEB: MAE against V_mc per estimator ({m.get('cases')} cases)", ["estimator", "MAE", "cases"],
                         [[k[4:], v, m.get(f"n/{k[4:]}", m.get("cases"))] for k, v in sorted(m.items())
                          if k.startswith("mae/")])]
    scale = {"model": "tiny-lm (LLaMA, hidden 128) warmed up on 1-digit arithmetic", **backbone_size("hista_tiny"),
             "data": "1-digit arithmetic (sveb_tiny, hista_tiny)", "steps": f"{len(arms['grpo']['reward'])} updates "
             "per arm", "seeds": 1, "eval": f"SVEB {m.get('cases')} cases; {n_val} val problems"}
    return out, [res["figure"]], {"scale": scale, "arms": tables}


if __name__ == "__main__":
    from benchmarks.schema import run_benchmark

    run_benchmark("hista", main, claims)
