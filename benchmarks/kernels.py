"""Every custom kernel against its reference, side by side in one run: the one script to run the day a GPU is lent.

    python -m benchmarks.kernels                 # CUDA when present (paper shapes, bf16), else CPU
    python -m benchmarks.kernels --cpu           # CPU sizes; the Triton kernels need CUDA, so CPU times the references
    python -m benchmarks.kernels --quick         # tiny sizes, seconds (the smoke test's)
    python -m benchmarks.kernels --out FILE      # the tables (markdown); default benchmarks/results/kernels_<device>.md

Sections, each a table of times (ms, median of ``--reps`` after warm-up; CUDA events on GPU) and ratios measured in
the same run:
1. ``fake_quant`` (qat_law's QAT kernel, ``callbacks/kernels/fake_quant.py``): fused Triton against the PyTorch
   reference, forward and forward + STE backward, fp32 and bf16, symmetric and asymmetric, and whether the outputs
   are equal bit for bit (what ``benchmarks/fake_quant_gpu.py`` measured before this script took it over).
2. ``w4a16`` (``callbacks/kernels/w4a16.py``): the packed int4 matmul against dequantize-then-matmul and against the
   dense bf16 ``F.linear`` whose weight it replaces, at the linear shapes of Llama-3.2-1B and LLaDA-8B, decoding
   (M = 1, 16 tokens) and prefill (M = 4096), G = 128; forward and forward + backward (dx), the error against the
   reference, and the weight's bytes dense and packed.
3. ``bytes``: whole models, full precision against packed (``lightning_modules/common/quantize/export.py``): tiny-lm
   exported for real (RTN, 4 bits; needs the cached tiny-lm), Llama-3.2-1B and LLaDA-8B by size on the meta device,
   at the export's one fp32 scale and zero per row and at the common G = 128 with fp16 scales and zeros.
4. ``attention``: ``benchmarks.attention.kernel_rows(device, quick) -> list[dict]`` (block-sparse attention against
   SDPA, written with the attention work) when that module provides it; else one line says the section is skipped.
Timings on a shared CPU are upper bounds.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (model, layer, in_features K, out_features N): the quantized linears' shapes at paper scale
PAPER_LINEARS = [
    ("llama32_1b", "q/o_proj", 2048, 2048), ("llama32_1b", "gate/up_proj", 2048, 8192),
    ("llama32_1b", "down_proj", 8192, 2048), ("llada_8b", "q/k/v/o_proj", 4096, 4096),
    ("llada_8b", "gate/up_proj", 4096, 12288), ("llada_8b", "down_proj", 12288, 4096),
]


class Timer:
    """Median milliseconds of ``reps`` calls after ``warmup`` (CUDA: events around each call)."""

    def __init__(self, device: str, reps: int, warmup: int = 2):
        self.cuda, self.reps, self.warmup = device == "cuda", reps, warmup

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)


def markdown(title: str, rows: list[dict], note: str = "") -> str:
    """One table: a heading, the rows (columns in first-seen order), an optional note."""
    lines = [f"### {title}", ""]
    if note:
        lines += [note, ""]
    if not rows:
        return "\n".join(lines + ["(no rows)", ""])
    cols = [c for c in dict.fromkeys(k for r in rows for k in r) if any(r.get(c) is not None for r in rows)]
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 1e4 else f"{v:.4g}"
        return "" if v is None else str(v)

    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines + [""])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


# --- 1. fake quantization ------------------------------------------------------------------------------------------
def fake_quant_rows(device: str, timer: Timer, tokens: int, hidden: int, groups: list[int], kernels: bool,
                    bits: int = 4) -> list[dict]:
    from callbacks.kernels.fake_quant import fake_quant, fake_quant_reference, fake_quant_triton

    cuda = kernels  # the Triton columns
    rows = []
    # bf16 on CUDA only: CPU timings are fp32, and Triton's interpreter truncates fp32 -> bf16 (CUDA rounds to nearest)
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        for g in groups:
            for sym in (True, False):
                x = torch.randn(tokens, hidden, device=device, dtype=dtype)
                gy = torch.randn_like(x)
                xg = x.clone().requires_grad_(True)

                def fwd_bwd(impl):
                    return lambda: fake_quant(xg, bits, g, sym, impl=impl).backward(gy)

                row = {"dtype": str(dtype)[6:], "G": g, "symmetric": sym, "x": f"{tokens}×{hidden}",
                       "fwd torch ms": timer(lambda: fake_quant_reference(x, bits, g, sym)),
                       "fwd triton ms": timer(lambda: fake_quant_triton(x, bits, g, sym)) if cuda else None}
                row["fwd speed-up"] = _ratio(row["fwd torch ms"], row["fwd triton ms"])
                row["fwd+bwd torch ms"] = timer(fwd_bwd("torch"))
                row["fwd+bwd triton ms"] = timer(fwd_bwd("triton")) if cuda else None
                row["fwd+bwd speed-up"] = _ratio(row["fwd+bwd torch ms"], row["fwd+bwd triton ms"])
                if cuda:
                    (y_ref, m_ref), (y_tri, m_tri) = (fake_quant_reference(x, bits, g, sym),
                                                      fake_quant_triton(x, bits, g, sym))
                    row["bitwise equal"] = bool(torch.equal(y_ref, y_tri) and torch.equal(m_ref, m_tri))
                rows.append(row)
    return rows


# --- 2. W4A16 matmul -----------------------------------------------------------------------------------------------
def w4a16_rows(device: str, timer: Timer, shapes: list[tuple], tokens: list[int], dtype: torch.dtype, kernels: bool,
               group: int = 128) -> list[dict]:
    from callbacks.kernels.w4a16 import dequantize, pack_int4, w4a16_linear, w4a16_reference

    cuda = kernels  # the Triton columns
    rows = []
    for model, layer, k, n in shapes:
        gen = torch.Generator().manual_seed(k + n)
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scales = (torch.rand(n, k // group, generator=gen) / 64 + 1e-3).to(device, dtype)
        zeros = (torch.rand(n, k // group, generator=gen) * 15).to(device, dtype)
        qweight = pack_int4(codes).to(device)
        dense = dequantize(qweight, scales, zeros).to(dtype)  # the full-precision weight the packing replaces
        packed_bytes = sum(t.numel() * t.element_size() for t in (qweight, scales, zeros))
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=dtype)
            gy = torch.randn(m, n, device=device, dtype=dtype)
            xg = x.clone().requires_grad_(True)

            def fb(fn):
                return lambda: fn(xg).backward(gy)

            ops = {"dense": lambda v: F.linear(v, dense),
                   "reference": lambda v: w4a16_reference(v, qweight, scales, zeros),
                   "triton": lambda v: w4a16_linear(v, qweight, scales, zeros, impl="triton")}
            if not cuda:
                ops.pop("triton")
            row = {"model": model, "layer": layer, "K×N": f"{k}×{n}", "M": m}
            for name, op in ops.items():
                row[f"fwd {name} ms"] = timer(lambda: op(x))
            for name, op in ops.items():
                row[f"fwd+bwd {name} ms"] = timer(fb(op))
            row["fwd triton/dense"] = _ratio(row.get("fwd triton ms"), row["fwd dense ms"])
            row["fwd reference/triton"] = _ratio(row["fwd reference ms"], row.get("fwd triton ms"))
            if cuda:
                ref = w4a16_reference(x, qweight, scales, zeros).float()
                out = w4a16_linear(x, qweight, scales, zeros, impl="triton").float()
                row["max rel err"] = float((out - ref).abs().max() / ref.abs().max())
            row["weight MiB dense"] = dense.numel() * dense.element_size() / 2 ** 20
            row["weight MiB packed"] = packed_bytes / 2 ** 20
            rows.append(row)
    return rows


# --- 3. model bytes ------------------------------------------------------------------------------------------------
def tiny_lm_bytes() -> dict | None:
    """tiny-lm quantized (RTN, 4 bits), packed and written for real; None when tiny-lm is not built."""
    from datamodules.common.tiny_models import model_dir

    location = model_dir("tiny-lm")
    if not (location / "model.safetensors").exists():
        return None
    from transformers import AutoModelForCausalLM

    from lightning_modules.common.quantize import RTN
    from lightning_modules.common.quantize.driver import quantize_model
    from lightning_modules.common.quantize.export import pack_model, pack_skeleton, save_packed, storage_bytes

    model = AutoModelForCausalLM.from_pretrained(str(location)).eval()
    fp_disk = (location / "model.safetensors").stat().st_size
    fp_mem = storage_bytes(model)
    calib = [{"input_ids": torch.randint(0, 100, (1, 16))}]  # RTN reads no statistics: any tokens do
    report = quantize_model(model, RTN(), calib, 4, with_limit=False, log=None)
    skeleton = copy.deepcopy(model).to("meta")
    pack_skeleton(skeleton, 128, torch.float16)
    names = pack_model(model, report["grids"])
    with tempfile.TemporaryDirectory() as tmp:
        path = save_packed(model, tmp, names)
        disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return {"model": "tiny-lm (fp32, measured)", "quantized linears": len(names), "fp MiB memory": fp_mem / 2 ** 20,
            "packed MiB memory": storage_bytes(model) / 2 ** 20,
            "packed G=128 fp16 MiB": storage_bytes(skeleton) / 2 ** 20,
            "fp MiB disk": fp_disk / 2 ** 20, "packed MiB disk": disk / 2 ** 20}


def paper_bytes(name: str) -> dict:
    """A paper-scale backbone by size on the meta device (its config's dtype), packed two ways."""
    from omegaconf import OmegaConf

    from lightning_modules.common.backbone import build_backbone
    from lightning_modules.common.quantize.export import pack_skeleton, storage_bytes

    spec = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "backbone" / f"{name}.yaml"), resolve=True)
    model = build_backbone(spec, meta=True)
    fp = storage_bytes(model)
    per_row, g128 = copy.deepcopy(model), copy.deepcopy(model)
    n = len(pack_skeleton(per_row, None, torch.float32))
    pack_skeleton(g128, 128, torch.float16)
    dtype = str(next(model.parameters()).dtype)[6:]
    return {"model": f"{name} ({dtype}, by size)", "quantized linears": n, "fp MiB memory": fp / 2 ** 20,
            "packed MiB memory": storage_bytes(per_row) / 2 ** 20,
            "packed G=128 fp16 MiB": storage_bytes(g128) / 2 ** 20}


def bytes_rows(quick: bool) -> tuple[list[dict], str]:
    rows, notes = [], []
    tiny = tiny_lm_bytes()
    if tiny is None:
        notes.append("tiny-lm is not built (python -m datamodules.common.tiny_models build tiny-lm): "
                     "its row is skipped.")
    else:
        rows.append(tiny)
    for name in ([] if quick else ["llama32_1b", "llada_8b"]):
        rows.append(paper_bytes(name))
    for r in rows:
        r["fp / packed"] = _ratio(r["fp MiB memory"], r["packed MiB memory"])
    return rows, " ".join(notes)


# --- 4. attention --------------------------------------------------------------------------------------------------
def attention_rows(device: str, quick: bool) -> tuple[list[dict], str]:
    try:
        from benchmarks import attention
    except ImportError:
        return [], "benchmarks/attention.py is not present: the attention section is skipped."
    fn = getattr(attention, "kernel_rows", None)
    if fn is None:
        return [], "benchmarks.attention has no kernel_rows(device, quick): the attention section is skipped."
    return fn(device=device, quick=quick), ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is present")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: the smoke test (seconds)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per cell (default 20 on CUDA, 5 on CPU)")
    ap.add_argument("--out", type=Path, default=None, help="write the tables here (markdown)")
    ap.add_argument("--sections", nargs="+", default=["fake_quant", "w4a16", "bytes", "attention"])
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    cuda = device == "cuda"
    # on CPU the Triton kernels run only under TRITON_INTERPRET=1 and at --quick sizes (their code path, not speed)
    kernels = cuda or (args.quick and os.environ.get("TRITON_INTERPRET") == "1")
    timer = Timer(device, args.reps or (20 if cuda else 3 if args.quick else 5), warmup=1 if args.quick else 2)
    head = (f"{torch.cuda.get_device_name()}, bf16" if cuda else
            f"CPU ({torch.get_num_threads()} threads), fp32: the Triton kernels need CUDA, so only their PyTorch "
            "references are timed (their CPU check is the interpreter tests, tests/test_kernels_*.py)"
            + ("; here they also ran under TRITON_INTERPRET=1: those times are the interpreter's" if kernels else ""))
    out = [f"# Kernels against their references ({'quick, ' if args.quick else ''}{head})", ""]
    print(out[0])
    dtype = torch.bfloat16 if cuda else torch.float32

    def emit(title, rows, note=""):
        text = markdown(title, rows, note)
        print(text, flush=True)
        out.append(text)

    if "fake_quant" in args.sections:
        tokens, hidden = (8192, 3968) if cuda else (64, 256) if args.quick else (2048, 1024)
        emit("fake_quant: fused Triton vs PyTorch reference (4 bits)",
             fake_quant_rows(device, timer, tokens, hidden, [32 if args.quick else 128], kernels))
    if "w4a16" in args.sections:
        if cuda and not args.quick:
            shapes, tokens = PAPER_LINEARS, [1, 16, 4096]
        elif args.quick:
            shapes, tokens = [("tiny", "square", 256, 256)], [4]
        else:
            shapes, tokens = [PAPER_LINEARS[0], PAPER_LINEARS[3]], [1, 16, 256]
        emit(f"w4a16: packed int4 matmul vs dequantize-then-matmul vs dense {str(dtype)[6:]} (G = 128)",
             w4a16_rows(device, timer, shapes, tokens, dtype, kernels))
    if "bytes" in args.sections:
        rows, note = bytes_rows(args.quick)
        emit("bytes: full precision vs packed 4-bit (export_packed)", rows, note)
    if "attention" in args.sections:
        rows, note = attention_rows(device, args.quick)
        emit("attention: block-sparse vs SDPA", rows, note)
    path = args.out or ROOT / "benchmarks" / "results" / f"kernels_{device}{'_quick' if args.quick else ''}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))
    print(f"tables written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
