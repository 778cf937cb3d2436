"""Tree-attention kernel micro-benchmark: ``python -m treedec.bench.kernel``.

Times each backend on one decode-time verification step (a random tree of T nodes over a
prefix of L cached tokens) and reports the median latency beside the achieved KV bandwidth,
because the op is memory-bound (design §1): per layer it must read
2 · (L + T) · Hkv · D · bytes of K/V per batch row, and little else.

Backends are timed through their implementations directly (inputs validated once up
front), so the dispatcher's checks and host syncs are not in the figure. On CUDA each
repeat flushes the L2 cache first and is timed with CUDA events. On CPU the triton backend
runs only when ``--backends`` names it (the interpreter is a correctness tool, not a speed).

The Triton kernel is imported when a run asks for it: after ``TRITON_INTERPRET`` is set on CPU (it must be set
before the kernel is defined), and never where Triton is not installed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from typing import Callable

import torch

from treedec.attention import check_inputs, reference
from treedec.tree import Tree

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m treedec.bench.kernel", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--backends", default=None, help="comma list of eager,sdpa,triton (default: all; no triton on CPU)")
    p.add_argument("--prefix-lens", type=_ints, default=[512, 2048, 8192], help="comma list of L")
    p.add_argument("--tree-sizes", type=_ints, default=[16, 32, 64, 128], help="comma list of T")
    p.add_argument("--heads", type=int, default=32, help="query heads Hq")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def backend_fns(names: list[str]) -> dict[str, Callable]:
    """The backend implementations, without the dispatcher's validation."""
    fns: dict[str, Callable] = {"eager": reference.eager_tree_attention, "sdpa": reference.sdpa_tree_attention}
    if "triton" in names:
        from treedec.attention.triton_kernel import triton_tree_attention

        fns["triton"] = triton_tree_attention
    return {n: fns[n] for n in names}


def random_tree_bits(T: int, gen: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(max(0, i - 8), i, (1,), generator=gen)) for i in range(1, T)]
    return Tree.from_parents(parents).ancestor_bits()


def median_us(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn`` in µs; on CUDA with events and a flushed L2 before each call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            flush.zero_()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if args.backends:
        names = [b.strip() for b in args.backends.split(",") if b.strip()]
    else:
        names = ["eager", "sdpa"] + (["triton"] if device.type == "cuda" else [])
    if "triton" in names and device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel's definition
    if args.threads:
        torch.set_num_threads(args.threads)
    fns = backend_fns(names)
    gen = torch.Generator().manual_seed(args.seed)
    B, Hq, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for L in args.prefix_lens:
        for T in args.tree_sizes:
            bits = random_tree_bits(T, gen).to(device)
            q = torch.randn(B, Hq, T, D, generator=gen).to(device, dtype)
            k = torch.randn(B, Hkv, L + T, D, generator=gen).to(device, dtype)
            v = torch.randn(B, Hkv, L + T, D, generator=gen).to(device, dtype)
            pl = check_inputs(q, k, v, bits, torch.full((B,), L, dtype=torch.long))
            kv_bytes = 2 * B * (L + T) * Hkv * D * itemsize
            ref = None
            for name, fn in fns.items():
                out = fn(q, k, v, bits, pl)
                ref = out.float() if ref is None else ref
                us = median_us(partial(fn, q, k, v, bits, pl), device, args.repeats, args.warmup)
                rows.append(dict(prefix=L, tree=T, backend=name, us=round(us, 2),
                                 kv_gbps=round(kv_bytes / us / 1e3, 2), kv_mb=round(kv_bytes / 2**20, 3),
                                 max_abs_diff=float((out.float() - ref).abs().max())))
    return dict(
        command=" ".join(["python -m treedec.bench.kernel"] + sys.argv[1:]),
        config=dict(device=str(device), dtype=args.dtype, batch=B, heads=Hq, kv_heads=Hkv, head_dim=D,
                    repeats=args.repeats, warmup=args.warmup, backends=names),
        env=dict(torch=torch.__version__, python=platform.python_version(), threads=torch.get_num_threads(),
                 hardware=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
                 or platform.machine()),
        rows=rows,
    )


def markdown(result: dict) -> str:
    first = result["rows"][0]["backend"] if result["rows"] else "-"
    lines = [f"| prefix L | tree T | backend | µs (median) | KV GB/s | KV MiB | max abs diff vs {first} |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['prefix']} | {r['tree']} | {r['backend']} | {r['us']:.1f} | {r['kv_gbps']:.2f} "
                     f"| {r['kv_mb']:.2f} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    c, e = result["config"], result["env"]
    print(f"# tree attention: {c['device']} ({e['hardware']}), {c['dtype']}, B={c['batch']} Hq={c['heads']} "
          f"Hkv={c['kv_heads']} D={c['head_dim']}, torch {e['torch']}, {e['threads']} threads\n")
    print(markdown(result))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
