"""One-off: upgrade the schema-1 results files (before the verdict rule of ``benchmarks/stats.py``, issue 41) to
schema 2, keeping every measured number and recomputing each verdict from what the file stores.

    python -m benchmarks.migrate_v1            # rewrites benchmarks/results/<paper>.json in place, prints the changes

A schema-1 claim stored a value, sometimes a standard error and a count ``n`` whose meaning varied (seeds, items,
updates), and a ``target`` string mixing the paper's figures with our thresholds. This file states, per claim, what
the stored numbers are: the replicates behind the SE (``n_seeds`` and ``n_items`` apart), the expected direction,
the threshold and whose it is, the paper's figure, and whether the claim is a control or true by construction. The
interval is rebuilt from the stored SE with the rule's quantile (t on the seeds' degrees of freedom; Newcombe from
the counts quoted in ``why``; a stored interval kept as it is); what the file does not store (per-seed values, a
competitor's spread) is not invented: such a claim is judged on what is there, and said so in ``note``. Each file
records ``provenance`` (measured under schema 1, verdicts recomputed) and ``migrated`` (old verdict → new, why),
which ``benchmarks/report.py`` lists until ``python -m benchmarks.all`` reruns everything. Delete this module after
that rerun: it describes files that will no longer exist.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict

from benchmarks import stats as S
from benchmarks.schema import RESULTS, SCHEMA_VERSION, arms_table, validate
from benchmarks.stats import UNKNOWN

U = UNKNOWN
Z95 = 1.959964


# --- how a stored claim becomes an estimate --------------------------------------------------------------------
def t_seeds(n: int, paired: bool | None = None):
    """The stored SE is over ``n`` seeds: t on n − 1 degrees of freedom."""
    return lambda c: S.from_se(c["value"], c.get("stderr"), n - 1, n, "seeds", "t (stored SE)", paired=paired)


def t_items(n: int, over: str, paired: bool | None = None, df: int | None = None):
    """The stored SE is over ``n`` items of one run."""
    return lambda c: S.from_se(c["value"], c.get("stderr"), n - 1 if df is None else df, n, over, "t (stored SE)",
                               paired=paired)


def none(c):
    return S.single(c["value"])


def newcombe(k1, n1, k2, n2, over, scale=1.0, candidates=1):
    def est(c):
        e = S.proportion_diff(k1, n1, k2, n2, over, candidates=candidates)
        return S.Estimate(e.value * scale, e.lo * scale, e.hi * scale, None, None, e.n, over, e.method, e.level, False,
                          candidates)
    return est


def interval95(lo, hi, n, over):
    """A stored normal 95% interval, re-read at the rule's 90%."""
    return lambda c: S.from_se(c["value"], (hi - lo) / (2 * Z95), None, n, over, "normal (stored 95% interval)",
                               paired=True)


def fixed(e):
    return lambda c: e


# --- per paper: claims, scale, per-arm tables ------------------------------------------------------------------
TINY_LM = "tiny-lm (LLaMA, hidden 128)"
SPARD_ASR = 1.0 - 0.11979166666666663  # spard's mean ASR: sft's 1.000 minus the stored asr_vs_sft
P = dict  # a claim's migration


def _spec() -> dict:
    """paper -> {"claims": {id: spec}, "scale": {...}, "arms": [...], "command": optional fix}."""
    # error_law: log r differences, delimited - plain, from the stored 90% Fisher intervals
    def logdiff(plain, delim):
        (pe, plo, phi), (de, dlo, dhi) = plain, delim
        sp_, sd_ = ((math.log(h) - math.log(lo_)) / (2 * 1.644854) for lo_, h in ((plo, phi), (dlo, dhi)))
        return S.from_se(math.log(de / pe), math.hypot(sp_, sd_), None, 640, "instances",
                         "normal on log r (observed information)")
    copy_d = logdiff((0.0207, 0.0153, 0.028), (0.0124, 0.0094, 0.0162))
    rev_d = logdiff((0.0262, 0.0202, 0.034), (0.0495, 0.0378, 0.0649))
    ratios = [6.03, 18.08, 6.58, 2.82]
    return {
        "curvature": {
            "scale": {"model": TINY_LM, "params": 1311872, "layers": 4,
                      "data": "embedded corpus (test split); λ runs on lm_tiny's recipe",
                      "steps": "500 per λ run (λ = 0, 0.1); tiny-lm as cached", "seeds": 1,
                      "eval": "1024 perturbed tokens (64 sequences × 16); r over ~16,000 test tokens"},
            "arms": [arms_table("perturbation at the middle layer, s = 0.5: mean ΔH (nats) over 1024 tokens, 95% "
                                "interval (as stored)", ["perturbation", "ΔH", "95% lo", "95% hi"],
                                [["extrapolation", 0.3256, 0.2792, 0.3720], ["straight", 0.2650, 0.2246, 0.3054],
                                 ["orthogonal", 0.5515, 0.5203, 0.5826], ["curvy", 0.4324, 0.3848, 0.4799]]),
                     arms_table("regulariser runs (one seed each)", ["run", "val mean entropy", "val loss",
                                                                       "κ at regularised layers"],
                                [["λ = 0", 4.6563, 4.5637, 2.0523], ["λ = 0.1", 4.6996, 4.5643, 1.9485]])],
            "claims": {
                "straightening": P(est=none, expect=">", n_seeds=1, n_items=U,
                                   paper_value="κ falls from the early to the middle layers (GPT-2 XL, Pythia-2.8B: "
                                               "table 'Layer profile and correlation')"),
                "correlation": P(est=lambda c: S.correlation(c["value"], 16000, "tokens", candidates=3), expect=">",
                                 n_seeds=1, n_items=16000,
                                 paper_value="r ≈ 0.15 in the middle layers (GPT-2 XL / Pythia-2.8B)",
                                 note="the best of 3 middle layers: Bonferroni over 3"),
                "emergence": P(est=lambda c: S.from_se(c["value"], math.sqrt(2 / (16000 - 3)), None, 16000, "tokens",
                                                       "Fisher z difference (independent)", candidates=3),
                               expect=">", n_seeds=1, n_items=16000,
                               paper_value="r ≈ 0 at init, rising with training (Pythia checkpoints: table "
                                           "'Emergence')",
                               note="two correlations on ~16,000 val tokens, the best of 3 middle layers"),
                "aligned_extrapolation": P(est=interval95(0.2792, 0.3720, 1024, "tokens"), expect="<", n_seeds=1,
                                           n_items=1024,
                                           paper_value="trajectory-aligned perturbations lower next-token entropy "
                                                       "(table 'Perturbation')",
                                           note="the spec expects a fall; the measured ΔH is a rise"),
                "aligned_straight": P(est=interval95(0.2246, 0.3054, 1024, "tokens"), expect="<", n_seeds=1,
                                      n_items=1024,
                                      paper_value="trajectory-aligned perturbations lower next-token entropy "
                                                  "(table 'Perturbation')",
                                      note="the spec expects a fall; the measured ΔH is a rise"),
                "misaligned_orthogonal": P(est=interval95(0.5203, 0.5826, 1024, "tokens"), expect="within", margin=0.05,
                                           n_seeds=1, n_items=1024, paper_value="no effect (table 'Perturbation')",
                                           our_threshold="|ΔH| < 0.05 nats (about 1% of the mean entropy, 4.66): "
                                                         "'no effect' needs a margin"),
                "misaligned_curvy": P(est=interval95(0.3848, 0.4799, 1024, "tokens"), expect="within", margin=0.05,
                                      n_seeds=1, n_items=1024, paper_value="no effect (table 'Perturbation')",
                                      our_threshold="|ΔH| < 0.05 nats (about 1% of the mean entropy, 4.66): "
                                                    "'no effect' needs a margin"),
                "reg_entropy": P(est=none, expect="<", n_seeds=1, n_items=U,
                                 paper_value="entropy modestly lower (table 'Regulariser')"),
                "reg_val_loss": P(est=none, expect="<", threshold=0.01, n_seeds=1, n_items=U,
                                  paper_value="validation loss not degraded (table 'Regulariser')",
                                  our_threshold="+1% of λ = 0's val loss counts as not degraded"),
                "two_models": P(paper_value="peak r ≈ 0.15 in the middle layers (GPT-2 XL, Pythia-2.8B)"),
            }},
        "dllmquant": {
            "scale": {"model": "tiny-mdlm (masked-diffusion LLaMA, hidden 128)", "params": 1074816, "layers": 4,
                      "data": "rule-induction arithmetic; 32 calibration states", "steps": "none (post-training "
                      "quantization)", "seeds": 1, "eval": "32 test problems; KL at mask ratios 0.9 / 0.5 / 0.1"},
            "arms": [arms_table("KL(FP ‖ Q) bits per masked token at mask ratio 0.9 (one run each)",
                                ["method", "W4A4", "W4A16"],
                                [["rtn", 0.2256, 0.008919], ["gptq_text", 0.1096, 0.004811],
                                 ["awq_text", 0.09524, 0.006569], ["tmas", 0.1389, 0.0009224],
                                 ["cgq", 0.1454, 0.0009088], ["full", 0.1415, 0.0009088],
                                 ["awq_full", 0.04538, 0.006503]]),
                     arms_table("KL growth along the FP trajectory, W4A4 (slope, bits per step)", ["method", "slope"],
                                [["rtn", -5.90e-03], ["gptq_text", -4.88e-04], ["awq_text", -5.58e-03],
                                 ["tmas", -1.54e-03], ["cgq", -1.74e-03], ["full", 1.01e-03], ["awq_full", -2.76e-04]])],
            "claims": {
                "tmas_high_mask": P(est=none, expect="<", threshold=0.1096, n_seeds=1, n_items=32,
                                    paper_value="TMAS calibration beats text calibration (abstract; no number)",
                                    note="threshold: the text arm's own single number"),
                "accumulation": P(est=none, expect=">", n_seeds=1, n_items=32,
                                  paper_value="errors accumulate over the denoising steps (abstract)",
                                  note="the per-step KL is not stored: no slope interval until the rerun"),
                "flattest_growth": P(est=none, expect="<", n_seeds=1, n_items=32,
                                     paper_value="DLLMQuant limits the accumulation (abstract)",
                                     note="full vs every other method: single slopes"),
                "gsm8k_gain": P(est=none, expect=">", threshold=0.10, n_seeds=1, n_items=32,
                                paper_value="> 10 points on GSM8K, LLaDA-8B W4A4 (abstract)",
                                degenerate="the full-precision tiny model scores 0: nothing to keep"),
                "awq_drop": P(paper_value="AWQ −16% on LLaDA W4A4 (abstract)"),
                "efficiency": P(paper_value="speed-up > 1.6×, memory 3.2× (the reviews, not the abstract)"),
            }},
        "error_law": {
            "command": "python -m benchmarks error_law",
            "provenance": "the schema-1 numbers were summarised (--from-run) from an error_law_tiny run in a temporary "
                          "folder whose settings were not recorded; the command above trains its own (1200 steps, 64 "
                          "instances per cell), and its wall time (47 s) is the summary's alone",
            "scale": {"model": "tiny char LLaMA (error_law_tiny)", "params": 115008, "layers": 2,
                      "data": "copy / reversal × plain / delimited, n ≤ 20", "steps": 1200, "seeds": 1,
                      "eval": "64 instances per (task, format, n) at n = 2, 4, ..., 20; planted: 500 per n"},
            "arms": [arms_table("r of the gamma law per task and format (90% interval, as stored)",
                                ["task", "format", "r", "90% lo", "90% hi"],
                                [["copy", "plain", 0.0207, 0.0153, 0.028], ["copy", "delimited", 0.0124, 0.0094, 0.0162],
                                 ["reversal", "plain", 0.0262, 0.0202, 0.034],
                                 ["reversal", "delimited", 0.0495, 0.0378, 0.0649]]),
                     arms_table("gamma-law Pearson χ²/dof per group (8 dof each)", ["group", "χ²/dof"],
                                [["copy/delimited", 6.03], ["copy/plain", 18.08], ["reversal/delimited", 6.58],
                                 ["reversal/plain", 2.82]])],
            "claims": {
                "planted_recovery": P(est=none, expect="<", threshold=0.10, n_seeds=1, n_items=5000, role="control",
                                      our_threshold="10%: a fitter that recovers planted constants"),
                "gamma_beats_exponential_heldout": P(est=fixed(S.proportion(4, 4, "groups")), expect=">",
                                                     threshold=0.5, n_seeds=1, n_items=4,
                                                     paper_value="excellent agreement (abstract)",
                                                     our_threshold="more than half of the groups"),
                "gamma_fit_quality": P(est=fixed(S.dispersion(8 * sum(ratios), 32, "cells")), expect="<",
                                       threshold=1.5, n_seeds=1, n_items=40,
                                       metric="Pearson χ²/dof of the gamma law pooled over the 4 non-degenerate "
                                              "groups (1 = binomial noise)",
                                       paper_value="excellent agreement (abstract)",
                                       our_threshold="χ²/dof ≤ 1.5: within 50% of binomial noise",
                                       note="pooled χ² (32 dof) instead of the median, for an interval"),
                "delimiters_lower_r": P(est=fixed(rev_d), versus={"copy": copy_d, "reversal": rev_d}, expect="<",
                                        n_seeds=1, n_items=640,
                                        metric="log(r delimited / r plain) per task (every task below 0)",
                                        paper_value="prompts can be built to reduce the error rate (abstract)",
                                        note="log-r differences from the stored 90% intervals, every task"),
                "halves_agree": P(est=none, expect="within", margin=math.log(1.5), n_seeds=1, n_items=320,
                                  our_threshold="r and q of the two halves within a factor 1.5",
                                  note="overlapping intervals do not show equality, and the halves' numbers are not "
                                       "stored"),
                "api_models": P(paper_value="excellent agreement in most cases (Gemini 2.5 Flash / Pro, DeepSeek R1)"),
            }},
        "esr": {
            "figure": ("rates", ["multi-attempt", "ESR"], "rate over 32 steered answers", None),
            "scale": {"model": TINY_LM + " + a trained SAE", "params": 1311872, "layers": 4,
                      "data": "esr_tiny topics; self-correction fine-tunes at mix 0.1 / 0.5 / 0.9",
                      "steps": "100 per fine-tune", "seeds": 1, "eval": "32 steered and 24 unsteered answers per run, "
                      "8 runs"},
            "arms": [arms_table("multi-attempt rate of steered answers (32 per run)", ["run", "multi-attempt", "ESR"],
                                [["base", 0.0, 0.0], ["sft_0.1", 0.0, 0.0], ["sft_0.5", 0.03125, 0.03125],
                                 ["sft_0.9", 0.03125, 0.0], ["meta_1 (best meta-prompt)", 0.0, None]])],
            "claims": {
                "unsteered_control": P(est=fixed(S.proportion(0, 192, "answers")), expect="<", threshold=0.05,
                                       n_seeds=1, n_items=192, role="control",
                                       paper_value="0 of 13,118 unsteered answers restart (table 'Headline')",
                                       our_threshold="below 5%: unsteered answers almost never restart",
                                       metric="multi-attempt rate of unsteered answers, pooled over the 8 runs"),
                "scale": P(paper_value="70B ESR 3.8%, smaller models < 1% (abstract, table 'Headline')"),
                "otd_ablation": P(est=none, expect=">", n_seeds=1, n_items=32,
                                  paper_value="26 detectors; multi-attempt 7.4 → 5.5% (vs 7.9% random)",
                                  degenerate="no detector found and no restart to cut"),
                "meta_prompt": P(est=newcombe(0, 32, 0, 32, "answers", candidates=4), expect=">", n_seeds=1,
                                 n_items=32, paper_value="multi-attempt 7.4 → 31.7% on Llama-3.3-70B (abstract)",
                                 note="the best of 4 meta-prompts: Bonferroni over 4; 0/32 vs 0/32 is no exact 0"),
                "finetune_sft_0.1": P(est=newcombe(0, 32, 0, 32, "answers"), expect=">", n_seeds=1, n_items=32,
                                      paper_value="ESR-like behaviour induced at 10–90% mix (table 'Fine-tuning')",
                                      note="0/32 vs 0/32 is no exact 0"),
                "finetune_sft_0.5": P(est=newcombe(1, 32, 0, 32, "answers"), expect=">", n_seeds=1, n_items=32,
                                      paper_value="ESR-like behaviour induced at 10–90% mix (table 'Fine-tuning')"),
                "finetune_sft_0.9": P(est=newcombe(1, 32, 0, 32, "answers"), expect=">", n_seeds=1, n_items=32,
                                      paper_value="ESR-like behaviour induced at 10–90% mix (table 'Fine-tuning')"),
            }},
        "growth": {
            "scale": {"model": "tiny Mixtral MoE (4 experts, top-2), grown ×2 in depth and width",
                      "params": 2296960, "layers": 4, "data": "embedded corpus, seq 128 × batch 8",
                      "steps": "source 240 (snapshots 0 / 80 / 160), +100 per arm", "seeds": 1,
                      "eval": "held-out test loss"},
            "arms": [arms_table("test loss per arm (one run each)", ["arm", "test loss"],
                                [["interposition (grown, α = 0.01)", 5.1792], ["stack", 5.1770], ["α = 0", 5.1799],
                                 ["random router", 5.1783], ["scratch, same extra steps", 6.262],
                                 ["scratch, equal total compute", 5.901]]),
                     arms_table("sunk cost: test loss after growth + 100 steps, per source step", ["source step",
                                                                                                  "test loss"],
                                [[0, 6.367], [80, 5.732], [160, 5.340], [240, 5.179]])],
            "claims": {
                "sunk_cost_correlation": P(est=lambda c: S.correlation(c["value"], 4, "snapshots"), expect="<",
                                           threshold=-0.7, n_seeds=1, n_items=4,
                                           paper_value="3B: 38.79 → 48.99 accuracy from source step 0k to 88k "
                                                       "(table 'Sunk cost')",
                                           our_threshold="r ≤ −0.7 for a strong correlation"),
                "grown_vs_scratch_extra": P(est=none, expect=">", n_seeds=1, n_items=U,
                                            paper_value="+10.6% accuracy over scratch at the same extra compute "
                                                        "(abstract)"),
                "grown_vs_scratch_total": P(est=none, expect=">", n_seeds=1, n_items=U,
                                            paper_value="grown 70B 64.17 vs scratch 57.99 (table 'Main')"),
                "noise_helps": P(est=none, expect=">", n_seeds=1, n_items=U,
                                 paper_value="α = 0.01 about +1 point over α = 0 (table 'Width: noise ablation')"),
                "random_router_worse": P(est=none, expect=">", n_seeds=1, n_items=U,
                                         paper_value="random-init new experts worse (table 'Width: noise ablation')"),
                "interposition_vs_stack": P(est=none, expect=">", n_seeds=1, n_items=U,
                                            paper_value="interposition beats stacking past F_c = 6 N_a (20 N_a)",
                                            degenerate="the source's FLOPs are 0.008 × F_c, before the Chinchilla "
                                                       "point the ordering needs"),
                "norm_seam": P(est=none, expect=">", threshold=1.0, n_seeds=1, n_items=None, role="by_construction",
                               paper_value="stacking's norm cliff at the seam (L19 → L20: 0.0356 → 0.0323)",
                               note="interposition's ratio is 1 by construction"),
                "scale_70b": P(paper_value="avg accuracy 64.17 (17B → 70B grown) vs 57.99 (70B scratch), table "
                                           "'Main'"),
            }},
        "hici": {
            "figure": ("retrieval", ["accuracy"], "retrieval accuracy (256 samples)", 0.125),
            "scale": {"model": TINY_LM + " with LoRA + embed/norm (hici_tiny)", "params": 1311872, "layers": 4,
                      "data": "key–value retrieval at 64 tokens, 4 segments (chance 1/8)", "steps": "300 × 16 per arm",
                      "seeds": 1, "eval": "256 held-out samples per arm and mode"},
            "arms": [arms_table("retrieval accuracy on 256 held-out samples (training-time pattern)",
                                ["arm", "accuracy", "hits"],
                                [["segment-local", 0.1367, 35], ["S²-Attn no_wrap", 0.1367, 35],
                                 ["HiCI causal_shift_g", 0.6406, 164], ["HiCI, full-mode eval", 0.09375, 24],
                                 ["full attention", 1.0, 256]])],
            "claims": {
                "go_full_attention_learns": P(est=fixed(S.proportion(256, 256, "samples")), expect=">", threshold=0.8,
                                              n_seeds=1, n_items=256, role="control",
                                              metric="full attention's retrieval accuracy",
                                              our_threshold="0.8: go/no-go, the task is learnable in the budget"),
                "local_at_chance": P(est=fixed(S.proportion(35, 256, "samples")), expect="within", threshold=0.125,
                                     margin=0.05, n_seeds=1, n_items=256, role="by_construction",
                                     our_threshold="chance 1/8 ± 0.05"),
                "hici_above_local": P(est=newcombe(164, 256, 35, 256, "samples"), expect=">", n_seeds=1, n_items=256,
                                      paper_value="consistent improvements over strong baselines (abstract)",
                                      note="the arms share the samples; per-sample outcomes are not stored: "
                                           "unpaired (conservative)"),
                "hici_close_to_full": P(est=newcombe(164, 256, 256, 256, "samples"), expect=">", threshold=-0.10,
                                        n_seeds=1, n_items=256,
                                        our_threshold="within 10 points of full attention"),
                "s2_above_local": P(est=newcombe(35, 256, 35, 256, "samples"), expect=">", n_seeds=1, n_items=256),
                "s2_below_full": P(est=newcombe(35, 256, 256, 256, "samples"), expect="<", n_seeds=1, n_items=256),
                "hici_full_mode_not_worse": P(est=newcombe(24, 256, 164, 256, "samples"), expect=">", threshold=-0.05,
                                              n_seeds=1, n_items=256,
                                              our_threshold="full-mode inference within 5 points of hici-mode"),
                "context_100k": P(paper_value="100K tokens (LLaMA-2-7B), 64K (13B): abstract"),
            }},
        "hista": {
            "scale": {"model": TINY_LM + " warmed up on 1-digit arithmetic", "params": 1311872, "layers": 4,
                      "data": "1-digit arithmetic (sveb_tiny, hista_tiny)", "steps": "60 updates per arm", "seeds": 1,
                      "eval": "SVEB 32 problems × (32 samples + 20 continuations); 28 val problems"},
            "arms": [arms_table("final greedy val accuracy (28 problems; the claims said 32)", ["estimator", "accuracy"],
                                [["grpo", 0.2143], ["numca", 0.1429], ["hista", 0.0714]])],
            "claims": {
                "critic_collapse_ppo_1": P(est=t_items(32, "cases", paired=True), expect=">", n_seeds=1, n_items=32,
                                           paper_value="PPO critics collapse to the group average (abstract)"),
                "critic_collapse_ppo_n": P(est=t_items(5, "cases", paired=True), expect=">", n_seeds=1, n_items=5,
                                           paper_value="PPO critics collapse to the group average (abstract)"),
                "sveb_numca_more_accurate": P(est=t_items(32, "cases", paired=True), expect="<", n_seeds=1,
                                              n_items=32, paper_value="more accurate state values (abstract)"),
                "sveb_hista_more_accurate": P(est=t_items(32, "cases", paired=True), expect="<", n_seeds=1,
                                              n_items=32, paper_value="more accurate state values (abstract)"),
                "training_numca_vs_grpo": P(est=newcombe(4, 28, 6, 28, "val problems"), expect=">", n_seeds=1,
                                            n_items=28, paper_value="better training performance (abstract)",
                                            note="28 val problems, not the 32 the schema-1 claim said"),
                "training_hista_vs_grpo": P(est=newcombe(2, 28, 6, 28, "val problems"), expect=">", n_seeds=1,
                                            n_items=28, paper_value="better training performance (abstract)",
                                            note="28 val problems, not 32; Newcombe instead of z"),
                "overhead_numca": P(est=none, expect="<", threshold=0.10, n_seeds=1, n_items=60,
                                    paper_value="no significant overhead (abstract; no number)",
                                    our_threshold="under 10% of a step's time",
                                    note="per-step times are not stored: no interval until the rerun"),
                "overhead_hista": P(est=none, expect="<", threshold=0.10, n_seeds=1, n_items=60,
                                    paper_value="no significant overhead (abstract; no number)",
                                    our_threshold="under 10% of a step's time",
                                    note="per-step times are not stored: no interval until the rerun"),
                "across_algorithms_and_sizes": P(paper_value="gains across RL algorithms and 1.5B–7B models"),
            }},
        "infolaw": {
            "scale": {"model": "tiny LLaMAs llama_qat_t150k / t300k / t440k (N = 148K, 296K, 443K)", "params": 443264,
                      "layers": 2, "data": "hq / lq corpus mixtures, 5 w_hq × 3 D (sweeps/results/infolaw_tiny.csv)",
                      "steps": "D up to 400K tokens per run (the committed sweep)", "seeds": 1,
                      "eval": "45 cells; held out: w_hq = 0.7 and the largest D (21 cells)"},
            "arms": [arms_table("held-out |relative error| of each law (tiny sweep, one fit each)",
                                ["law", "mean", "max"],
                                [["infolaw", 0.04217, 0.1718], ["chinchilla", 0.05146, 0.15055],
                                 ["muennighoff", 0.05475, 0.15968], ["mixing", 0.04631, 0.17935]])],
            "claims": {
                "planted_recovery": P(est=none, expect="<", threshold=0.10, n_seeds=1, n_items=45, role="control",
                                      our_threshold="10%: a fitter that recovers planted constants"),
                "planted_eta": P(est=fixed(S.bootstrap(0.4661082939507397, [0.430, 0.555], 36, "cells")),
                                 expect=">", n_seeds=1, n_items=36, role="control",
                                 note="the stored 90% case-bootstrap interval [0.430, 0.555], 50 resamples"),
                "tiny_eta": P(est=fixed(S.bootstrap(5.28925440515113, [5.289, 5.289], 24, "cells")), expect=">",
                              n_seeds=1, n_items=24, note="a zero-width bootstrap: η is pinned, not measured"),
                "tiny_repetition": P(est=none, expect=">", n_seeds=1, n_items=3,
                                     paper_value="stronger upweighting increases repetition and can degrade "
                                                 "performance (abstract)"),
                "tiny_baselines": P(est=none, expect="<", n_seeds=1, n_items=21,
                                    paper_value="standard laws do not extrapolate across recipes (abstract)"),
                "tiny_error": P(est=none, expect="<", threshold=0.0096, n_seeds=1, n_items=21,
                                paper_value="0.15% mean, 0.96% max absolute error at 7B / 425B tokens (abstract)",
                                note="threshold: the paper's 0.96% max, a figure at scale"),
                "tiny_recipe": P(est=none, expect="<", n_seeds=1, n_items=9,
                                 paper_value="efficient data-recipe selection under varying budgets (abstract)"),
                "scale_7b": P(paper_value="0.15% mean, 0.96% max absolute loss error (7B, 425B tokens; abstract)"),
            }},
        "instemb": {
            "scale": {"model": TINY_LM + " warmed up on object questions, LoRA", "params": 1311872, "layers": 4,
                      "data": "instemb objects: 2000 training triples", "steps": "100 per arm (5 arms)", "seeds": 2,
                      "eval": "192 test objects × 3 instructions (nDCG@10, V-measure)"},
            "arms": [],
            "claims": {
                **{cid: P(est=t_seeds(2, paired=True), expect=">", n_seeds=2, n_items=192, paper_value=pv)
                   for cid, pv in (("instruction_following", None),
                                   ("beyond_last_token", "DAAP best overall (abstract: last token alone limits)"),
                                   ("last_vs_mean", "mean over all tokens clearly worse"),
                                   ("vs_reencoding", "re-encoding introduces discontinuity (abstract)"),
                                   ("contrast", None),
                                   ("views_collapse", "67.08 → 56.44 without the s2 and output views"),
                                   ("distillation", None),
                                   ("mse_vs_kl", "MSE better on instruction tasks, KL on generic ones"),
                                   ("daap_vs_lookahead", None))},
                "no_decoding_latency": P(est=none, expect=">", threshold=1.0, n_seeds=2, n_items=192,
                                         paper_value="no additional decoding latency (abstract)",
                                         note="the per-seed times are not stored: no interval until the rerun"),
                "benchmarks": P(paper_value="FollowIR 28.5, p-MRR +15.6; instruction mean 67.08 (main table)"),
            }},
        "llr": {
            "scale": {"model": "tiny LLaMA (hidden 64, 4 heads, vocab 2048)", "params": 368960, "layers": 2,
                      "data": "embedded corpus, seq 64 × batch 8", "steps": 120, "seeds": 3,
                      "eval": "4 val batches × 8 × 64 tokens"},
            "arms": [arms_table("final val loss, mean over 3 seeds", ["arm", "final val loss"],
                                [["uniform", 6.1575], ["llr", 5.8165], ["uniform_muon", 5.9169],
                                 ["llr_muon", 5.4596], ["uniform_5x", None]])],
            "claims": {
                "speedup_llr": P(est=t_seeds(3), expect=">", threshold=1.0, n_seeds=3, n_items=None,
                                 paper_value="up to 1.5× training speedup (abstract)"),
                "final_loss_llr": P(est=t_seeds(3, paired=False), expect=">", n_seeds=3, n_items=None,
                                    paper_value="faster convergence, better generalisation (abstract)",
                                    note="the stored SE is unpaired (per-seed losses not stored)"),
                "speedup_llr_muon": P(est=t_seeds(3), expect=">", threshold=1.0, n_seeds=3, n_items=None,
                                      paper_value="gains with AdamW and Muon (abstract)"),
                "final_loss_llr_muon": P(est=t_seeds(3, paired=False), expect=">", n_seeds=3, n_items=None,
                                         paper_value="gains with AdamW and Muon (abstract)",
                                         note="the stored SE is unpaired (per-seed losses not stored)"),
                "zero_shot_1b": P(paper_value="47.09% → 49.02% average zero-shot, 1B (abstract)"),
            }},
        "manifoldkv": {
            "figure": ("needles", ["ManifoldKV", "KeyDiff"], "share of needles kept", None),
            "scale": {"model": "one attention head, d = 64 (planted keys)", "params": None, "layers": None,
                      "data": "4096 haystack keys + 8 needles per trial", "steps": "none", "seeds": 20,
                      "eval": "160 needles (20 trials × 8) per compression ratio"},
            "arms": [arms_table("needles kept (of 160) per press", ["ratio", "ManifoldKV", "KeyDiff"],
                                [[0.2, 0.75, 0.125], [0.4, 0.75, 0.125], [0.5, 0.75, 0.125]])],
            "claims": {
                **{f"needles_vs_keydiff_{r}": P(est=newcombe(120, 160, 20, 160, "needles"), expect=">", n_seeds=20,
                                                n_items=160, role="by_construction",
                                                paper_value="92.4% vs KeyDiff's 77.0% (3-key NIAH at 50%)",
                                                note="the planted magnitudes give 6/8 vs 1/8 at every ratio")
                   for r in ("0.2", "0.4", "0.5")},
                "ruler_4k_16k": P(paper_value="95.7% RULER at 4K–16K, 20% compression (abstract)"),
            }},
        "mdlm_masks": {
            "figure": ("accuracy", ["acc"], "accuracy (%), base arm", None),
            "scale": {"model": "tiny-mdlm (masked-diffusion LLaMA, hidden 128)", "params": 1074816, "layers": 4,
                      "data": "rule induction, 16 tasks", "steps": "200 fine-tune steps (CE-only, CE+TV)", "seeds": 1,
                      "eval": "256 queries per (k, distance) cell"},
            "arms": [arms_table("single-step accuracy (%) at k appended masks, random placement (base)", ["k", "acc"],
                                [[0, 69.1], [8, 69.1], [32, 69.5], [64, 69.9]])],
            "claims": {
                "locality_bias": P(est=t_items(256, "queries", paired=False), expect=">", threshold=5.0, n_seeds=1,
                                   n_items=256, our_threshold="5 points: near beats far by a visible margin",
                                   paper_value="a strong locality bias (abstract)",
                                   note="unpaired over queries (per-query outcomes not stored)"),
                "mask_tax": P(est=t_items(256, "queries", paired=False), expect=">", threshold=5.0, n_seeds=1, n_items=256,
                              paper_value="LLaDA-8B loses 23 points (table 'mask tax')",
                              our_threshold="5 points: a visible tax at tiny scale"),
                "masks_distract": P(est=t_items(256, "queries", paired=False), expect=">", n_seeds=1, n_items=256,
                                    paper_value="~23 vs ~3 points (masks vs fillers)"),
                "ma_loss_mitigates": P(est=t_items(256, "queries", paired=False), expect=">", threshold=3.0,
                                       n_seeds=1, n_items=256,
                                       paper_value="the mask-agnostic loss substantially mitigates (abstract)",
                                       our_threshold="3 points fewer lost than CE-only"),
            }},
        "ps_ppo": {
            "scale": {"model": TINY_LM + " warmed up (grpo_tiny / ps_ppo_tiny)", "params": 1311872, "layers": 4,
                      "data": "1-digit arithmetic prompts, 4 prompts × group 4 per update", "steps": "30 updates per "
                      "arm", "seeds": 1, "eval": "30 updates (memory, time); reward over the last 7"},
            "arms": [],
            "claims": {
                **{f"peak_memory_p{q}": P(est=t_items(30, "updates", paired=False), expect="<", threshold=0.65,
                                          n_seeds=1, n_items=30, our_threshold="0.65: issue 13's target",
                                          paper_value="large reductions in peak GPU memory (abstract; no number)")
                   for q in ("0.1", "0.2")},
                **{f"compute_p{q}": P(est=t_items(29, "updates", paired=False), expect="<", threshold=1.0, n_seeds=1,
                                      n_items=29, paper_value="large reductions in training compute (abstract)")
                   for q in ("0.1", "0.2")},
                **{f"accuracy_p{q}": P(est=t_items(7, "updates", paired=False), expect=">", threshold=-0.05,
                                       n_seeds=1, n_items=7, our_threshold="within 5 points of GRPO's reward",
                                       paper_value="accuracy comparable to critic-free baselines (abstract)")
                   for q in ("0.1", "0.2")},
            }},
        "qat_law": {
            "scale": {"model": "tiny LLaMAs llama_qat (N = 148K, 591K)", "params": 590976, "layers": 2,
                      "data": "D = 50K–401K tokens (4 values); W4A4 / W4A16 / W16A4 / FC2-A8 at G = 64, 128",
                      "steps": "the committed sweep (sweeps/results/qat_law_tiny_seeds.csv, 24 jobs)", "seeds": 3,
                      "eval": "δ = L − L_fp per (N, D, seed)"},
            "arms": [],
            "claims": {
                **{cid: P(est=lambda c: S.seed_bootstrap(c["value"], c["stderr"], 3), expect=">", n_seeds=3,
                          n_items=16, paper_value=pv,
                          note="a bootstrap over 3 seeds, read as t(2) on the rescaled SE")
                   for cid, pv in (("delta_falls_with_N", "error decreases with model size (abstract)"),
                                   ("delta_rises_with_D", "rises with more training tokens (abstract)"),
                                   ("delta_rises_with_G", "and with coarser granularity (abstract)"),
                                   ("weight_error_faster_in_D", "weight error rises faster with D (abstract)"))},
                "fc2_activation_bottleneck": P(est=t_items(24, "paired cells", paired=True), expect=">", n_seeds=3,
                                               n_items=24, paper_value="FC2 activation error is the bottleneck "
                                                                       "(abstract)"),
            }},
        "real_vqa": {
            "scale": {"model": "tiny VLM on " + TINY_LM, "params": 1311872, "layers": 4,
                      "data": "synthetic KI-VQA (1200 training items)", "steps": "600 per target (3 targets)",
                      "seeds": 3, "eval": "96 test items (half touch a held-out relation)"},
            "arms": [],
            "claims": {
                **{cid: P(est=t_seeds(3, paired=True), expect=exp, threshold=thr, n_seeds=3, n_items=96,
                          degenerate=deg, our_threshold=ours, paper_value=pv)
                   for cid, exp, thr, deg, ours, pv in (
                       ("fewer_false_flags_held_out_vs_conflict_only", ">", 0.0, "the rpa discriminator never flags "
                        "(F1 0): fewer false flags is trivial", None, "a generalizable discriminator (abstract)"),
                       ("fewer_false_flags_held_out_vs_keyword_mismatch", ">", 0.0, "the rpa discriminator never "
                        "flags (F1 0): fewer false flags is trivial", None, "a generalizable discriminator (abstract)"),
                       ("discrimination_accuracy", ">", 0.0, "the rpa discriminator never flags (F1 0)", None,
                        "significantly better discrimination accuracy (abstract)"),
                       ("rpgd_beats_greedy_on_true_conflicts", ">", 0.0, "RPGD never triggered (contrast rate 0)",
                        None, "targeted conflict mitigation (abstract)"),
                       ("rpgd_beats_cad_on_true_conflicts", ">", 0.0, "RPGD never triggered (contrast rate 0)", None,
                        "targeted conflict mitigation (abstract)"),
                       ("rpgd_clean_unhurt", ">", -0.05, "RPGD never triggered (contrast rate 0)",
                        "within 5 points on clean items", None))},
                "benchmarks_gains": P(paper_value="+3.8 / +1.6 / +3.6 points on E-VQA / InfoSeek / A-OKVQA "
                                                  "(papernotes)"),
            }},
        "rlkv": {
            "figure": ("accuracy", ["RLKV", "random", "Duo", "token dropping (best)"], "greedy accuracy", 0.969),
            "scale": {"model": TINY_LM + " warmed up on 1-digit word problems (8 KV heads)", "params": 1311872,
                      "layers": 4, "data": "1-digit word problems (train split)",
                      "steps": "RL probe 60, DuoAttention 200 per seed", "seeds": 3,
                      "eval": "64 prompts; 5 random head draws; sparsity 0.25 / 0.5 / 0.75"},
            "arms": [arms_table("greedy accuracy on 64 prompts (RLKV, Duo: mean over 3 seeds; random: 5 draws)",
                                ["s", "RLKV", "random", "Duo", "token dropping (best)", "full"],
                                [[0.25, 0.969, 0.581, 0.812, 0.875, 0.969], [0.5, 0.766, 0.409, 0.688, 0.484, 0.969],
                                 [0.75, 0.271, 0.166, 0.219, 0.172, 0.969]])],
            "claims": {
                **{f"rlkv_vs_random_s{s}": P(est=t_seeds(3), expect=">", n_seeds=3, n_items=64,
                                             paper_value="RL finds the heads that matter (abstract)",
                                             note="the stored SE is RLKV's alone; the random draws' spread is not "
                                                  "stored (Welch needs it)")
                   for s in ("0.25", "0.5", "0.75")},
                **{f"rlkv_vs_token_dropping_s{s}": P(est=t_seeds(3), expect=">", n_seeds=3, n_items=64,
                                                     paper_value="token dropping disrupts reasoning chains (abstract)",
                                                     note="token dropping is deterministic: RLKV's seeds are the "
                                                          "only spread")
                   for s in ("0.25", "0.5", "0.75")},
                "near_lossless": P(est=t_seeds(3), expect="<", threshold=0.05, n_seeds=3, n_items=64,
                                   paper_value="20–60% cache reduction, near-lossless (abstract)",
                                   our_threshold="a drop of at most 5 points"),
                "heads_found": P(est=none, expect=">", n_seeds=3, n_items=8,
                                 paper_value="a fraction of heads is essential (abstract)",
                                 note="a permutation p is no interval; per-seed ρ are not stored"),
                "speedup": P(paper_value="up to 2.06× end-to-end at 60% reduction (SGLang, 8B; abstract)"),
            }},
        "spard": {
            "figure": ("asr", ["ASR", "accuracy"], "rate, mean over 3 seeds", None),
            "scale": {"model": TINY_LM + " aligned (spard_tiny)", "params": 1311872, "layers": 4,
                      "data": "planted-secret harmful fine-tuning: 400 task examples + poison", "steps": "100 per arm "
                      "(5 arms)", "seeds": 3, "eval": "64 test prompts per kind; 4 attack styles"},
            "arms": [arms_table("mean test ASR over 4 attack styles and test accuracy, mean over 3 seeds",
                                ["arm", "ASR", "accuracy"],
                                [["sft", 1.0, 0.307], ["random_safe", 0.885, None], ["mixed_safe", 0.708, None],
                                 ["spard (code_faithful)", 0.880, 0.307]])],
            "claims": {
                "lowest_asr": P(est=lambda c: S.from_se(c["value"], c["stderr"], 2, 3, "seeds",
                                                        "t (stored SE, SPARD's alone)", paired=True),
                                versus={a: S.from_se(v - SPARD_ASR, 0.06006543018057706, 2, 3, "seeds",
                                                     "t (stored SE, SPARD's alone)", paired=True)
                                        for a, v in (("sft", 1.0), ("random_safe", 0.885),
                                                     ("mixed_safe", SPARD_ASR - 0.171875))},
                                expect=">", n_seeds=3, n_items=256,
                                metric="tiny: mean test ASR over 4 attack styles, each other defence − spard (shown: "
                                       "the lowest, mixed_safe)",
                                paper_value="87.93% SFT → 9.45% SPARD mean ASR on Qwen2.5-7B (abstract)",
                                note="every competitor, each with SPARD's stored SE (the others' are not stored; "
                                     "random_safe's ASR from why, 3 decimals)"),
                "accuracy_kept": P(est=t_seeds(3, paired=False), expect=">", threshold=-0.03, n_seeds=3,
                                   n_items=64, our_threshold="within 3 points of sft",
                                   paper_value="high task accuracy kept (abstract)"),
                "asr_vs_sft": P(est=t_seeds(3, paired=True), expect=">", n_seeds=3, n_items=256,
                                paper_value="87.93% → 9.45% (abstract)",
                                note="sft's ASR is 1.000 at every seed: SPARD's SE is the difference's"),
                "rd_dpp_relevance": P(est=lambda c: S.from_se(c["value"], 2 * c["stderr"], 2, 3, "seeds",
                                                              "t (stored SE, deduplicated)", paired=True),
                                      expect=">", n_seeds=3, n_items=None,
                                      paper_value="balances relevance and coverage (abstract)",
                                      note="the 9 selections were 3 seeds' selections counted 3 times: SE × 2, t(2)"),
                "rd_dpp_diversity": P(est=lambda c: S.from_se(c["value"], 2 * c["stderr"], 2, 3, "seeds",
                                                              "t (stored SE, deduplicated)", paired=True),
                                      expect=">", n_seeds=3, n_items=None,
                                      paper_value="compact, diverse safe data (abstract)",
                                      note="the 9 selections were 3 seeds' selections counted 3 times: SE × 2, t(2)"),
                "gsm8k_obqa_four_attacks": P(paper_value="87.93% → 9.45% mean ASR (Qwen2.5-7B-Instruct)"),
            }},
        "subspace_path": {
            "scale": {"model": TINY_LM, "params": 1311872, "layers": 4,
                      "data": "six stdlib families as domains; 2–3-domain mixes as cross", "steps": "none (probes "
                      "and masks only)", "seeds": 1, "eval": "18 scenarios; 12 cross-domain; 7 timing pairs"},
            "arms": [],
            "claims": {
                "cross_domain_recall": P(est=t_items(12, "scenarios", paired=True), expect=">", n_seeds=1, n_items=12,
                                         paper_value="29.3 vs 24.7 dense on cross-domain tests (abstract)"),
                "cross_dataset_recall": P(paper_value="21.6 vs 25.5 dense (abstract)"),
                "speedup": P(est=t_items(7, "timing pairs", paired=True), expect=">", threshold=1.0, n_seeds=1,
                             n_items=7, paper_value="1.27× at ~30% pruning (abstract)"),
                "coupling": P(est=t_items(6, "domains"), expect=">", n_seeds=1, n_items=6,
                              paper_value="scenario subspaces activate consistent pathways (abstract)"),
                "probes": P(est=fixed(S.proportion(103, 192, "val passages", candidates=4)), expect=">",
                            threshold=1 / 6, n_seeds=1, n_items=192,
                            metric="best-layer probe accuracy (val pools, 6 domains) against chance",
                            paper_value="efficient layer-wise linear probes (abstract)",
                            note="accuracy 0.536 of 6 × 32 val passages (the default pools), the best of 4 layers: "
                                 "Bonferroni over 4"),
                "dbs_quasi_orthogonal": P(est=none, expect="<", n_seeds=1, n_items=None, role="by_construction",
                                          paper_value="a quasi-orthogonal basis of domain axes (abstract)",
                                          note="DBS picks greedily to minimise the largest |cos|"),
                "scenario_vs_global": P(est=none, expect="<", n_seeds=1, n_items=U,
                                        degenerate="pruning not matched: 62% (scenario) vs 31% (global)"),
                "compile_ms": P(est=none, expect="<", threshold=100.0, n_seeds=1, n_items=18,
                                paper_value="27–68 ms (abstract: efficient probes)",
                                our_threshold="100 ms on a shared CPU",
                                note="per-scenario times are not stored: no interval until the rerun"),
            }},
        "watersic": {
            "scale": {"model": "single layers: Gaussian 1024 × 64, all-MiniLM-L6-v2 layer 0 (query, intermediate)",
                      "params": None, "layers": None, "data": "Σ spread over three decades; MiniLM activations on the "
                      "embedded corpus", "steps": "none", "seeds": 3, "eval": "rates 1–4 bits; gap grid a/n 1/8–32"},
            "arms": [],
            "claims": {
                "gap_0255": P(est=none, expect="<", threshold=0.2546, n_seeds=1, n_items=None,
                              paper_value="within 0.255 bits of the IT limit (abstract)"),
                "gptq_gap_larger": P(est=none, expect=">", n_seeds=1, n_items=None,
                                     paper_value="GPTQ's gap can be arbitrarily large (abstract)"),
                "beats_huffman_gptq": P(est=none, expect="<", threshold=1.0, n_seeds=1, n_items=None,
                                        paper_value="state of the art at every rate 1–4 bits (abstract)"),
                "gap_grid_column": P(est=t_seeds(3), expect="<", threshold=0.2546, n_seeds=3, n_items=None,
                                     paper_value="within 0.255 bits, uniformly over Σ (abstract)",
                                     note="the worst cell only is stored"),
                "gap_grid_pooled": P(est=t_seeds(3), expect="<", threshold=0.2546, n_seeds=3, n_items=None,
                                     paper_value="within 0.255 bits, uniformly over Σ (abstract)",
                                     note="the worst cell only is stored"),
                "gap_grid_high_rate_limit": P(est=t_seeds(3), expect="<", threshold=0.01, n_seeds=3, n_items=None,
                                              our_threshold="within 0.01 bit of ½·log₂(πe/6) at high rate",
                                              note="the worst Σ only is stored"),
                "llm_perplexity": P(paper_value="state of the art at 1–4 bits on Llama / Qwen (abstract)"),
            }},
    }


def migrate_claim(c: dict, spec: dict) -> tuple[dict, str | None]:
    """A schema-1 claim as schema 2 (value kept) and the change line, if its verdict changed."""
    if c["verdict"] == "not_measurable_here":
        new = S.not_measurable(c["id"], c["quote"], c["metric"], paper_value=spec.get("paper_value"), why=c["why"],
                               value=c.get("value"))
        return asdict(new), None
    est = spec["est"](c)
    versus = spec.get("versus")
    new = S.claim(c["id"], c["quote"], spec.get("metric", c["metric"]), est, expect=spec["expect"],
                  threshold=spec.get("threshold", 0.0), margin=spec.get("margin"), why=c["why"],
                  n_seeds=spec["n_seeds"], n_items=spec["n_items"], paper_value=spec.get("paper_value"),
                  our_threshold=spec.get("our_threshold"), role=spec.get("role", "claim"),
                  degenerate=spec.get("degenerate"), versus=versus)
    d = asdict(new)
    if versus:
        reason = "; ".join(f"vs {x['against']} {x['verdict']}" for x in d["comparisons"])
    elif spec.get("degenerate"):
        reason = spec["degenerate"]
    else:
        reason = S.decide(d["value"], d["interval"], d["expect"], d["threshold"], d["margin"])[1]
        if d["interval"]:
            lo, hi = d["interval"]
            reason = f"{d['method']} over {est.n} {est.over}: [{lo:.4g}, {hi:.4g}] {reason}"
    note = spec.get("note")
    line = f"{reason}" + (f" ({note})" if note else "")
    d["note"] = note
    return d, (line if d["verdict"] != c["verdict"] or d.get("role") != "claim" else None)


def migrate(doc: dict, spec: dict) -> dict:
    claims, changes = [], []
    for c in doc["claims"]:
        new, line = migrate_claim(c, spec["claims"][c["id"]])
        new.pop("note", None)
        claims.append(new)
        if line is not None:
            changes.append({"id": c["id"], "old": c["verdict"], "new": new["verdict"], "role": new["role"],
                            "why": line, "old_target": c["target"]})
    out = {k: v for k, v in doc.items() if k != "claims"}
    out.update(schema=SCHEMA_VERSION, command=spec.get("command", doc["command"]), scale=spec["scale"],
               arms=spec["arms"], provenance=spec.get("provenance") or (
                   f"measured at {doc['commit']} under schema 1; the verdicts were recomputed from the stored numbers "
                   "by benchmarks/migrate_v1.py (issue 41); a rerun at one commit is pending"),
               claims=claims, migrated={"from_schema": 1, "changes": changes})
    if spec.get("figure") and not out["figures"]:  # a figure from the stored per-arm table
        from benchmarks.figures import bars

        name, cols, ylabel, hline = spec["figure"]
        fig = bars(spec["arms"][0], RESULTS / f"{doc['paper']}_{name}.png", cols, ylabel=ylabel, hline=hline,
                   title=f"{doc['paper']} (schema-1 numbers): {ylabel}")
        out["figures"] = [fig.name]
    if spec.get("provenance"):
        out["provenance"] = (f"measured at {doc['commit']} under schema 1, verdicts recomputed by "
                             f"benchmarks/migrate_v1.py; {spec['provenance']}")
    return out


def main() -> None:
    specs = _spec()
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("schema") != 1:
            print(f"{path.name}: schema {doc.get('schema')}, left as it is")
            continue
        new = migrate(doc, specs[doc["paper"]])
        validate(new, path, path.parent)
        path.write_text(json.dumps(new, indent=1, ensure_ascii=False) + "\n")
        for ch in new["migrated"]["changes"]:
            print(f"{doc['paper']:14s} {ch['id']:44s} {ch['old']:>13s} -> {ch['new']:13s} [{ch['role']}] {ch['why']}")


if __name__ == "__main__":
    main()
