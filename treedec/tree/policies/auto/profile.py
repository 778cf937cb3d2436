"""Times a step's passes here at one row count: the verify over T tokens (powers of two up to the largest tree;
T = 1 the plain pass) and the policy's own draft of each width at depth 1 and its deepest (with a one-token
catch-up, as after a step), best of RUNS after a warm-up, interleaved so no pass finds the caches another left warm;
on caches of its own after a prefix as long as the prompts. Points the kept table has are not measured again.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from typing import Callable

import torch

RUNS = 3  # timed runs per pass (the fastest counts: a busy machine only ever slows a run)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure(target, head, policy, rows: int, have: dict, context: int, new_drafter: Callable) -> dict:
    """``{"verify": {T: s}, "draft": {k: {D: s}}}`` at ``rows`` rows: ``have``'s points plus the missing ones."""
    dev, layers = next(target.parameters()).device, head.feature_layers_needed
    biggest = max(t for *_, t in policy.shapes)
    sizes = {1, biggest} | {2 ** j for j in range(biggest.bit_length()) if 2 ** j <= biggest}
    verify_at = sorted(sizes - set(have.get("verify", {})))
    draft_at = {}
    for k in sorted({k for k, d, _ in policy.shapes if d}):
        deepest = max(d for kk, d, _ in policy.shapes if kk == k)
        draft_at[k] = sorted({1, deepest} - set(have.get("draft", {}).get(k, {})))
    prefix = max(int(context), 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, target.config.vocab_size, (rows, prefix + biggest + 1), generator=gen).to(dev)
    cache = target.new_cache(rows, prefix + biggest + 1)
    pre = target(ids[:, :prefix], cache, logits=torch.full((rows, 1), prefix - 1, device=dev), layer_inputs=layers)
    cache.rollback(prefix)
    drafter = new_drafter(rows, prefix + 1 + policy.max_inputs + policy.max_depth + 2)
    feats = head.features(pre)  # any target features serve for timing
    drafter.catch_up(ids[:, 1:prefix + 1], feats, None, [prefix] * rows, ids[:, prefix])
    drafter.flush()

    def verify(t: int):
        if t == 1:
            return lambda: target(ids[:, :1], cache, logits="last", layer_inputs=layers)
        pos = cache.lengths[:, None] + torch.arange(t, device=dev)
        mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(rows, t, t)
        return lambda: target(ids[:, :t], cache, position_ids=pos, tree_mask=mask, layer_inputs=layers)

    def draft(k: int, d: int):
        def run():
            drafter.cache.rollback(prefix - 1)  # the step before accepted one token: the head catches up on it
            drafter.catch_up(ids[:, :1], feats[:, :1], None, [1] * rows, ids[:, 0])
            policy.draft_shape(drafter, k, d)
        return run

    passes = {("verify", t): verify(t) for t in verify_at}
    passes.update({("draft", k, d): draft(k, d) for k, ds in draft_at.items() for d in ds})
    best = dict.fromkeys(passes, float("inf"))
    for run in range(RUNS + 1):  # interleaved: each pass runs after another, as in a step
        for name, fn in passes.items():
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            if run:
                best[name] = min(best[name], time.perf_counter() - t0)
    out = {"verify": dict(have.get("verify", {})), "draft": {k: dict(v) for k, v in have.get("draft", {}).items()}}
    for name, s in best.items():
        if name[0] == "verify":
            out["verify"][name[1]] = s
        else:
            out["draft"].setdefault(name[1], {})[name[2]] = s
    return out


def _identity(module: torch.nn.Module) -> str:
    """A model's shape, dtypes and module types (two checkpoints of one architecture cost the same; an int8 or
    compiled variant does not)."""
    parts = [json.dumps(vars(module.config), sort_keys=True, default=str),
             sorted({str(p.dtype) for p in module.parameters()}), sorted({type(m).__name__ for m in module.modules()})]
    return hashlib.sha1(str(parts).encode()).hexdigest()[:16]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.processor() or platform.machine()} x{os.cpu_count()}"


def profile_key(target, head, compiled: bool) -> dict:
    """What a table is valid for: the machine, both models, the attention backend, threads, compile, torch."""
    return {"device": device_name(next(target.parameters()).device), "target": _identity(target), "head": _identity(head),
            "backend": getattr(target, "attn_backend", ""), "threads": torch.get_num_threads(),
            "compile": bool(compiled), "torch": torch.__version__}


__all__ = ["measure", "profile_key"]
