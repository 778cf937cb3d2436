"""Vanilla decoding speed: treedec vs. ``transformers.generate`` on identical weights.

A random Llama-architecture model of about 20M or 90M parameters is saved once in Hugging
Face format; treedec loads it with ``load_model`` and transformers with ``from_pretrained``.
Both decode the same prompt greedily for ``--new-tokens`` tokens (no EOS) in one process
with the same thread count; runs are interleaved (treedec, transformers, treedec, ...) so
that background load hits both alike, and medians after a warm-up are reported.

    python -m treedec.bench.vanilla_vs_hf --size 20m --dtype bf16 --threads 2 --new-tokens 128

In fp32 the two outputs must be identical (the script fails otherwise). treedec applies RoPE
in the model dtype as transformers does, so bf16 outputs normally agree too; bf16 kernels may
still round differently, so there the script only reports how many leading tokens agree.

Timings need a quiet machine: with other processes competing for the cores, multi-threaded
CPU kernels stall at OpenMP barriers and both figures collapse (the ratio suffers less).

transformers (a test dependency, not the package's) is imported inside the functions that run it, so ``--help``
and a wrong argument answer without it.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time

import torch

from treedec.decoding.vanilla import generate
from treedec.models import LlamaConfig, Transformer, load_model
from treedec.models.checkpoint import save_pretrained

SIZES = {
    # ~19M parameters: 2 x 3.1M embeddings/head + 8 x 1.6M layers
    "20m": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                num_attention_heads=6, num_key_value_heads=2),
    # ~90M parameters: 2 x 10.5M embeddings/head + 16 x 4.3M layers
    "90m": dict(vocab_size=16384, hidden_size=640, intermediate_size=1728, num_hidden_layers=16,
                num_attention_heads=10, num_key_value_heads=2),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_checkpoint(size: str, path: str, seed: int = 0) -> int:
    """Write a random model of ``size`` to ``path`` (fp32, HF format); return its parameter count."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(max_position_embeddings=2048, rope_theta=500000.0, rms_norm_eps=1e-5, **SIZES[size])
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.05)
    save_pretrained(model, path)
    return sum(p.numel() for p in model.parameters())


def load_hf(path: str, dtype: torch.dtype):
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    return model.eval()


def time_treedec(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    res = generate(model, prompt, n, eos_ids=[])
    return time.perf_counter() - t0, res.tokens[0]


def time_hf(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0, out[0, len(prompt):].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(size: str, dtype: str, threads: int, new_tokens: int, runs: int = 5, prompt_len: int = 32, seed: int = 0) -> dict:
    import transformers

    torch.set_num_threads(threads)
    tdt = DTYPES[dtype]
    with tempfile.TemporaryDirectory() as d:
        n_params = build_checkpoint(size, d, seed)
        ours = load_model(d, dtype=tdt)
        hf = load_hf(d, tdt)
    prompt = torch.randint(1, ours.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
    time_treedec(ours, prompt, 8)  # warm-up (allocator, kernels)
    time_hf(hf, prompt, 8)
    t_ours, t_hf = [], []
    toks_ours = toks_hf = None
    for _ in range(runs):
        dt, toks_ours = time_treedec(ours, prompt, new_tokens)
        t_ours.append(dt)
        dt, toks_hf = time_hf(hf, prompt, new_tokens)
        t_hf.append(dt)
    agree = common_prefix(toks_ours, toks_hf)
    res = {
        "size": size, "params": n_params, "dtype": dtype, "threads": threads, "new_tokens": new_tokens,
        "prompt_len": prompt_len, "runs": runs,
        "treedec_tok_s": new_tokens / statistics.median(t_ours), "hf_tok_s": new_tokens / statistics.median(t_hf),
        "identical": toks_ours == toks_hf, "agreeing_prefix": agree,
        "torch": torch.__version__, "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine(),
    }
    res["ratio"] = res["treedec_tok_s"] / res["hf_tok_s"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="20m")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5, help="timed runs of each, after one warm-up")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line")
    a = ap.parse_args(argv)
    if a.dtype == "fp16":  # pragma: no cover - not offered: fp16 matmuls are ~100x slower on CPU
        raise SystemExit("use bf16 or fp32 on CPU")
    r = run(a.size, a.dtype, a.threads, a.new_tokens, a.runs, a.prompt_len, a.seed)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"{r['size']} ({r['params'] / 1e6:.1f}M params) {r['dtype']}, {r['threads']} threads, "
              f"{r['new_tokens']} new tokens, median of {r['runs']}:")
        print(f"  treedec       {r['treedec_tok_s']:8.1f} tok/s")
        print(f"  transformers  {r['hf_tok_s']:8.1f} tok/s")
        print(f"  ratio         {r['ratio']:8.2f}x")
        print(f"  outputs identical: {r['identical']} (first {r['agreeing_prefix']} tokens agree)")
    if a.dtype == "fp32" and not r["identical"]:
        print(f"ERROR: fp32 outputs differ after {r['agreeing_prefix']} tokens", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
