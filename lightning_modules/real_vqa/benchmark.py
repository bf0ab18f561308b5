"""REAL's discriminator and decoding on the tiny VLM and synthetic KI-VQA (arXiv 2602.14065).

One ``real_vqa_tiny`` training run per SFT target (``answer_only``, ``conflict_only``, ``rpa``; same data, steps and
seed), then the test split decoded with ``greedy``, ``cad``, ``vcd`` and ``rpgd`` (discriminator-triggered; for
``answer_only``, which trains no discriminator, RPGD is triggered by keyword mismatch), plus the
``keyword_mismatch`` discriminator itself. Reported per arm: conflict accuracy and F1, the false-positive rate on
non-pivot changes (seen and held-out relations), answer accuracy on clean, true- and false-conflict items.

    python -m benchmarks real_vqa                      # 3 targets x 3 seeds x 600 steps, 96 test items: 76 min
                                                       # (4551 s measured on the shared 2-core machine)
    python -m benchmarks real_vqa --quick              # 1 seed, 60 steps, 16 test items: proves it runs
"""
from __future__ import annotations

import argparse

TARGETS = ("answer_only", "conflict_only", "rpa")
DECODINGS = ("greedy", "cad", "vcd", "rpgd")
KEYS = ("conflict_accuracy", "conflict_f1", "fpr_false_seen", "fpr_false_held_out", "acc_clean", "acc_true",
        "acc_false", "answer_accuracy", "malformed")


def run_target(target: str, seed: int, steps: int, extra: list[str]) -> dict[str, dict]:
    """Train one target, then test every decoding (and the keyword-mismatch discriminator) on the same model."""
    import lightning as L
    from hydra.utils import instantiate

    from runner import compose

    cfg = compose("real_vqa_tiny", [f"model.sft.target={target}", f"seed={seed}", f"trainer.max_steps={steps}",
                                    *(["model.discriminator=keyword_mismatch"] if target == "answer_only" else []),
                                    *extra])
    L.seed_everything(seed, workers=True)
    dm = instantiate(cfg.data)
    module = instantiate(cfg.model, _convert_="all")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, enable_model_summary=False,
                        limit_test_batches=cfg.trainer.get("limit_test_batches") or 1.0)
    trainer.fit(module, dm)
    out = {}
    arms = [(d, module.discriminator) for d in DECODINGS] + ([("greedy", "keyword_mismatch")] if target != "answer_only" else [])
    for decoding, disc in arms:
        module.decoding, module.discriminator = decoding, disc
        trainer.test(module, dm, verbose=False)
        out[decoding if disc == "model" or target == "answer_only" else disc] = dict(module.results["test"])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--quick", action="store_true", help="one seed, 60 steps, 16 test items")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (e.g. data.n_test=192)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = [0], 60
        args.overrides = ["data.n_train=200", "data.n_test=16", "model.eval.max_new_tokens=32", *args.overrides]
    import torch

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    rows = {t: [run_target(t, s, args.steps, args.overrides) for s in args.seeds] for t in args.targets}
    from benchmarks.schema import mean_se

    print(f"real_vqa_tiny, {args.steps} steps, seeds {args.seeds}: test metrics, mean over seeds")
    print(f"{'target/arm':>28} " + " ".join(f"{k[:14]:>14}" for k in KEYS))
    for t, runs in rows.items():
        for arm in runs[0]:
            cells = []
            for k in KEYS:
                vals = [r[arm][k] for r in runs if k in r[arm]]
                cells.append(f"{mean_se(vals)[0]:.3f}" if vals else "-")
            print(f"{t + '/' + arm:>28} " + " ".join(f"{c:>14}" for c in cells))
    return {"rows": rows, "steps": args.steps, "seeds": args.seeds, "overrides": args.overrides}


def claims(res, argv):
    """Claims for benchmarks/results/real_vqa.json, judged by benchmarks/stats.py. Every target trains with the same
    seeds and data and is scored on the same test items, so arms are compared by paired differences over seeds
    (t on seeds − 1 df). A discriminator that never flags (F1 0) wins every false-positive comparison trivially and
    an RPGD that never triggers equals greedy: those claims cannot move, so they are inconclusive."""
    from pathlib import Path

    from benchmarks import stats
    from benchmarks.figures import bars
    from benchmarks.schema import ROOT, arms_table, backbone_size, mean_se
    from runner import compose

    rows, out = res["rows"], []
    n_seeds = len(res["seeds"])
    n_test = int(compose("real_vqa_tiny", list(res.get("overrides") or [])).data.n_test)

    def vals(target, arm, key):
        return [r[arm][key] for r in rows.get(target, []) if arm in r and key in r[arm]]

    def diff(a, b):  # (target, arm, key) of each side, paired by seed
        x, y = vals(*a), vals(*b)
        return stats.paired(x, y, "seeds") if x and len(x) == len(y) else stats.single(None)

    f1 = vals("rpa", "greedy", "conflict_f1")
    silent = "the rpa discriminator never flags (F1 0)" if f1 and max(f1) == 0.0 else None
    rate = vals("rpa", "rpgd", "contrast_rate")
    never = "RPGD never triggered (contrast rate 0)" if rate and max(rate) == 0.0 else None
    common = dict(n_seeds=n_seeds, n_items=n_test)
    q_gen = "train a generalizable discriminator by aligning conflicts with pivot extraction"
    for other, base in (("conflict_only", ("conflict_only", "greedy", "fpr_false_held_out")),
                        ("keyword_mismatch", ("rpa", "keyword_mismatch", "fpr_false_held_out"))):
        mine = ("rpa", "greedy", "fpr_false_held_out")
        out.append(stats.claim(
            f"fewer_false_flags_held_out_vs_{other}", q_gen,
            f"tiny: false-positive rate on non-pivot changes of held-out relations, {other} − rpa", diff(base, mine),
            expect=">", **common, degenerate=silent and f"{silent}: fewer false flags is trivial",
            paper_value="a generalizable discriminator (abstract)",
            why=f"{other} {mean_se(vals(*base))[0] if vals(*base) else None} vs rpa "
                f"{mean_se(vals(*mine))[0] if vals(*mine) else None}"))
    out.append(stats.claim(
        "discrimination_accuracy", "REAL significantly enhances discrimination accuracy",
        "tiny: conflict accuracy, rpa discriminator − keyword mismatch (same model and items)",
        diff(("rpa", "greedy", "conflict_accuracy"), ("rpa", "keyword_mismatch", "conflict_accuracy")), expect=">",
        **common, degenerate=silent, paper_value="significantly better discrimination accuracy (abstract)",
        why="same test items, same model"))
    q_rpgd = "leverages these pivots for targeted conflict mitigation"
    for base in ("greedy", "cad"):
        out.append(stats.claim(
            f"rpgd_beats_{base}_on_true_conflicts", q_rpgd,
            f"tiny: answer accuracy on true-conflict items, rpgd − {base} (rpa model)",
            diff(("rpa", "rpgd", "acc_true"), ("rpa", base, "acc_true")), expect=">", **common, degenerate=never,
            paper_value="targeted conflict mitigation (abstract)", why="same model and items"))
    out.append(stats.claim(
        "rpgd_clean_unhurt", q_rpgd, "tiny: answer accuracy on clean items, rpgd − greedy (rpa model)",
        diff(("rpa", "rpgd", "acc_clean"), ("rpa", "greedy", "acc_clean")), expect=">", threshold=-0.05, **common,
        degenerate=never, our_threshold="within 5 points on clean items",
        why="RPGD runs only when the discriminator flags a conflict"))
    out.append(stats.not_measurable(
        "benchmarks_gains", "Extensive experiments on diverse datasets demonstrate that REAL significantly enhances "
        "discrimination accuracy and achieves superior performance", "answer accuracy on E-VQA, InfoSeek, A-OKVQA",
        paper_value="+3.8 / +1.6 / +3.6 points on E-VQA / InfoSeek / A-OKVQA (papernotes)",
        why="needs a 7B VLM and the datasets' passages and images (real_vqa_qwen2vl_7b runs the hub path on local "
            "jsonl + image files, data.source=files)"))
    table_rows = []
    for t, runs in rows.items():
        for arm in runs[0]:
            table_rows.append([f"{t}/{arm}", *((mean_se(vals(t, arm, k))[0] if vals(t, arm, k) else None)
                                               for k in KEYS)])
    table = arms_table(f"per target / decoding (or discriminator), mean over {n_seeds} seeds, {n_test} test items",
                       ["target/arm", *KEYS], table_rows)
    fig = bars(table, ROOT / "outputs" / "benchmarks" / "real_vqa" / "accuracy.png",
               ["conflict_accuracy", "answer_accuracy"], ylabel="accuracy",
               title=f"real_vqa_tiny: mean over {n_seeds} seeds")
    scale = {"model": "tiny VLM on tiny-lm (LLaMA, hidden 128)", **backbone_size("real_vqa_tiny"),
             "data": "synthetic KI-VQA", "steps": f"{res['steps']} per target ({len(rows)} targets)", "seeds": n_seeds,
             "eval": f"{n_test} test items (half touch a held-out relation)"}
    return out, [Path(fig)], {"scale": scale, "arms": [table]}


if __name__ == "__main__":
    from benchmarks.schema import run_benchmark

    run_benchmark("real_vqa", main, claims)
