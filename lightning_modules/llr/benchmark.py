"""LLR benchmark: uniform vs layer-wise rates (AdamW and Muon) pretraining a tiny LLaMA on the embedded corpus.

Every arm uses the same model init (per seed), data order (per seed), base LR, steps and schedule, and the same
code as the Lightning path: ``LLRModule`` + ``llr_optimizer`` + ``warmup_cosine`` (``lightning_modules/llr``),
with the LLR callback's ``RateSchedule`` (``due / recompute / apply_ramp``) driven from a plain loop (no Lightning
overhead). Arms:

    uniform        AdamW, η everywhere (the baseline)
    llr            AdamW, LLR rates in [η, 5η]
    uniform_5x     AdamW, 5η everywhere (the paper's control: LLR's upper bound applied uniformly)
    uniform_muon   Muon on hidden matrices (muon_lr) + AdamW (η) elsewhere
    llr_muon       the same with LLR rates

Prints the final validation loss per arm (mean ± std over seeds) and the ratio of steps uniform needs to reach
its final validation loss to the steps LLR needs (the paper claims up to 1.5x), writes curves (PNG + JSON), and
compares our per-layer α with the ``weightwatcher`` package's on the same trained weights.

    python -m benchmarks llr      # small default: hidden 64, 2 layers, 120 steps, 3 seeds: 0.7 min measured (2 shared cores)
    python -m benchmarks llr --steps 600 --seq-len 256 --hidden 128 --layers 4 --every 20 --ramp 10 --eval-every 50
"""
from __future__ import annotations

import argparse
import json
import math
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from lightning_modules.llr import LLRModule, RateSchedule, cpu_threads, esd, hill_alpha, llr_optimizer

ARMS = ("uniform", "llr", "uniform_5x", "uniform_muon", "llr_muon")


def build(args, arm: str, seed: int):
    from lightning_modules.common.lm import warmup_cosine

    torch.manual_seed(seed)
    spec = {"family": "llama", "pretrained": None, "dtype": "float32", "attn_implementation": "sdpa",
            "config": {"vocab_size": 2048, "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
                       "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
                       "num_key_value_heads": args.heads, "max_position_embeddings": 1024,
                       "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}}
    lr = args.lr * (5 if arm == "uniform_5x" else 1)
    opt = partial(llr_optimizer, optimizer="muon" if arm.endswith("muon") else "adamw", lr=lr, muon_lr=args.muon_lr,
                  weight_decay=0.1)
    sched = partial(warmup_cosine, warmup_steps=max(1, args.steps // 10), total_steps=args.steps, min_ratio=0.1)
    module = LLRModule(spec, optimizer=opt, scheduler=sched, weight_decay=0.1)
    module.configure_model()
    out = module.configure_optimizers()
    return module, out["optimizer"], out["lr_scheduler"]["scheduler"]


def batches(tokens: np.ndarray, seq_len: int, batch: int, n: int, seed: int):
    starts = np.random.default_rng(seed).integers(0, len(tokens) - seq_len - 1, size=(n, batch))
    for row in starts:
        ids = torch.from_numpy(np.stack([tokens[s:s + seq_len] for s in row]).astype(np.int64))
        yield {"input_ids": ids, "labels": ids}


@torch.no_grad()
def val_loss(module, val_batches) -> float:
    total = count = 0.0
    for b in val_batches:
        s, n = module.token_nll(b)
        total, count = total + float(s), count + float(n)
    return total / count


def run_arm(args, arm, seed, train_tokens, val_batches):
    module, opt, sched = build(args, arm, seed)
    cb = RateSchedule(every=args.every, ramp_steps=args.ramp, ratio=0.2) if arm.startswith("llr") else None
    weights = {g["llr_module"]: (module.get_submodule(g["llr_module"]).weight, g["llr_edge"])
               for g in opt.param_groups if g["llr_module"]}
    curve = []
    module.train()
    for k, batch in enumerate(batches(train_tokens, args.seq_len, args.batch, args.steps, 1000 + seed)):
        if cb is not None:
            if cb.due(k, args.steps):
                cb.recompute(k, opt, sched, weights)
            cb.apply_ramp(k, opt)
        loss = module.compute_loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if (k + 1) % args.eval_every == 0 or k + 1 == args.steps:
            module.eval()
            curve.append((k + 1, val_loss(module, val_batches)))
            module.train()
    return module, curve, (cb.ratios if cb is not None else {})


def steps_to_reach(curve, target: float) -> float:
    """First step at which the (linearly interpolated) validation curve reaches ``target``; inf if never."""
    prev = None
    for step, loss in curve:
        if loss <= target:
            if prev is None:
                return float(step)
            (s0, l0) = prev
            return s0 + (step - s0) * (l0 - target) / max(l0 - loss, 1e-12)
        prev = (step, loss)
    return float("inf")


def weightwatcher_alphas(model) -> dict[str, dict]:
    """weightwatcher's α per Linear layer (its default fit: xmin by minimal KS distance) beside ours."""
    try:
        import weightwatcher as ww
    except ImportError:
        return {}
    import logging

    logging.getLogger("weightwatcher").setLevel(logging.ERROR)
    details = ww.WeightWatcher(model=model).analyze()
    out = {}
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for _, row in details.iterrows():
        name = str(row["longname"])
        if name not in names:
            continue
        with cpu_threads(1):
            lam = esd(model.get_submodule(name).weight, torch.float64)
        i = lam.numel() - int(row["num_pl_spikes"])  # ww's xmin as a rank: the fitted tail holds num_pl_spikes evals
        out[name] = {"ours": hill_alpha(lam), "ww": float(row["alpha"]), "ours_at_ww_xmin": hill_at(lam, i),
                     "ww_xmin_quantile": i / lam.numel(), "n_evals": int(lam.numel())}
    return out


def hill_at(lam: torch.Tensor, i: int) -> float:
    """The same continuous power-law MLE with xmin at rank ``i`` instead of the median."""
    i = min(max(i, 0), lam.numel() - 2)
    tail = lam[i:]
    return 1.0 + tail.numel() / float(torch.log(tail / lam[i]).sum())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=10, help="LLR recompute interval (paper: 100 of 3200+ steps)")
    p.add_argument("--ramp", type=int, default=5, help="LLR ramp length (paper: 50)")
    p.add_argument("--lr", type=float, default=3e-3, help="uniform base rate (lm_tiny's)")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=12)
    p.add_argument("--val-batches", type=int, default=4)
    p.add_argument("--out", default="outputs/benchmarks/llr")
    args = p.parse_args(argv)

    from datamodules.common.tokenizer import corpus_tokenizer
    from datamodules.text import TextDataModule

    dm = TextDataModule(tokenizer=corpus_tokenizer(2048), seq_len=args.seq_len, batch_size=args.batch)
    tokens = dm.split_tokens()
    train_tokens, val_tokens = tokens["train"], tokens["val"]
    val_batches = list(batches(val_tokens, args.seq_len, args.batch, args.val_batches, 7))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, dict[int, list]] = {a: {} for a in args.arms}
    ratios: dict[str, dict] = {}
    trained = None
    summary = {}
    for n_done, seed in enumerate(args.seeds, 1):
        for arm in args.arms:
            t0 = time.time()
            module, curve, r = run_arm(args, arm, seed, train_tokens, val_batches)
            curves[arm][seed] = curve
            if r:
                ratios[f"{arm}/seed{seed}"] = r
            if arm == "uniform" and seed == args.seeds[0]:
                trained = module.model
            print(f"{arm:13s} seed {seed}: final val loss {curve[-1][1]:.4f}  ({time.time() - t0:.1f} s)", flush=True)
        # results after every seed, so a long run that is stopped still leaves its numbers
        summary = report(args, args.seeds[:n_done], curves, ratios, trained, out, final=n_done == len(args.seeds))
    return summary


def report(args, seeds, curves, ratios, trained, out: Path, final: bool) -> dict:
    summary = {"seeds": list(seeds)}
    for arm in args.arms:
        finals = [curves[arm][s][-1][1] for s in seeds]
        summary[arm] = {"final_val_loss_mean": float(np.mean(finals)), "final_val_loss_std": float(np.std(finals)),
                        "diverged": int(sum(not math.isfinite(f) for f in finals))}
    for base, arm in (("uniform", "llr"), ("uniform_muon", "llr_muon"), ("uniform", "uniform_5x")):
        if base in curves and arm in curves:
            per_seed = []
            for seed in seeds:
                need = steps_to_reach(curves[arm][seed], curves[base][seed][-1][1])
                per_seed.append(args.steps / need if math.isfinite(need) else 0.0)
            summary[arm]["speedup_vs_" + base] = per_seed
            summary[arm]["speedup_mean"] = float(np.mean(per_seed))
    ww = weightwatcher_alphas(trained) if (final and trained is not None) else {}
    if ww:
        diffs = np.array([r["ww"] - r["ours"] for r in ww.values()])
        same_xmin = np.array([r["ww"] - r["ours_at_ww_xmin"] for r in ww.values()])
        summary["weightwatcher"] = {"layers": len(ww), "mean_abs_diff": float(np.abs(diffs).mean()),
                                    "mean_ww_minus_ours": float(diffs.mean()),
                                    "mean_abs_diff_at_ww_xmin": float(np.abs(same_xmin).mean()),
                                    "mean_ww_xmin_quantile": float(np.mean([r["ww_xmin_quantile"] for r in ww.values()]))}
    (out / "llr_bench.json").write_text(json.dumps({"args": vars(args), "summary": summary, "curves": curves,
                                                    "lr_ratios": ratios, "weightwatcher": ww}, indent=1, default=float))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for arm in args.arms:
            steps = [st for st, _ in curves[arm][seeds[0]]]
            ys = np.array([[l for _, l in curves[arm][s]] for s in seeds])
            ax.plot(steps, ys.mean(0), label=arm)
            ax.fill_between(steps, ys.min(0), ys.max(0), alpha=0.2)
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss")
        ax.set_title(f"tiny LLaMA, {len(seeds)} seed(s), base lr {args.lr}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "llr_val_loss.png", dpi=120)
        plt.close(fig)
    except Exception as err:  # noqa: BLE001 - the numbers above stand without the figure
        print(f"(no plot: {err})")

    print(f"\n[{len(seeds)} seed(s)] arm   final val loss (mean ± std)   steps-ratio: uniform's steps / steps to reach uniform's final loss")
    for arm in args.arms:
        s = summary[arm]
        key = next((k for k in s if k.startswith("speedup_vs")), None)
        sp = f"{s['speedup_mean']:.2f}x (per seed {', '.join(f'{v:.2f}' for v in s[key])})" if key else ""
        print(f"{arm:13s}  {s['final_val_loss_mean']:.4f} ± {s['final_val_loss_std']:.4f}   {sp}", flush=True)
    if ww:
        w = summary["weightwatcher"]
        print(f"\nalpha vs weightwatcher ({w['layers']} Linear layers of the uniform seed-{seeds[0]} model): "
              f"mean |ww - ours| = {w['mean_abs_diff']:.3f} (ww - ours = {w['mean_ww_minus_ours']:+.3f}); the same "
              f"Hill formula at ww's xmin: {w['mean_abs_diff_at_ww_xmin']:.3f}; ww's xmin sits at eigenvalue quantile "
              f"{w['mean_ww_xmin_quantile']:.2f} (ours 0.50)", flush=True)
    print(f"wrote {out / 'llr_bench.json'} and {out / 'llr_val_loss.png'}", flush=True)
    return summary


def claims(summary, argv):
    """Claims for benchmarks/results/llr.json (benchmarks/schema.py), judged by benchmarks/stats.py: every arm
    shares each seed's init and data, so arms are compared by paired differences over seeds (t, n − 1 df)."""
    import argparse

    from benchmarks import stats
    from benchmarks.schema import arms_table

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--out", default="outputs/benchmarks/llr")  # where main wrote llr_val_loss.png and llr_bench.json
    out_dir = Path(ap.parse_known_args(argv)[0].out)
    bench = json.loads((out_dir / "llr_bench.json").read_text())
    seeds, curves, args = summary["seeds"], bench["curves"], bench["args"]
    final = {arm: [curves[arm][str(s)][-1][1] for s in seeds] for arm in curves}
    n = len(seeds)
    found = []
    for arm, base, quote in (("llr", "uniform", "LLR achieves up to 1.5× training speedup"),
                             ("llr_muon", "uniform_muon", "optimizers (AdamW and Muon)")):
        if arm in summary and f"speedup_vs_{base}" in summary[arm]:
            est = stats.mean(summary[arm][f"speedup_vs_{base}"], "seeds")
            found.append(stats.claim(
                f"speedup_{arm}", quote, f"steps {base} needs / steps {arm} needs to reach {base}'s final val loss",
                est, expect=">", threshold=1.0, n_seeds=n, n_items=None,
                paper_value="up to 1.5× training speedup (abstract)",
                why=f"per seed {', '.join(f'{v:.2f}' for v in summary[arm][f'speedup_vs_{base}'])}"))
        if arm in final and base in final:
            est = stats.paired(final[base], final[arm], "seeds")
            found.append(stats.claim(
                f"final_loss_{arm}", "leading to faster convergence and improved generalization",
                f"final val loss {base} − {arm} (paired by seed)", est, expect=">", n_seeds=n, n_items=None,
                paper_value="faster convergence and better generalisation (abstract)",
                why=f"{summary[base]['final_val_loss_mean']:.4f} vs {summary[arm]['final_val_loss_mean']:.4f}"))
    found.append(stats.not_measurable(
        "zero_shot_1b", "raising average zero-shot accuracy from 47.09% to 49.02% for 1B models",
        "zero-shot accuracy, 1B model", paper_value="47.09% → 49.02% average zero-shot, 1B (abstract)",
        why="1B/3B pretraining on up to 100B tokens; the benchmark trains a tiny LLaMA for minutes"))
    arms = [arms_table(f"final val loss per arm and seed (mean last); steps-ratio vs the arm's uniform base",
                       ["arm", *(f"seed {s}" for s in seeds), "mean", "speedup (mean)"],
                       [[arm, *final[arm], sum(final[arm]) / n, summary[arm].get("speedup_mean")] for arm in final])]
    model, _, _ = build(argparse.Namespace(**args), "uniform", 0)
    from lightning_modules.common.backbone import count_parameters

    scale = {"model": f"tiny LLaMA (hidden {args['hidden']}, {args['heads']} heads, vocab 2048)",
             "params": count_parameters(model.model), "layers": args["layers"],
             "data": f"embedded corpus, seq {args['seq_len']} × batch {args['batch']}", "steps": args["steps"],
             "seeds": n, "eval": f"{args['val_batches']} val batches × {args['batch']} × {args['seq_len']} tokens"}
    fig = out_dir / "llr_val_loss.png"
    return found, [fig] if fig.is_file() else [], {"scale": scale, "arms": arms}


if __name__ == "__main__":
    from benchmarks.schema import run_benchmark

    run_benchmark("llr", main, claims)
