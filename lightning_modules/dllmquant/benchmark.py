"""DLLMQuant benchmark on the cached tiny-mdlm: the same arithmetic prompts and calibration budget for every method.

    python -m benchmarks dllmquant              # 7 methods × W4A4 / W4A16, 32 calibration states, 32 test problems: 2.9 min measured
    python -m benchmarks dllmquant --quick      # 3 methods at W4A4, 8 states, 4 problems (a wiring check)

Methods (each one run of experiment ``dllmquant_tiny`` with overrides; FP is the reference every run also scores):
RTN, GPTQ-text, AWQ-text (plain sequences, no token weights, V at plain absmax), +TMAS (GPTQ, TMAS states),
+CGQ (GPTQ on CGQ-weighted TMAS states), all three (TMAS + CGQ + IA-AQ). Reported per method and bits:
accuracy (exact sampled solution), KL(FP ‖ Q) in bits at mask ratios 0.9 / 0.5 / 0.1, the KL growth over the FP
trajectory's denoising steps (least-squares slope, bits per step) and the quantization time.
"""
from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from benchmarks.schema import run_benchmark

OFF = ["model.cgq.enabled=false", "model.iaaq.enabled=false"]
METHODS = {
    "rtn": ["model/quantizer=rtn", "model.quantizer.grid=minmax_group", "model.calib=text", *OFF],  # the baselines' grid
    "gptq_text": ["model.calib=text", *OFF],
    "awq_text": ["model/quantizer=awq", "model.calib=text", *OFF],
    "tmas": ["model.calib=tmas", *OFF],
    "cgq": ["model.calib=tmas", "model.cgq.enabled=true", "model.iaaq.enabled=false"],
    "full": ["model.calib=tmas"],
    "awq_full": ["model/quantizer=awq", "model.calib=tmas"],
}
BITS = {"W4A4": ["model.a_bits=4"], "W4A16": ["model.a_bits=16"]}


def run_one(overrides: list[str]) -> dict:
    from runner import run_experiment

    with tempfile.TemporaryDirectory() as tmp:
        _, metrics = run_experiment("dllmquant_tiny", tmp, overrides)
    if metrics.get("status") != "ok":
        raise RuntimeError(f"dllmquant_tiny {overrides} failed: {metrics.get('status')}")
    return {**metrics["final"], "quant_time_s": metrics["results"]["quantization"]["quant_time_s"],
            "kl_per_step": metrics["results"]["kl_per_step"]}


def main(argv: list[str]) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks dllmquant")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--n-calib", type=int, default=32)
    p.add_argument("--n-test", type=int, default=32)
    args = p.parse_args(argv)
    methods = {k: METHODS[k] for k in ("gptq_text", "tmas", "full")} if args.quick else METHODS
    bits = {"W4A4": BITS["W4A4"]} if args.quick else BITS
    size = (["model.n_calib=8", "model.n_prompts=2", "model.n_test=4", "model.sampler.steps=8", "model.iaaq.grid=8"]
            if args.quick else [f"model.n_calib={args.n_calib}", f"model.n_test={args.n_test}"])
    rows = []
    for b, b_over in bits.items():
        for name, over in methods.items():
            r = run_one([*over, *b_over, *size, "logger=csv"])
            rows.append({"method": name, "bits": b, **r})
            print(f"{b} {name}: acc {r['test/accuracy']:.1f} (FP {r['test/accuracy_fp']:.1f}), KL@0.9 "
                  f"{r['test/kl_bits/r0.9']:.4f}, @0.5 {r['test/kl_bits/r0.5']:.4f}, @0.1 {r['test/kl_bits/r0.1']:.4f}, "
                  f"growth {r['test/kl_growth']:.2e}/step, {r['quant_time_s']:.1f}s", flush=True)
    return {"rows": rows, "quick": args.quick}


def _get(rows, method, bits, key):
    return next((r[key] for r in rows if r["method"] == method and r["bits"] == bits), None)


def _trajectory(rows, method, bits="W4A4"):
    """(steps, KL per step) along the FP trajectory of one run."""
    kl = _get(rows, method, bits, "kl_per_step") or {}
    steps = sorted(kl, key=int)
    return [float(i) for i in steps], [kl[i] for i in steps]


def claims(result: dict, argv: list[str]):
    """Claims for benchmarks/results/dllmquant.json, judged by benchmarks/stats.py. One run per method (one
    calibration draw): KL values are single numbers (inconclusive); the KL growth is a least-squares slope over the
    denoising steps with its t interval, and 'flattest' compares the full method's per-step KL with each other
    method's on the same steps (a paired slope); accuracy counts the same test problems (Newcombe, unpaired: the
    per-problem outcomes are not kept)."""
    from benchmarks import stats
    from benchmarks.schema import arms_table, backbone_size

    rows = result["rows"]
    found = []
    text, tm = _get(rows, "gptq_text", "W4A4", "test/kl_bits/r0.9"), _get(rows, "tmas", "W4A4", "test/kl_bits/r0.9")
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--n-test", type=int, default=32)  # main's: the test problems every run scores
    n_test = 4 if result.get("quick") else ap.parse_known_args(argv)[0].n_test
    found.append(stats.claim(
        "tmas_high_mask", "a calibration method that accounts for both time and mask factors, with the capacity to "
        "capture distributions across timesteps", "KL(FP‖Q) bits/masked token at mask ratio 0.9, W4A4 GPTQ: TMAS − "
        "text calibration (tiny-mdlm)", stats.single(None if tm is None or text is None else tm - text), expect="<",
        n_seeds=1, n_items=n_test, paper_value="TMAS calibration beats text calibration (abstract; no number)",
        why="; ".join(f"{r['bits']} {r['method']} {r['test/kl_bits/r0.9']:.4g}" for r in rows)))
    x, y = _trajectory(rows, "gptq_text")
    found.append(stats.claim(
        "accumulation", "Quantization errors propogate and accumalte progressively during iterations",
        "KL growth along the FP trajectory (least-squares slope, bits/step), W4A4 GPTQ-text",
        stats.slope(x, y, "denoising steps") if x else stats.single(None), expect=">", n_seeds=1, n_items=len(x),
        paper_value="errors accumulate over the denoising steps (abstract)",
        why=f"KL per step {', '.join(f'{v:.3g}' for v in y)}"))
    xf, yf = _trajectory(rows, "full")
    versus = {}
    for m in METHODS:
        xm, ym = _trajectory(rows, m)
        if m != "full" and xm and xm == xf:
            versus[m] = stats.slope(xf, [a - b for a, b in zip(yf, ym)], "denoising steps")
    shown = max(versus.values(), key=lambda e: e.hi if e.hi is not None else -math.inf) if versus else stats.single(None)
    found.append(stats.claim(
        "flattest_growth", "Quantization errors propogate and accumalte progressively during iterations",
        "KL growth slope of the full method minus each other method's, same steps (W4A4; shown: the least clear)", shown,
        expect="<", versus=versus, n_seeds=1, n_items=len(xf),
        paper_value="DLLMQuant limits the accumulation (abstract)",
        why="; ".join(f"{m} {_get(rows, m, 'W4A4', 'test/kl_growth'):.2e}" for m in METHODS
                      if _get(rows, m, "W4A4", "test/kl_growth") is not None)))
    acc_full, acc_awq = _get(rows, "full", "W4A4", "test/accuracy"), _get(rows, "awq_text", "W4A4", "test/accuracy")
    acc_fp = _get(rows, "full", "W4A4", "test/accuracy_fp")
    if None in (acc_full, acc_awq, n_test):
        gain = stats.single(None)
    else:  # accuracies are in percent of n_test problems
        e = stats.proportion_diff(round(acc_full * n_test / 100), n_test, round(acc_awq * n_test / 100), n_test,
                                  "problems")
        gain = stats.Estimate(100 * e.value, 100 * e.lo, 100 * e.hi, None, None, e.n, e.over, e.method, e.level, False)
    found.append(stats.claim(
        "gsm8k_gain", "over 10-point accuracy improvement on GSM8K for LLADA under 4-bit quantization",
        "tiny-mdlm arithmetic accuracy (points), full method minus AWQ-text at W4A4 (not GSM8K, not LLaDA)", gain,
        expect=">", threshold=10.0, n_seeds=1, n_items=n_test,
        paper_value="> 10 points on GSM8K, LLaDA-8B W4A4 (abstract)",
        degenerate="the full-precision tiny model scores 0: nothing to keep" if acc_fp == 0 else None,
        why=f"FP {acc_fp}, full {acc_full}, AWQ {acc_awq}; the paper's figure needs dllmquant_llada_8b vs "
            "awq_llada_8b on a GPU"))
    found.append(stats.not_measurable(
        "awq_drop", "AWQ suffers a 16% accuracy drop on LLADA under W4A4", "LLaDA-8B GSM8K accuracy, AWQ W4A4 vs FP",
        paper_value="AWQ −16% on LLaDA W4A4 (abstract)", why="needs LLaDA-8B (experiment awq_llada_8b) on a GPU"))
    found.append(stats.not_measurable(
        "efficiency", "while enhancing efficiency", "speed-up / memory of int4 kernels",
        paper_value="speed-up > 1.6×, memory 3.2× (the reviews, not the abstract)",
        why="fake quantization only: packed weight bytes are reported, kernels are not claimed"))
    bits = sorted({r["bits"] for r in rows})
    arms = [arms_table("per method (one run each): KL(FP ‖ Q) bits per masked token at mask ratio 0.9, KL growth "
                       "(bits/step) and accuracy (%)",
                       ["method", *(f"{b} KL@0.9" for b in bits), *(f"{b} growth" for b in bits),
                        *(f"{b} accuracy" for b in bits)],
                       [[m, *(_get(rows, m, b, "test/kl_bits/r0.9") for b in bits),
                         *(_get(rows, m, b, "test/kl_growth") for b in bits),
                         *(_get(rows, m, b, "test/accuracy") for b in bits)] for m in METHODS
                        if any(_get(rows, m, b, "test/kl_bits/r0.9") is not None for b in bits)])]
    scale = {"model": "tiny-mdlm (masked-diffusion LLaMA, hidden 128)", **backbone_size("dllmquant_tiny"),
             "data": "rule-induction arithmetic; calibration states as configured (--n-calib)",
             "steps": "none (post-training quantization)", "seeds": 1,
             "eval": f"{n_test} test problems; KL at mask ratios 0.9 / 0.5 / 0.1"}
    return found, [plot_growth(rows)], {"scale": scale, "arms": arms}


def plot_growth(rows: list[dict]) -> Path:
    """KL(FP ‖ Q) per denoising step along the FP trajectory, one line per method (W4A4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["bits"] == "W4A4":
            steps = sorted(r["kl_per_step"], key=int)
            ax.plot([int(i) for i in steps], [r["kl_per_step"][i] for i in steps], marker="o", label=r["method"])
    ax.set(xlabel="denoising step (FP trajectory)", ylabel="KL(FP ‖ Q), bits per masked token", yscale="log",
           title="tiny-mdlm W4A4: error along the denoising steps")
    ax.legend(fontsize=8)
    path = Path(tempfile.mkdtemp()) / "kl_steps.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    run_benchmark("dllmquant", main, claims)
