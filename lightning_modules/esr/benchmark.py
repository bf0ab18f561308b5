"""ESR benchmark on the tiny stand-in (esr_tiny): base vs self-correction fine-tunes (mix 0.1 / 0.5 / 0.9), steered vs
unsteered, off-topic-detector ablation vs random equal-size sets, and the four meta-prompts on the base model.
Every run reports multi-attempt, ESR, improvement, mean Δ and binomial SEs (test/<condition>/*).

    python -m benchmarks esr                 # 8 runs of esr_tiny: 3.3 min measured (2 shared cores)
    python -m benchmarks esr --quick         # 3 small runs (base, mix 0.5, meta-prompt 1): proves the wiring

A 4-layer LM cannot show scale-emergent ESR; what it can show is whether the fine-tune teaches a restart under a
boost, whether unsteered answers stay single-attempt, and whether clamping detectors changes the restart rate more
than clamping random latents.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["model.steer.n_latents=4", "model.threshold.trials=4", "model.gen.trials=3", "model.gen.max_new_tokens=32",
         "model.otd.random_sets=1", "trainer.max_steps=40"]


def run(name: str, overrides: list[str], out: Path) -> dict:
    out = out / name
    cmd = [sys.executable, "run.py", "experiment=esr_tiny", f"paths.output_dir={out}", "callbacks.progress_bar=null",
           "logger=csv", *overrides]
    print("[esr]", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "metrics.json").read_text())["final"]


def main(argv: list[str]) -> dict:
    quick = "--quick" in argv
    extra = QUICK if quick else []
    conditions = {"base": ["task=test"]}
    for mix in ([0.5] if quick else [0.1, 0.5, 0.9]):
        conditions[f"sft_{mix:g}"] = [f"data.mix_ratio={mix}"]
    for k in ([1] if quick else [1, 2, 3, 4]):
        conditions[f"meta_{k}"] = ["task=test", f"model.meta_prompt={k}"]
    with tempfile.TemporaryDirectory(prefix="esr-bench-") as tmp:
        res = {name: run(name, over + extra, Path(tmp)) for name, over in conditions.items()}
    print(f"{'condition':10s} {'arm':16s} {'n':>4s} {'multi':>7s} {'esr':>7s} {'improve':>7s} {'delta':>7s}")
    for name, m in res.items():
        for arm in ("steered", "unsteered", "otd_ablation"):
            if f"test/{arm}/n" in m:
                r = {k: m.get(f"test/{arm}/{k}", math.nan) for k in ("n", "multi_attempt", "esr", "improvement", "mean_delta")}
                print(f"{name:10s} {arm:16s} {r['n']:4.0f} {r['multi_attempt']:7.3f} {r['esr']:7.3f} "
                      f"{r['improvement']:7.3f} {r['mean_delta']:7.2f}")  # nan: no multi-attempt answer
        if "test/random_ablation/multi_attempt" in m:
            print(f"{name:10s} {'random_ablation':16s}      {m['test/random_ablation/multi_attempt']:7.3f} "
                  f"{m['test/random_ablation/esr']:7.3f}")
        print(f"{name:10s} detectors={m.get('test/otd/count', 0):.0f}  SAE VE={m.get('test/sae/variance_explained', float('nan')):.3f} "
              f"L0={m.get('test/sae/l0', float('nan')):.1f}")
    return res


def _count(m: dict, key: str, arm: str = "steered") -> tuple[int, int]:
    """(answers with the property, answers) of one run's arm: the rate times its count."""
    n = int(m[f"test/{arm}/n"])
    return round(m[f"test/{arm}/{key}"] * n), n


def claims(res: dict, argv: list[str]):
    """Claims for benchmarks/results/esr.json, judged by benchmarks/stats.py: one run per condition, so intervals
    are over its answers (Wilson; Newcombe for a difference of two runs' rates: 0 of 32 against 0 of 32 is no exact
    tie), the best meta-prompt a choice among the four (Bonferroni)."""
    from benchmarks import stats
    from benchmarks.figures import bars
    from benchmarks.schema import arms_table, backbone_size

    base = res["base"]
    sfts = {k: v for k, v in res.items() if k.startswith("sft_")}
    metas = {k: v for k, v in res.items() if k.startswith("meta_")}
    n_base = int(base["test/steered/n"])
    out = []
    k_un = sum(_count(m, "multi_attempt", "unsteered")[0] for m in res.values())
    n_un = sum(_count(m, "multi_attempt", "unsteered")[1] for m in res.values())
    out.append(stats.claim(
        "unsteered_control", "Large language models can resist task-misaligned activation steering",
        f"multi-attempt rate of unsteered answers, pooled over the {len(res)} runs", stats.proportion(k_un, n_un,
                                                                                                       "answers"),
        expect="<", threshold=0.05, n_seeds=1, n_items=n_un, role="control",
        paper_value="0 of 13,118 unsteered answers restart (table 'Headline')",
        our_threshold="below 5%: unsteered answers almost never restart", why=f"{k_un} of {n_un} unsteered answers"))
    out.append(stats.not_measurable(
        "scale", "Llama-3.3-70B shows substantial ESR, while smaller models from the Llama-3 and Gemma-2 families exhibit "
        "the phenomenon less frequently", "ESR rate of the tiny base model (reported, not judged)",
        paper_value="70B ESR 3.8%, smaller models < 1% (abstract, table 'Headline')", value=base["test/steered/esr"],
        why="needs Llama-3.3-70B / Gemma-2 with their public SAEs (esr_llama33_70b etc.); tiny base ESR "
            f"{base['test/steered/esr']:.3f}"))
    # detectors vs random ablation, on the run with the most restarts: the rates after each ablation
    best = max(res.values(), key=lambda m: m["test/steered/multi_attempt"])
    n_det = best.get("test/otd/count", 0)
    runnable = n_det and "test/otd_ablation/multi_attempt" in best and best["test/steered/multi_attempt"] > 0
    if runnable:
        k_o, n_o = _count(best, "multi_attempt", "otd_ablation")
        n_r = int(best.get("test/random_ablation/n", best["test/steered/n"]))
        k_r = round(best["test/random_ablation/multi_attempt"] * n_r)
        est = stats.proportion_diff(k_r, n_r, k_o, n_o, "answers")
    else:
        est = stats.single(None)
    out.append(stats.claim(
        "otd_ablation", "Zero-ablating these latents reduces the multi-attempt rate by 25\\%",
        "multi-attempt after ablating random equal-size sets minus after ablating the detectors", est, expect=">",
        n_seeds=1, n_items=int(best["test/steered/n"]),
        paper_value="26 detectors; multi-attempt 7.4 → 5.5% (vs 7.9% random): table 'OTD ablation'",
        degenerate=None if runnable else "no detector found or no restart to cut",
        why=f"{n_det:.0f} detectors; multi-attempt {best['test/steered/multi_attempt']:.3f} before ablation"))
    if metas:
        k_b, n_b = _count(base, "multi_attempt")
        diffs = {k: stats.proportion_diff(*_count(m, "multi_attempt"), k_b, n_b, "answers", candidates=len(metas))
                 for k, m in metas.items()}
        k = max(diffs, key=lambda x: diffs[x].value)
        out.append(stats.claim(
            "meta_prompt", "meta-prompts instructing the model to self-monitor increase the multi-attempt rate by "
            "5$\\times$ for Llama-3.3-70B", f"multi-attempt, best of {len(metas)} meta-prompts minus none (tiny base)",
            diffs[k], expect=">", n_seeds=1, n_items=n_base,
            paper_value="multi-attempt 7.4 → 31.7% on Llama-3.3-70B (abstract)",
            why=f"{k}: {metas[k]['test/steered/multi_attempt']:.3f} vs {base['test/steered/multi_attempt']:.3f}; a "
                "tiny LM never saw such instructions"))
    for name, m in sfts.items():
        est = stats.proportion_diff(*_count(m, "multi_attempt"), *_count(base, "multi_attempt"), "answers")
        out.append(stats.claim(
            f"finetune_{name}", "fine-tuning on self-correction examples successfully induces ESR-like behavior in "
            "smaller models", f"multi-attempt, fine-tuned ({name}) minus base", est, expect=">", n_seeds=1,
            n_items=int(m["test/steered/n"]),
            paper_value="ESR-like behaviour induced at 10–90% mix (table 'Fine-tuning')",
            why=f"multi {m['test/steered/multi_attempt']:.3f} vs {base['test/steered/multi_attempt']:.3f}; "
                f"ESR {m['test/steered/esr']:.3f} vs {base['test/steered/esr']:.3f}"))
    table = arms_table("per run: steered answers' multi-attempt and ESR rates, unsteered multi-attempt, detectors",
                       ["run", "multi-attempt", "ESR", "steered n", "unsteered multi-attempt", "unsteered n",
                        "detectors"],
                       [[k, m["test/steered/multi_attempt"], m["test/steered/esr"], int(m["test/steered/n"]),
                         m["test/unsteered/multi_attempt"], int(m["test/unsteered/n"]), m.get("test/otd/count", 0)]
                        for k, m in res.items()])
    fig = bars(table, ROOT / "outputs" / "benchmarks" / "esr" / "rates.png", ["multi-attempt", "ESR"],
               ylabel="rate over steered answers", title="esr_tiny: multi-attempt and ESR per run")
    scale = {"model": "tiny-lm (LLaMA, hidden 128) + a trained SAE", **backbone_size("esr_tiny"),
             "data": "esr_tiny topics; self-correction fine-tunes at mix " + ", ".join(k[4:] for k in sfts),
             "steps": "esr_tiny's fine-tune (trainer.max_steps)", "seeds": 1,
             "eval": f"{n_base} steered and {int(base['test/unsteered/n'])} unsteered answers per run, {len(res)} runs"}
    return out, [fig], {"scale": scale, "arms": [table]}


if __name__ == "__main__":
    from benchmarks.schema import run_benchmark

    run_benchmark("esr", main, claims)
