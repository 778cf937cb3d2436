"""Per-call costs of the kernels a decoding step is made of, on this machine's CPU.

    python scripts/cpu_kernels.py [--threads 2]

Prints, for the bundled model's shapes: linear layers in bf16 with oneDNN, bf16 with ATen's own
kernel (oneDNN off) and fp32, by row count; K/V writes by ``scatter_`` vs advanced indexing; and a
path commit both ways. docs/benchmarks.md ("What a step costs on this CPU") records its output and
the engine choices it led to.
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F


def per_call_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def linears() -> None:
    print("| linear | rows | bf16 oneDNN | bf16 ATen | fp32 |\n|---|---:|---:|---:|---:|")
    for k, n in ((256, 384), (256, 1408), (704, 256), (256, 8192)):
        for rows in (1, 2, 6, 26):
            x, w = torch.randn(rows, k), torch.randn(n, k)
            xb, wb = x.bfloat16(), w.bfloat16()
            onednn = per_call_us(lambda: F.linear(xb, wb))
            with torch.backends.mkldnn.flags(enabled=False):
                aten = per_call_us(lambda: F.linear(xb, wb))
            fp32 = per_call_us(lambda: F.linear(x, w))
            print(f"| {k}→{n} | {rows} | {onednn:.1f} µs | {aten:.1f} µs | {fp32:.1f} µs |")


def cache_moves() -> None:
    print("\n| K/V move | dtype | batch × tokens | scatter_/gather | advanced indexing |\n|---|---|---|---:|---:|")
    for dt in (torch.bfloat16, torch.float32):
        for B, T in ((1, 6), (16, 4)):
            kl, k = torch.zeros(B, 2, 512, 32, dtype=dt), torch.randn(B, 2, T, 32, dtype=dt)
            slots = torch.randint(100, 300, (B,))[:, None] + torch.arange(T)
            rows = torch.arange(B)[:, None]
            scat = per_call_us(lambda: kl.scatter_(2, slots[:, None, :, None].expand_as(k), k))

            def index():
                kl[rows, :, slots] = k.transpose(1, 2)

            print(f"| write | {str(dt)[6:]} | {B} × {T} | {scat:.1f} µs | {per_call_us(index):.1f} µs |")
        for B, w in ((1, 6), (16, 4)):
            buf = torch.zeros(12, B, 2, 512, 32, dtype=dt)
            dst = torch.randint(100, 300, (B,))[:, None] + torch.arange(w)
            src = dst - 1
            gi = src[None, :, None, :, None].expand(12, B, 2, w, 32)
            si = dst[None, :, None, :, None].expand(12, B, 2, w, 32)
            rows = torch.arange(B)[:, None]
            scat = per_call_us(lambda: buf.scatter_(3, si, buf.gather(3, gi)))

            def index():
                buf[:, rows, :, dst] = buf[:, rows, :, src]

            print(f"| commit, 12 layers | {str(dt)[6:]} | {B} × {w} | {scat:.1f} µs | {per_call_us(index):.1f} µs |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*TF32.*")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    with torch.inference_mode():
        linears()
        cache_moves()


if __name__ == "__main__":
    main()
