"""Attention patterns: peak memory and time of one attention layer, forward + backward, against sequence length.

    python -m benchmarks.attention                                  # CPU: N = 2K-16K; CUDA: 4K, 16K, 64K
    python -m benchmarks.attention --lengths 2048 4096 --threads 1  # what a loaded 2-core machine can take
    python -m benchmarks.attention --cases hici_shift_g rlkv_token --impls sdpa_dense auto
    python -m benchmarks.attention --check                          # CUDA: FlexAttention fwd+bwd = block-wise, then the table

One layer = q, k, v leaves of (1, heads, N, head_dim) (width 512 = 8 heads x 64, fp32 on CPU, bf16 on CUDA), the
pattern's attention, then backward of the output's sum. Each pattern runs under ``sdpa_dense`` (today's dense-mask
code) and ``auto`` (block-wise on CPU, FlexAttention on CUDA); ``causal`` is plain causal SDPA at the same N, the
yardstick (goal: every pattern's peak within 2x of it at 16K, time within 2x).

Peak memory, CPU: every cell runs in a fresh subprocess (glibc told to mmap every allocation of 64 KiB or more and
unmap it when freed, ``MALLOC``, so the resident set follows the live tensors), which builds its inputs, runs the
cell once (warm-up), resets the kernel's resident-set high-water mark (``echo 5 > /proc/self/clear_refs``, Linux),
runs it again and reports VmHWM - VmRSS before that run (``/proc/self/status``): the physical memory the forward +
backward added at its peak, the inputs excluded. CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, the
inputs excluded. Time: the best of ``--repeats`` runs after the warm-up. Times taken while other processes share
the cores are upper bounds.

Cases: ``causal``, ``padded`` (transformers' causal mask with 10% left padding) and ``documents`` (8 packed
documents) are shared (``common.block_attention``); a paper adds its own by a module ``lightning_modules/<paper>/
attention_cases.py`` with ``CASES = {name: build(n, impl, heads, head_dim, dtype, device) -> (fn, inputs)}``, found
by that file name (this file names no paper). ``rows(...)`` returns the table as dicts (``benchmarks.kernels``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# glibc: every allocation >= 64 KiB its own mmap, unmapped when freed (no dynamic threshold, no trim slack), so the
# resident set follows the live tensors and a warm-up's freed memory is not silently reused by the measured run
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
LENGTHS = (2048, 4096, 8192, 16384)
CUDA_LENGTHS = (4096, 16384, 65536)
IMPLS = ("sdpa_dense", "auto")
YARDSTICK = "causal"


# --- shared cases ------------------------------------------------------------------------------------------------------
def _qkv(n, heads, head_dim, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    return [torch.randn(1, heads, n, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(3)]


def _causal(n, impl, heads=8, head_dim=64, dtype=torch.float32, device="cpu"):
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), _qkv(n, heads, head_dim, dtype,
                                                                                          device)


def _masked(make_layout):
    """A causal layout under ``impl``; ``sdpa_dense`` is the 4-D bool mask transformers' sdpa would hand the layer."""
    def build(n, impl, heads=8, head_dim=64, dtype=torch.float32, device="cpu"):
        from lightning_modules.common.block_attention import attend

        layout = make_layout(n, device)
        if impl == "sdpa_dense":
            mask = layout.dense(device)
            return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)), _qkv(n, heads, head_dim,
                                                                                                  dtype, device)
        return (lambda q, k, v: attend(q, k, v, layout, impl)), _qkv(n, heads, head_dim, dtype, device)
    return build


def _padded_layout(n, device):
    from lightning_modules.common.block_attention import causal_layout

    valid = torch.ones(1, n, dtype=torch.bool, device=device)
    valid[:, : n // 10] = False
    return causal_layout(1, n, n, valid)


def _documents_layout(n, device):
    from lightning_modules.common.block_attention import causal_layout

    return causal_layout(1, n, n, None, (torch.arange(n, device=device) * 8 // n)[None])


SHARED = {YARDSTICK: _causal, "padded": _masked(_padded_layout), "documents": _masked(_documents_layout)}


def cases() -> dict:
    """Every case: the shared ones, then each paper package's ``attention_cases.CASES``."""
    import lightning_modules

    out = dict(SHARED)
    for pkg in pkgutil.iter_modules(lightning_modules.__path__):
        name = f"lightning_modules.{pkg.name}.attention_cases"
        if pkg.ispkg and importlib.util.find_spec(name) is not None:
            out.update(importlib.import_module(name).CASES)
    return out


# --- one cell ----------------------------------------------------------------------------------------------------------
def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


def measure(case: str, n: int, impl: str, repeats: int = 2, heads: int = 8, head_dim: int = 64) -> dict:
    """One cell in this process: {'peak_MiB', 'ms'} of forward + backward (see the module docstring)."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    fn, inputs = cases()[case](n, impl, heads=heads, head_dim=head_dim, dtype=dtype, device=device)
    leaves = [t.requires_grad_(True) for t in inputs]

    def step():
        fn(*leaves).sum().backward()
        for t in leaves:
            t.grad = None
        if cuda:
            torch.cuda.synchronize()

    step()  # warm-up: kernels, compilation, the allocator
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        open("/proc/self/clear_refs", "w").write("5")
        base = _status("VmRSS")
    times = []
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - base
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"peak_MiB": round(peak / 2**20, 1), "ms": round(1000 * min(times), 1)}


def run_cell(case: str, n: int, impl: str, repeats: int, threads: int, timeout: float | None = None) -> dict:
    """``measure`` in a fresh subprocess on CPU (its own peak), in this process on CUDA (compiled kernels reused);
    {'error': ...} when it fails or runs out of memory."""
    if torch.cuda.is_available():
        try:
            return measure(case, n, impl, repeats)
        except Exception as e:  # out of memory above all: the dense paths at long N
            return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
        finally:
            torch.cuda.empty_cache()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **MALLOC}
    cmd = [sys.executable, "-m", "benchmarks.attention", "--cell", case, str(n), impl, "--repeats", str(repeats)]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout} s"}
    if res.returncode:
        tail = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        return {"error": tail[-160:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def rows(lengths=LENGTHS, names=None, impls=IMPLS, repeats: int = 2, threads: int = 2,
         timeout: float | None = None, log=None) -> list[dict]:
    """The table as rows {'case', 'impl', 'n', 'peak_MiB', 'ms', 'mem_x', 'time_x'}; ``mem_x``/``time_x`` relative to
    causal SDPA at the same N (the yardstick's own row: impl 'sdpa')."""
    names = list(names or cases())
    out = []
    for n in lengths:
        ref = run_cell(YARDSTICK, n, "sdpa_dense", repeats, threads, timeout)
        out.append({"case": YARDSTICK, "impl": "sdpa", "n": n, **ref})
        for name in names:
            if name == YARDSTICK:
                continue
            for impl in impls:
                r = {"case": name, "impl": impl, "n": n, **run_cell(name, n, impl, repeats, threads, timeout)}
                if "error" not in r and "error" not in ref:
                    r["mem_x"] = round(r["peak_MiB"] / max(ref["peak_MiB"], 1e-9), 2)
                    r["time_x"] = round(r["ms"] / ref["ms"], 2)
                out.append(r)
                if log:
                    log(r)
    return out


def kernel_rows(device: str, quick: bool) -> list[dict]:
    """``python -m benchmarks.kernels``' attention section: the table at CUDA's lengths on a GPU (the default CPU
    lengths otherwise); ``quick``: N = 512, the default path of HiCI and RLKV's token window against the yardstick."""
    if quick:
        return rows((512,), ["causal", "hici_shift_g", "rlkv_token"], impls=("auto",), repeats=1)
    return rows(CUDA_LENGTHS if device == "cuda" else LENGTHS)


def markdown(doc: dict, first: bool = True) -> list[str]:
    """The report's section from a written results file (``--out``): per case, implementation and N the peak memory
    and time, and both relative to causal SDPA at that N (the yardstick). ``first=False``: a further file's table
    (another command, e.g. a longer length), under the first one's heading."""
    head = ["## Attention at length, CPU", "",
            "One attention layer (8 heads x 64, fp32), forward + backward, each cell a fresh process; `sdpa_dense` is "
            "the dense-mask path, `auto` the default (block-wise on CPU), `sdpa` plain causal SDPA.", ""] if first else []
    skipped = [] if any(r["impl"] == "sdpa_dense" for r in doc["rows"]) else [
        "The dense-mask path was not run by this command (its N x N masks and scores are what the table's shorter "
        "lengths show growing quadratically).", ""]
    lines = [*head, f"Measured at `{doc['commit']}` ({doc['date']}, {doc['machine']['cores']} cores, {doc['threads']} "
             f"threads per cell):", "", f"    {doc['command']}", "", *skipped,
             "| case | impl | N | peak MiB | ms | peak / causal | time / causal |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['impl']} | {r['n']} | — | — | — | {r['error'][:60]} |")
        else:
            lines.append(f"| {r['case']} | {r['impl']} | {r['n']} | {r['peak_MiB']:.1f} | {r['ms']:.1f} | "
                         f"{r.get('mem_x', 1.0):.2f} | {r.get('time_x', 1.0):.2f} |")
    return lines


def render(table: list[dict]) -> str:
    lines = [f"{'case':14s} {'impl':10s} {'N':>6s} {'peak MiB':>9s} {'ms':>9s} {'mem x':>6s} {'time x':>6s}"]
    for r in table:
        if "error" in r:
            lines.append(f"{r['case']:14s} {r['impl']:10s} {r['n']:6d} {'-':>9s} {'-':>9s}  {r['error']}")
            continue
        lines.append(f"{r['case']:14s} {r['impl']:10s} {r['n']:6d} {r['peak_MiB']:9.1f} {r['ms']:9.1f} "
                     f"{r.get('mem_x', 1.0):6.2f} {r.get('time_x', 1.0):6.2f}")
    return "\n".join(lines)


# --- CUDA: FlexAttention's backward, which CPU cannot run -------------------------------------------------------------
def check_flex(n: int = 1024, second: int = 1280) -> list[str]:
    """On CUDA, fp32: every case's FlexAttention output and gradients against its block-wise path at N = ``n``, and
    the first case again at ``second`` (a new length: the dynamic-shape recompile). <= 1e-5 relative is the CPU tests'
    bar; FlexAttention's fp32 kernel may use TF32, so the bar here is 1e-3. Lines 'ok'/'FAIL'."""
    torch.backends.cuda.matmul.allow_tf32 = False
    out = []
    todo = [(name, n) for name in cases() if name != YARDSTICK]
    for name, n in todo + [(todo[0][0], second)]:
        build = cases()[name]
        res = {}
        for impl in ("blockwise", "flex"):
            fn, inputs = build(n, impl, dtype=torch.float32, device="cuda")
            leaves = [t.requires_grad_(True) for t in inputs]
            y = fn(*leaves)
            g = torch.randn(y.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
            res[impl] = [y.detach(), *torch.autograd.grad(y, leaves, g)]
        errs = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(res["flex"], res["blockwise"])]
        out.append(f"{'ok' if max(errs) <= 1e-3 else 'FAIL'} {name} at N = {n}: max relative error {max(errs):.1e} "
                   "over the output and each input's gradient")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--cases", nargs="+", default=None)
    p.add_argument("--impls", nargs="+", default=list(IMPLS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=None, help="seconds per cell")
    p.add_argument("--check", action="store_true", help="CUDA: FlexAttention forward+backward against block-wise")
    p.add_argument("--out", default=None, help="the results file (default benchmarks/results/attention/<cpu|cuda>.json; "
                                             "the report renders cpu.json)")
    p.add_argument("--cell", nargs=3, metavar=("CASE", "N", "IMPL"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        case, n, impl = args.cell
        print(json.dumps(measure(case, int(n), impl, args.repeats)))
        return 0
    if args.check:
        if not torch.cuda.is_available():
            print("--check needs CUDA (FlexAttention has no backward on CPU)")
            return 1
        lines = check_flex()
        print("\n".join(lines))
        if any(line.startswith("FAIL") for line in lines):
            return 1
    cuda = torch.cuda.is_available()
    lengths = args.lengths or (CUDA_LENGTHS if cuda else LENGTHS)
    print("one attention layer, 8 heads x 64, forward + backward; " +
          (f"{torch.cuda.get_device_name()}, bf16" if cuda else f"CPU fp32, {args.threads} threads per cell"))
    table = rows(lengths, args.cases, args.impls, args.repeats, args.threads, args.timeout,
                 log=lambda r: print(json.dumps(r), flush=True))
    print(render(table))
    from benchmarks.schema import ROOT, _commit, machine

    out = Path(args.out or ROOT / "benchmarks" / "results" / "attention" / f"{'cuda' if cuda else 'cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python -m benchmarks.attention " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": _commit(), "date": time.strftime("%Y-%m-%d"), "machine": machine(), "threads": args.threads,
           "rows": table}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
