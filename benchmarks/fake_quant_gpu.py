"""Fused Triton fake-quant against its PyTorch reference, side by side on one GPU (forward and forward+STE backward).

    python -m benchmarks.fake_quant_gpu                 # activations of a 595M-size layer, G = 128, bf16 and fp32
    python -m benchmarks.fake_quant_gpu --tokens 16384 --hidden 4096 --group 32 64 128

Prints, per (dtype, G): the reference's and the kernel's time, the speed-up, and whether the outputs are equal
(fp32: bitwise; bf16: the kernel computes in fp32 and rounds once, the reference too). Needs CUDA and Triton.
"""
from __future__ import annotations

import argparse

import torch


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=3968)
    ap.add_argument("--group", type=int, nargs="+", default=[128])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.fake_quant_gpu needs a CUDA GPU (the kernel's CPU check is tests/test_kernels_fake_quant.py)")
        return 0
    from callbacks.kernels.fake_quant import fake_quant, fake_quant_reference, fake_quant_triton

    print(f"{torch.cuda.get_device_name()}: x of shape ({args.tokens}, {args.hidden}), {args.bits} bits")
    print(f"{'dtype':>9} {'G':>5} {'sym':>5} | {'torch ms':>9} {'triton ms':>9} {'speed-up':>8} | {'fwd+bwd ×':>9} | equal")
    for dtype in (torch.float32, torch.bfloat16):
        for g in args.group:
            for sym in (True, False):
                x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=dtype)
                t_ref = _time(lambda: fake_quant_reference(x, args.bits, g, sym), args.reps)
                t_tri = _time(lambda: fake_quant_triton(x, args.bits, g, sym), args.reps)
                xg = x.clone().requires_grad_(True)
                gy = torch.randn_like(x)

                def fb(impl):
                    return lambda: fake_quant(xg, args.bits, g, sym, impl=impl).backward(gy)

                t_ref_b, t_tri_b = _time(fb("torch"), args.reps), _time(fb("triton"), args.reps)
                y_ref, m_ref = fake_quant_reference(x, args.bits, g, sym)
                y_tri, m_tri = fake_quant_triton(x, args.bits, g, sym)
                equal = torch.equal(y_ref, y_tri) and torch.equal(m_ref, m_tri)
                print(f"{str(dtype)[6:]:>9} {g:>5} {str(sym):>5} | {t_ref:9.3f} {t_tri:9.3f} {t_ref / t_tri:7.2f}× |"
                      f" {t_ref_b / t_tri_b:8.2f}× | {equal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
