"""The timing loop: warm-up, then ``repeats`` passes with the methods taking turns on every prompt, and the
untimed op count of each method (see harness.py for the protocol).

``torch._dynamo`` (seconds to import) is imported only when a compiled method is timed.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from treedec.bench.methods import Method, Prompt, RunOutput

log = logging.getLogger("treedec.bench")


# --------------------------------------------------------------------------- timing loop
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphs_compiled() -> int:
    """Graphs torch.compile has compiled so far in this process (0 when dynamo is unavailable)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - every supported torch has dynamo
        return 0
    return int(counters["stats"]["unique_graphs"])


def _timed(m: Method, p: Prompt, seed: int, device: torch.device) -> tuple[RunOutput, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = m(p, seed)
    _sync(device)
    return out, time.perf_counter() - t0 if out.seconds is None else out.seconds


NOT_COUNTED_COMPILED = ("not counted: torch.compile cannot run under count_ops' dispatch mode (and a compiled "
                        "function called under one stays broken), see the eager method's counts")


def count_method_ops(m: Method, prompt: Prompt, seed: int) -> dict | None:
    """One extra untimed run of a treedec method inside count_ops (None for peers); a failure is recorded."""
    if m.ops_fn is None:
        return None
    if m.compiled:
        return {"skipped": NOT_COUNTED_COMPILED}
    try:
        return m.ops_fn(prompt, seed)
    except Exception as exc:  # counting is a diagnostic: it must not sink the benchmark
        log.warning("%s: counting aten ops failed: %s: %s", m.name, type(exc).__name__, exc)
        return {"error": f"{type(exc).__name__}: {exc}"}


def time_methods(methods: list[Method], prompts: list[Prompt], repeats: int, warmup: int, seed: int,
                 device: torch.device, ops: bool = True) -> dict[str, dict]:
    """Run every method on every prompt, interleaved; returns per method its per-pass times and first-pass outputs.

    Also per method: ``warmup_s`` (each warm-up run), ``compile_s`` (compiled methods: the first
    warm-up run, which pays the compilation; a compiled method gets one even with ``warmup=0``),
    ``ops`` (:func:`measure_ops` on the first prompt, untimed) and ``graphs_in_timed`` (graphs
    torch.compile built during the timed runs: should be 0, else compile time leaked into tok/s).
    """
    res = {m.name: {"times": [], "tokens": [], "outputs": [], "splits": [], "warmup_s": [], "graphs_in_timed": 0}
           for m in methods}
    for w in range(max(warmup, 1 if any(m.compiled for m in methods) else 0)):
        for m in methods:
            if w >= warmup and not m.compiled:
                continue
            log.info("warm-up %d/%d: %s", w + 1, max(warmup, 1), m.name)
            # A compiled method warms up on the longest prompt: its cache bucket then serves them all.
            first = max(prompts, key=lambda p: len(p.ids)) if m.compiled else prompts[0]
            res[m.name]["warmup_s"].append(_timed(m, first, seed, device)[1])
    for m in methods:
        if m.compiled:
            res[m.name]["compile_s"] = res[m.name]["warmup_s"][0]
            log.info("%s: first warm-up run (compilation included) %.1f s", m.name, res[m.name]["compile_s"])
        if ops:
            res[m.name]["ops"] = count_method_ops(m, prompts[0], seed)
    for r in range(max(repeats, 1)):
        t_pass = {m.name: 0.0 for m in methods}
        n_pass = {m.name: 0 for m in methods}
        split_pass = {m.name: Counter() for m in methods}
        outs: dict[str, list[RunOutput]] = {m.name: [] for m in methods}
        for i, p in enumerate(prompts):
            k = (r + i) % len(methods)
            for m in methods[k:] + methods[:k]:
                graphs = _graphs_compiled() if m.compiled else 0
                out, dt = _timed(m, p, seed + i, device)
                if m.compiled:
                    res[m.name]["graphs_in_timed"] += _graphs_compiled() - graphs
                t_pass[m.name] += dt
                n_pass[m.name] += len(out.tokens)
                split_pass[m.name].update(out.split)
                outs[m.name].append(out)
        for m in methods:
            d = res[m.name]
            d["times"].append(t_pass[m.name])
            d["tokens"].append(n_pass[m.name])
            d["splits"].append(dict(split_pass[m.name]))
            if r == 0:
                d["outputs"] = outs[m.name]
            elif m.greedy and [o.tokens for o in outs[m.name]] != [o.tokens for o in d["outputs"]]:
                log.warning("%s: greedy output changed between passes (non-deterministic kernels?)", m.name)
        log.info("pass %d/%d: %s", r + 1, repeats,
                 ", ".join(f"{m.name} {n_pass[m.name] / t_pass[m.name]:.1f} tok/s" for m in methods if t_pass[m.name]))
    for m in methods:
        if res[m.name]["graphs_in_timed"]:
            log.warning("%s: torch.compile built %d graph(s) during the timed runs, so its tok/s includes "
                        "compilation (a new shape per prompt?)", m.name, res[m.name]["graphs_in_timed"])
    return res
