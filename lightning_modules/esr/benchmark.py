"""ESR benchmark on the tiny stand-in (esr_tiny): base vs self-correction fine-tunes (mix 0.1 / 0.5 / 0.9), steered vs
unsteered, off-topic-detector ablation vs random equal-size sets, and the four meta-prompts on the base model.
Every run reports multi-attempt, ESR, improvement, mean Δ and binomial SEs (test/<condition>/*).

    python -m benchmarks esr                 # 8 runs of esr_tiny (~1 min each idle)
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


def _diff(a: dict, b: dict, key: str, arm: str = "steered"):
    """a − b of a rate, with the SE of a difference of two independent binomial proportions."""
    pa, pb = a[f"test/{arm}/{key}"], b[f"test/{arm}/{key}"]
    na, nb = a[f"test/{arm}/n"], b[f"test/{arm}/n"]
    return pa - pb, math.sqrt(pa * (1 - pa) / na + pb * (1 - pb) / nb) or None


def claims(res: dict, argv: list[str]):
    from benchmarks.schema import Claim, verdict_at_least, verdict_at_most

    base = res["base"]
    sfts = {k: v for k, v in res.items() if k.startswith("sft_")}
    metas = {k: v for k, v in res.items() if k.startswith("meta_")}
    out = []
    un = max(m["test/unsteered/multi_attempt"] for m in res.values())
    n_un = sum(m["test/unsteered/n"] for m in res.values())
    out.append(Claim("unsteered_control", "Large language models can resist task-misaligned activation steering",
                     "multi-attempt rate of unsteered answers (max over runs)", un, "paper: 0 of 13,118 unsteered",
                     verdict_at_most(un, 0.0), f"{un:.3f} over {n_un:.0f} unsteered answers in {len(res)} runs",
                     None, int(n_un)))
    out.append(Claim("scale", "Llama-3.3-70B shows substantial ESR, while smaller models from the Llama-3 and Gemma-2 "
                     "families exhibit the phenomenon less frequently", "ESR rate of the tiny base model",
                     base["test/steered/esr"], "paper: 70B 3.8%, smaller < 1%", "not_measurable_here",
                     "needs Llama-3.3-70B / Gemma-2 with their public SAEs (esr_llama33_70b etc.); tiny base ESR "
                     f"{base['test/steered/esr']:.3f}", base["test/steered/esr_se"], None))
    # detectors vs random ablation, on the run with the most restarts
    best = max(res.values(), key=lambda m: m["test/steered/multi_attempt"])
    n_det = best.get("test/otd/count", 0)
    if n_det and "test/otd_ablation/multi_attempt" in best and best["test/steered/multi_attempt"] > 0:
        d, se = _diff(best, best, "multi_attempt", "otd_ablation")
        cut = best["test/steered/multi_attempt"] - best["test/otd_ablation/multi_attempt"]
        rnd = best["test/steered/multi_attempt"] - best["test/random_ablation/multi_attempt"]
        out.append(Claim("otd_ablation", "Zero-ablating these latents reduces the multi-attempt rate by 25\\%",
                         "multi-attempt cut by detector ablation minus the cut by random equal-size sets", cut - rnd,
                         "> 0 (paper: 7.4 -> 5.5% vs random 7.9%)", verdict_at_least(cut - rnd, 0.0, se, strict=True),
                         f"{n_det:.0f} detectors: cut {cut:.3f} vs random {rnd:.3f}", se, None))
    else:
        out.append(Claim("otd_ablation", "Zero-ablating these latents reduces the multi-attempt rate by 25\\%",
                         "detectors found / multi-attempt to cut", float(n_det), "paper: 26 detectors, 7.4 -> 5.5%",
                         "inconclusive", f"{n_det:.0f} detectors (0 on every matched pair, >= 80% of mismatched) and "
                         f"multi-attempt {best['test/steered/multi_attempt']:.3f}: nothing to ablate", None, None))
    d_meta = [(_diff(m, base, "multi_attempt"), k) for k, m in metas.items()]
    (d, se), k = max(d_meta, key=lambda x: x[0][0])
    out.append(Claim("meta_prompt", "meta-prompts instructing the model to self-monitor increase the multi-attempt "
                     "rate by 5$\\times$ for Llama-3.3-70B", "multi-attempt, best meta-prompt minus none (tiny base)", d,
                     "> 0 (paper: 7.4 -> 31.7% on 70B)", verdict_at_least(d, 0.0, se, strict=True),
                     f"{k}: {metas[k]['test/steered/multi_attempt']:.3f} vs {base['test/steered/multi_attempt']:.3f}; a "
                     "tiny LM never saw such instructions", se, None))
    for name, m in sfts.items():
        d, se = _diff(m, base, "multi_attempt")
        de, see = _diff(m, base, "esr")
        out.append(Claim(f"finetune_{name}", "fine-tuning on self-correction examples successfully induces ESR-like "
                         "behavior in smaller models", f"multi-attempt, fine-tuned ({name}) minus base", d,
                         "> 0 (paper: rises at 10-90% mix)", verdict_at_least(d, 0.0, se, strict=True),
                         f"multi {m['test/steered/multi_attempt']:.3f} vs {base['test/steered/multi_attempt']:.3f}; "
                         f"ESR {m['test/steered/esr']:.3f} vs {base['test/steered/esr']:.3f} (diff {de:+.3f})", se, None))
    return out, []


if __name__ == "__main__":
    from benchmarks.schema import run_benchmark

    run_benchmark("esr", main, claims)
