"""SubspacePath Pruner on tiny-lm at matched pruning: scenario masks vs static baselines (Gong et al., ICML 2026).

The same offline pass and scenarios as ``subspace_path_tiny`` (six stdlib families as domains, held-out families
as out-of-domain, 2-3-domain mixes as cross). For each target pruned fraction (10 / 30 / 50%):

- ``scenario_union`` / ``scenario_sum``: the per-scenario mask, eta bisected to the target (``budget.mode``
  release_union / paper_sum; the release's per-domain counts are int-rounded and floored, so a target may be missed
  by a few heads: the achieved fraction is reported);
- ``global``: one mask for every scenario from the mean importance over domains;
- ``random``: random heads (3 draws); ``wo_norm``: the heads with the largest W_O column-block norms.

Every mask holds the per-layer floors. Reported per split: later-turn perplexity ratio to dense and keyword Recall;
tokens/s of greedy decoding with the heads sliced out (``prune_heads``) vs dense; compile ms (probe forward + mask);
probe accuracy per layer (val pools); Spearman of I_{·,·,k} against the NLL increase on domain k when each head is
ablated alone; the largest |cos| between the centroids DBS picks (K = 4 of 6) vs random 4-subsets.

    python -m benchmarks subspace_path            # full: 1.3 min measured (2 shared cores)
    python -m benchmarks subspace_path --quick    # the smallest settings: proves it runs
"""
from __future__ import annotations

import argparse
import itertools
import math
import time

import torch

from benchmarks.schema import mean_se

TARGETS = (0.1, 0.3, 0.5)


def _spearman(a, b) -> float:
    ra = torch.as_tensor(a, dtype=torch.float64).argsort().argsort().double()
    rb = torch.as_tensor(b, dtype=torch.float64).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def _top_mask(score: torch.Tensor, keep: int, floor_layer: float) -> torch.Tensor:
    from lightning_modules.subspace_path.method import apply_floors

    m = torch.zeros(score.numel(), dtype=torch.bool)
    m[score.flatten().argsort(descending=True)[:keep]] = True
    return apply_floors(m.reshape(score.shape), score, floor_layer, 0.0)


def build(args):
    from hydra.utils import instantiate

    from runner import compose

    over = [f"data.pool_size={args.pool}", f"model.probe.epochs={args.epochs}", f"data.n_scenarios={args.scenarios}",
            f"model.eval.max_new_tokens={args.new_tokens}"]
    cfg = compose("subspace_path_tiny", over)
    dm = instantiate(cfg.data, _convert_="all")
    module = instantiate(cfg.model, _convert_="all")
    module.configure_model()
    module.model.eval()
    return dm, module


def ppl_recall(module, tok, scenarios, masks) -> dict:
    """Per split: summed NLL / tokens and mean Recall over later turns, for per-scenario masks (None = dense)."""
    acc = {}
    for sc, mask in zip(scenarios, masks):
        rows = module.evaluate_turns(tok, sc, mask)
        a = acc.setdefault(sc["split"], {"nll": 0.0, "tokens": 0, "recall": []})
        a["nll"] += sum(r["nll"] for r in rows)
        a["tokens"] += sum(r["tokens"] for r in rows)
        a["recall"] += [r["recall"] for r in rows]
    return {s: {"ppl": math.exp(a["nll"] / a["tokens"]), "recall": 100 * sum(a["recall"]) / len(a["recall"]),
                "recall_values": a["recall"]} for s, a in acc.items()}


@torch.no_grad()
def ablation_spearman(module, tok, dm, n_texts: int) -> list[float]:
    """Per domain k: Spearman over heads of I_{·,·,k} against the NLL increase on k's val texts with that head off."""
    from lightning_modules.common.attention import head_mask

    st = module.state
    L, H, K = st["importance"].shape
    pools = dm.pools("val", st["domains"])

    def nll(texts, mask):
        tot = 0.0
        for t in texts:
            ids = module._ids(tok, t)
            with head_mask(module.model, mask):
                tot += float(module.model(input_ids=ids, labels=ids).loss)
        return tot / len(texts)

    out = []
    for k, d in enumerate(st["domains"]):
        texts = pools[d][:n_texts]
        base = nll(texts, torch.ones(L, H))
        damage = []
        for l, h in itertools.product(range(L), range(H)):
            m = torch.ones(L, H)
            m[l, h] = 0
            damage.append(nll(texts, m) - base)
        out.append(_spearman(st["importance"][..., k].flatten(), damage))
    return out


@torch.no_grad()
def tokens_per_s(module, tok, text: str, mask, n_new: int, pairs: int = 7) -> tuple[list[float], list[float]]:
    """Greedy tokens/s, dense and with the heads of ``mask`` sliced out, timed in interleaved pairs (a shared CPU
    drifts; a pair sees the same load), one warm-up pair first."""
    from lightning_modules.common.attention import kv_group_mask, prune_heads

    ids = module._ids(tok, text, 128)

    def once(sliced: bool) -> float:
        ctx = prune_heads(module.model, kv_group_mask(mask, module._kv_groups())) if sliced else None
        if ctx is not None:
            ctx.__enter__()
        try:
            t0 = time.perf_counter()
            out = module.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=tok.eos_token_id)
            return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)

    once(False), once(True)
    dense, sliced = [], []
    for _ in range(pairs):
        dense.append(once(False))
        sliced.append(once(True))
    return dense, sliced


@torch.no_grad()
def dbs_max_cos(module, tok, dm, k: int = 4) -> tuple[float, float]:
    from lightning_modules.common.embedding import Encoder, centroids, max_abs_cosine
    from lightning_modules.subspace_path.method import quasi_orthogonal

    enc = Encoder(module.model, tok, pooling="mean", max_length=128)
    c = centroids(enc, dm.pools("train", list(dm.domains)))
    chosen = quasi_orthogonal(c, k)
    rand = [max_abs_cosine(c[list(s)]) for s in itertools.combinations(range(len(c)), k)]
    return max_abs_cosine(c[chosen]), sum(rand) / len(rand)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smallest settings (pools 6, 3 epochs, 1 scenario a split)")
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--scenarios", type=int, default=6, help="per split")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--ablation-texts", type=int, default=4)
    args = p.parse_args(argv)
    targets = TARGETS
    if args.quick:
        args.pool, args.epochs, args.scenarios, args.new_tokens, args.ablation_texts = 6, 3, 1, 4, 1
        targets = (0.3,)
    from lightning_modules.common.attention import attention_modules

    dm, module = build(args)
    tok = dm.tokenizer
    t0 = time.perf_counter()
    st = module.fit_offline(dm, tok)
    offline_s = time.perf_counter() - t0
    scenarios = dm.scenarios()
    L, H, K = st["importance"].shape
    floor = module.budget["floor_layer"]
    probs, compile_ms = [], []
    for sc in scenarios:
        t0 = time.perf_counter()
        pr = module.scenario_probs(tok, sc)
        module.compile(pr)
        compile_ms.append(1000 * (time.perf_counter() - t0))
        probs.append(pr)
    dense = ppl_recall(module, tok, scenarios, [None] * len(scenarios))
    wo = torch.stack([a.o_proj.weight.detach().reshape(a.o_proj.out_features, H, -1).norm(dim=(0, 2)).double()
                      for a in attention_modules(module.model)])
    table, achieved = {}, {}
    for target in targets:
        keep = round((1 - target) * L * H)
        masks = {}
        for mode in ("release_union", "paper_sum"):
            module.budget["mode"] = mode
            masks[f"scenario_{mode.split('_')[1]}"] = [module.compile(pr, target_prune=target)[0] for pr in probs]
        module.budget["mode"] = "release_union"
        masks["global"] = [_top_mask(st["importance"].mean(-1), keep, floor)] * len(scenarios)
        masks["wo_norm"] = [_top_mask(wo, keep, floor)] * len(scenarios)
        for name, ms in masks.items():
            table[(target, name)] = ppl_recall(module, tok, scenarios, ms)
            achieved[(target, name)] = sum(1 - float(m.double().mean()) for m in ms) / len(ms)
        rand = []
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            m = _top_mask(torch.rand(L, H, generator=g, dtype=torch.float64), keep, floor)
            rand.append(ppl_recall(module, tok, scenarios, [m] * len(scenarios)))
        table[(target, "random")] = {s: {"ppl": sum(r[s]["ppl"] for r in rand) / 3,
                                         "recall": sum(r[s]["recall"] for r in rand) / 3,
                                         "recall_values": rand[0][s]["recall_values"]} for s in rand[0]}
        achieved[(target, "random")] = 1 - float(m.double().mean())
    # speed: slice the 30% scenario mask of the first selected scenario (whole KV groups on tiny-lm's GQA)
    target = 0.3 if 0.3 in targets else targets[0]
    mask = module.compile(probs[0], target_prune=target)[0]
    text = " ".join(t["prompt"] for t in scenarios[0]["turns"])
    dense_tps, sliced_tps = tokens_per_s(module, tok, text, mask, 4 * args.new_tokens)
    tps_dense, tps_slice = sum(dense_tps) / len(dense_tps), sum(sliced_tps) / len(sliced_tps)
    tps_ratios = [s / d for d, s in zip(dense_tps, sliced_tps)]
    spear = ablation_spearman(module, tok, dm, args.ablation_texts)
    qo, rnd = dbs_max_cos(module, tok, dm)
    print(f"offline {offline_s:.1f} s; compile {sum(compile_ms) / len(compile_ms):.1f} ms; probe acc per layer "
          f"{[round(a, 3) for a in st['probe_acc'].tolist()]} (chance {1 / K:.3f})")
    print(f"{'target':>6} {'method':>15} {'pruned':>7} " + " ".join(f"{s[:8]:>17}" for s in sorted(dense)))
    for (t, name), res in table.items():
        cells = " ".join(f"{res[s]['ppl'] / dense[s]['ppl']:8.3f} {res[s]['recall']:7.2f}R" for s in sorted(dense))
        print(f"{t:6.0%} {name:>15} {achieved[(t, name)]:7.3f} {cells}")
    print("dense recall: " + ", ".join(f"{s} {dense[s]['recall']:.2f}" for s in sorted(dense)))
    print(f"tokens/s greedy: dense {tps_dense:.1f}, sliced at {target:.0%} {tps_slice:.1f} (pairwise ratio "
          f"{mean_se(tps_ratios)[0]:.3f} +- {mean_se(tps_ratios)[1]:.3f} over {len(tps_ratios)} interleaved pairs;"
          " a 4-layer, 4-head model with 2 KV groups has little attention to cut)")
    print(f"Spearman(I_k, ablation damage on k) per domain: {[round(s, 3) for s in spear]}")
    print(f"DBS max|cos| of the chosen 4 of 6 centroids {qo:.4f} vs mean over all 4-subsets {rnd:.4f}")
    return {"table": table, "achieved": achieved, "dense": dense, "tps": (tps_dense, tps_slice), "tps_ratios": tps_ratios, "target": target,
            "compile_ms": compile_ms, "probe_acc": st["probe_acc"].tolist(), "K": K, "spearman": spear,
            "dbs": (qo, rnd), "targets": targets}


def claims(res, argv):
    """Claims for benchmarks/results/subspace_path.json, judged by benchmarks/stats.py. One model, one offline pass:
    intervals are over scenarios (paired with dense), timing pairs, domains, scenario compile times and val pool
    items (the best probe layer is a choice among the layers: Bonferroni). DBS picks the centroids greedily to
    minimise the largest |cos|, so beating random subsets is true by construction."""
    from benchmarks import stats
    from benchmarks.schema import arms_table, backbone_size

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pool", type=int, default=32)  # main's: passages per domain (and per val pool)
    a = ap.parse_known_args(argv)[0]
    pool = 6 if a.quick else a.pool
    t = 0.3 if 0.3 in res["targets"] else res["targets"][0]
    tab, dense = res["table"], res["dense"]
    out = []
    cross = tab[(t, "scenario_union")].get("cross_domain")
    if cross:
        p_, d_ = cross["recall_values"], dense["cross_domain"]["recall_values"]
        out.append(stats.claim(
            "cross_domain_recall", "29.3 average Recall on cross-domain tests (vs. 24.7 dense)",
            f"cross-domain keyword Recall (points), scenario mask at {t:.0%} pruning − dense (tiny-lm), paired per "
            "scenario", stats.paired([100 * x for x in p_], [100 * x for x in d_], "scenarios"), expect=">",
            n_seeds=1, n_items=len(p_), paper_value="29.3 vs 24.7 dense on cross-domain tests (abstract)",
            why=f"pruned {cross['recall']:.2f} vs dense {dense['cross_domain']['recall']:.2f}; a tiny LM recalls few "
                "keywords either way"))
    out.append(stats.not_measurable(
        "cross_dataset_recall", "21.6 on cross-dataset tests (vs. 25.5 dense)", "Recall on CommonsenseQA / NQ / ARC",
        paper_value="21.6 vs 25.5 dense (abstract)", why="needs a 13B chat model and the datasets "
                                                          "(subspace_path_llama2_13b)"))
    d, sl = res["tps"]
    out.append(stats.claim(
        "speedup", "with 1.27x speedup at ~30% pruning ratio", f"greedy tokens/s, heads sliced at {res['target']:.0%} "
        "/ dense (mean of interleaved pairs)", stats.mean(res["tps_ratios"], "timing pairs"), expect=">",
        threshold=1.0, n_seeds=1, n_items=len(res["tps_ratios"]), paper_value="1.27× at ~30% pruning (abstract)",
        why=f"dense {d:.1f} vs sliced {sl:.1f} tokens/s on CPU; tiny-lm's 4 layers x 2 KV groups leave little "
            "attention to remove"))
    out.append(stats.claim(
        "coupling", "input scenario sets aligned with similar representation subspaces (e.g., domain) in embedding "
        "space tend to activate a consistent and sparse set of internal reasoning pathways",
        "Spearman of I_{.,.,k} vs per-head ablation damage on domain k, mean over domains",
        stats.mean(res["spearman"], "domains"), expect=">", n_seeds=1, n_items=len(res["spearman"]),
        paper_value="scenario subspaces activate consistent pathways (abstract)",
        why=f"per domain {[round(x, 2) for x in res['spearman']]}"))
    n_val = pool * res["K"]
    best = max(res["probe_acc"])
    out.append(stats.claim(
        "probes", "uses efficient layer-wise linear probes to estimate axis alignment",
        f"best-layer probe accuracy (val pools, {res['K']} domains) against chance",
        stats.proportion(round(best * n_val), n_val, "val passages", candidates=len(res["probe_acc"])), expect=">",
        threshold=1 / res["K"], n_seeds=1, n_items=n_val, paper_value="efficient layer-wise linear probes (abstract)",
        why=f"accuracy per layer {[round(x, 3) for x in res['probe_acc']]}, chance {1 / res['K']:.3f}"))
    qo, rnd = res["dbs"]
    out.append(stats.claim(
        "dbs_quasi_orthogonal", "Domain-Basis Synthesis (DBS) constructs a quasi-orthogonal basis of domain axes in "
        "embedding space", "largest |cos| of the 4 chosen centroids − mean over 4-subsets", stats.single(qo - rnd),
        expect="<", n_seeds=1, n_items=None, role="by_construction",
        paper_value="a quasi-orthogonal basis of domain axes (abstract)",
        why=f"chosen {qo:.4f} vs random subsets {rnd:.4f}; greedy minimisation of the largest |cos|; mean-pooled "
            "tiny-lm centroids share a large common component, so every |cos| is near 1"))
    sel_s = tab[(t, "scenario_union")].get("selected")
    sel_g = tab[(t, "global")].get("selected")
    if sel_s and sel_g:
        got_s, got_g = res["achieved"][(t, "scenario_union")], res["achieved"][(t, "global")]
        out.append(stats.claim(
            "scenario_vs_global", "compute budgeted head-wise pathways for a specific scenario",
            f"selected-domain perplexity, scenario mask / global mask − 1 at {t:.0%}",
            stats.single(sel_s["ppl"] / sel_g["ppl"] - 1), expect="<", n_seeds=1, n_items=None,
            paper_value="scenario masks beat one global mask on single-domain scenarios (spec)",
            degenerate=f"pruning not matched: {got_s:.0%} (scenario) vs {got_g:.0%} (global)"
            if abs(got_s - got_g) > 0.05 else None,
            why=f"achieved pruning {got_s:.2f} vs {got_g:.2f} (global)"))
    out.append(stats.claim(
        "compile_ms", "efficient layer-wise linear probes", "compile time per scenario (probe forward + mask), ms",
        stats.mean(res["compile_ms"], "scenarios"), expect="<", threshold=100.0, n_seeds=1,
        n_items=len(res["compile_ms"]), our_threshold="100 ms on a shared CPU",
        paper_value="27–68 ms (abstract: efficient probes)", why="on a shared CPU"))
    splits = sorted(dense)
    table = arms_table("per mask and target pruned fraction: achieved fraction, perplexity / dense and keyword Recall "
                       "per split", ["mask", "target", "achieved", *(f"ppl/dense {x}" for x in splits),
                                     *(f"recall {x}" for x in splits)],
                       [[m, tt, res["achieved"].get((tt, m)),
                         *(r[x]["ppl"] / dense[x]["ppl"] if x in r else None for x in splits),
                         *(r[x]["recall"] if x in r else None for x in splits)] for (tt, m), r in sorted(tab.items())]
                       + [["dense", 0.0, 0.0, *(1.0 for _ in splits), *(dense[x]["recall"] for x in splits)]])
    from benchmarks.figures import bars
    from benchmarks.schema import ROOT

    at = [r for r in table["rows"] if r[1] in (t, 0.0)]
    fig = bars({**table, "rows": [[f"{r[0]}", *r[1:]] for r in at]}, ROOT / "outputs" / "benchmarks" /
               "subspace_path" / "ppl.png", [f"ppl/dense {x}" for x in splits], ylabel="perplexity / dense",
               title=f"subspace_path: masks at {t:.0%} target pruning", hline=1.0)
    scale = {"model": "tiny-lm (LLaMA, hidden 128)", **backbone_size("subspace_path_tiny"),
             "data": f"{res['K']} stdlib families as domains ({pool} passages per pool); 2–3-domain mixes as cross",
             "steps": "none (probes and masks only)", "seeds": 1,
             "eval": f"{len(res['compile_ms'])} scenarios; {len(res['tps_ratios'])} timing pairs"}
    return out, [fig], {"scale": scale, "arms": [table]}


if __name__ == "__main__":
    from benchmarks.schema import run_benchmark

    run_benchmark("subspace_path", main, claims)
