"""Interleaved A/B of decoding methods in one process: the check behind a small speed claim on a noisy machine.

    python scripts/ab.py --batch 4 vanilla chain:5@fp32 chain:5@bf16 dynamic:16/5/2@fp32 dynamic:16/5/2@bf16

A method is ``vanilla``, ``chain:D``, ``static`` (EAGLE's 26-node shape), ``dynamic:T/D/K`` (calibrated),
``auto`` (``tree.total_tokens=auto``, pool 7 / 4) or ``lookup:D`` (prompt lookup beside a D-deep chain), with
``@fp32`` / ``@bf16`` / ``@auto`` for the draft head's dtype (default auto). Bundled model, bf16 target,
third-party prompts, ragged batches, finished rows leave the batch. Within a pass the methods take turns on
each batch, the order rotating; each pass's ratio is to that pass's vanilla, so a machine that speeds up or
slows down between passes moves every method alike (``bench.batch_sizes`` does the same for a whole report).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treedec.data.prompts import load_prompt_set
from treedec.decoding import vanilla
from treedec.models import load_model
from treedec.models.draft import DraftHead
from treedec.models.tokenizer import load_tokenizer
from treedec.training.predict import CompactingDecoder
from treedec.tree.policies import ChainPolicy, DynamicPolicy, LookupPolicy, StaticPolicy


def policy(kind: str, arg: str):
    calibrated = dict(calibration="auto", draft_path="tiny-code-eagle")
    if kind == "chain":
        return ChainPolicy(int(arg))
    if kind == "static":
        return StaticPolicy(shape="eagle_mc_sim_7b_63")
    if kind == "dynamic":
        T, d, k = map(int, arg.split("/"))
        return DynamicPolicy(total_tokens=T, depth=d, top_k=k, **calibrated)
    if kind == "auto":
        return DynamicPolicy(total_tokens="auto", depth=7, top_k=4, **calibrated)
    if kind == "lookup":
        return LookupPolicy(ChainPolicy(int(arg)))
    raise SystemExit(f"unknown method {kind!r}: vanilla, chain:D, static, dynamic:T/D/K, auto or lookup:D")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("methods", nargs="+")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer("tiny-code")
    target = load_model("tiny-code", dtype=torch.bfloat16)
    heads: dict[str, DraftHead] = {}
    runs = {}
    for spec in a.methods:
        name, _, dtype = spec.partition("@")
        kind, _, arg = name.partition(":")
        if kind == "vanilla":
            runs[spec] = lambda rows: vanilla.generate(target, rows, a.tokens)
            continue
        dtype = dtype or "auto"
        if dtype not in heads:
            heads[dtype] = DraftHead.load("tiny-code-eagle", target=target, dtype=dtype)
        dec = CompactingDecoder(target, heads[dtype], policy(kind, arg))
        runs[spec] = lambda rows, dec=dec: dec.generate(rows, a.tokens)
    if "vanilla" not in runs:
        raise SystemExit("include vanilla: every ratio is to it")
    prompts = [tok.encode(p.text) for p in load_prompt_set("third_party", a.prompts, 128, tok, seed=0)]
    batches = [prompts[i:i + a.batch] for i in range(0, len(prompts), a.batch)]
    names = list(runs)
    for n in names:  # warm-up: kernels, plans, the auto budget's first steps
        runs[n](batches[0])
    rate = {n: [] for n in names}
    steps = {n: [0, 0] for n in names}  # tokens, (row, pass) pairs
    for p in range(a.passes):
        secs, toks = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
        for i, rows in enumerate(batches):
            j = (p + i) % len(names)
            for n in names[j:] + names[:j]:
                t = time.perf_counter()
                res = runs[n](rows)
                secs[n] += time.perf_counter() - t
                k = sum(len(r) for r in res.tokens)
                toks[n] += k
                steps[n][0] += k
                steps[n][1] += res.stats.row_steps
        for n in names:
            rate[n].append(toks[n] / secs[n])
    print(f"batch {a.batch}, {len(prompts)} prompts x {a.tokens} tokens, {a.passes} passes, {a.threads} threads")
    for n in names:
        ratios = [r / v for r, v in zip(rate[n], rate["vanilla"])]
        print(f"{n:24s} {statistics.median(rate[n]):8.1f} tok/s  x{statistics.median(ratios):.3f}  "
              f"tau {steps[n][0] / max(steps[n][1], 1):.2f}  per pass {' '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
