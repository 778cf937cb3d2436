"""Throughput at several batch sizes (``bench.batch_sizes=[1,4,16]``): does a tree still pay when rows share a pass?

For each batch size b the prompts (taken in turn, wrapping around when there are fewer than b) are
decoded b rows at a time; prompts have different lengths, so every batch is ragged. Every greedy
treedec method (vanilla, each tree of ``bench.methods``) and the batched ``hf_greedy`` peer
(transformers ``generate`` with left padding and an attention mask) decode every prompt with the
same ``max_new_tokens``; rows stop at EOS on their own. ``bench.batch_mode``:

* ``static`` (default): every method decodes the same full batches of b prompts, one after another;
  finished rows leave the batch (compaction), no slot is refilled.
* ``continuous`` (as serving engines run): treedec methods, vanilla included, serve queues of 4·b
  prompts (:data:`QUEUE_ROUNDS`) through b slots (:meth:`~treedec.decoding.loop.Decoder.serve`): a
  finished row's slot takes the next prompt at once, and once the queue is dry finished rows leave
  the batch. ``hf_greedy`` has no slots: it decodes the prompts in static batches of b. (A tree
  method's rows finish at different steps, so a static batch idles slots in a tail of ever fewer
  rows; on the bundled model at batch 4 the newcomers' one-row prefills cost about what the shorter
  tail saves, docs/benchmarks.md.)

The auto budget sees the rows still decoding. The tree policies are the batch-1 run's own
objects: the auto budget's step-time model, fitted over row counts, carries over.

After one untimed warm-up of every method on the first batch, ``bench.repeats`` passes go over
all batches with the methods taking turns (the order rotates per batch); a method's figure is its
total new tokens over its total wall time, the median over passes; ``speedup`` is against vanilla at
the same batch size, ``tau`` is tokens per (row, decoding pass), ``identical_to_vanilla`` compares
every row with batched vanilla (a treedec mismatch fails the run in fp32 only: in bf16 a batch of
other shapes may round a near-tie the other way; the fp32 tests are the lossless proof).
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig

from treedec.bench import peers
from treedec.bench.methods import Prompt, method_names
from treedec.decoding.speculative import CompactingDecoder
from treedec.decoding.vanilla import VanillaDecoder
from treedec.models.paths import resolve_path

log = logging.getLogger("treedec.bench")
# Continuous batching: prompts per queue, in rounds of b. The methods take turns per queue, so shorter queues
# interleave them more finely on a machine whose pace drifts; each queue still ends in one tail of finishing rows.
QUEUE_ROUNDS = 4


@dataclass
class BatchRun:
    tokens: list[list[int]]  # new tokens per row
    produced: int  # tokens the decoding passes emitted (the prefill's first token excluded: tau's numerator)
    row_steps: int  # (row, decoding pass) pairs of rows still decoding (tau's denominator)
    tree_nodes: int = 0  # verified tree nodes summed over passes (speculative)
    passes: int = 0


@dataclass
class BatchMethod:
    name: str
    family: str  # "treedec" | "peer"
    fn: Callable[[list[list[int]], int], BatchRun]  # (prompts, slots) -> the run
    policy: object = None


def batches(prompts: list[Prompt], size: int) -> list[list[list[int]]]:
    """Full batches of ``size`` rows, the prompts in turn (wrapping around when there are fewer than ``size``)."""
    if size < 1:
        raise ValueError(f"bench.batch_sizes holds {size}; a batch needs at least 1 row")
    n = -(-max(len(prompts), size) // size) * size
    rows = [prompts[i % len(prompts)].ids for i in range(n)]
    return [rows[i: i + size] for i in range(0, n, size)]


def _from_stats(res) -> BatchRun:
    st = res.stats
    return BatchRun(res.tokens, st.step_tokens, st.row_steps, st.tree_nodes, st.target_passes)


def build(cfg: DictConfig, target, draft, eos_ids: list[int], policies: dict) -> tuple[list[BatchMethod], dict]:
    """The batched methods (vanilla, the tree methods that have a policy, hf_greedy); returns (methods, skipped)."""
    bench, n = cfg.bench, int(cfg.bench.max_new_tokens)
    plain = VanillaDecoder(target, eos_ids=eos_ids)
    out = [BatchMethod("vanilla", "treedec", lambda rows, k: _from_stats(plain.serve(rows, n, k, compact=True)))]
    for name in method_names(bench):
        if name in policies:
            dec = CompactingDecoder(target, draft, policies[name], eos_ids=eos_ids)
            out.append(BatchMethod(name, "treedec", lambda rows, k, dec=dec: _from_stats(dec.serve(rows, n, k)),
                                   policies[name]))
    skipped = {}
    if "hf_greedy" in (bench.get("peers") or []):
        try:
            model = peers.load_hf(resolve_path(cfg.model.path), target.dtype, target.device)
        except Exception as exc:  # no transformers, or a checkpoint it cannot read: the peer is skipped
            skipped["hf_greedy"] = f"batched hf_greedy could not load the model: {type(exc).__name__}: {exc}"
            log.warning("skipping batched hf_greedy: %s", skipped["hf_greedy"])
        else:
            def hf(rows, k):  # static batches of k rows
                toks = [t for i in range(0, len(rows), k) for t in peers.hf_generate_batch(model, rows[i:i + k], n,
                                                                                           eos_ids)[0]]
                n_tok = sum(len(t) for t in toks)
                return BatchRun(toks, n_tok, n_tok)  # plain decoding: one token per row and pass

            out.append(BatchMethod("hf_greedy", "peer", hf))
    return out, skipped


def _timed(m: BatchMethod, rows, slots: int, device) -> tuple[BatchRun, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    res = m.fn(rows, slots)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return res, time.perf_counter() - t0


def measure(methods: list[BatchMethod], groups: list[list[list[int]]], repeats: int, device,
            slots: int | None = None) -> dict[str, dict]:
    """Timed passes over all jobs (``groups``: each a list of prompts, decoded ``slots`` rows at a time; default
    the batch size; methods in turn, order rotating) -> per-method summary at this batch size."""
    slots = slots or len(groups[0])
    for m in methods:  # warm-up: allocator, kernels, tree=auto's step costs at this row count
        m.fn(groups[0], slots)
    times = {m.name: [] for m in methods}
    toks = {m.name: [] for m in methods}
    first: dict[str, list[BatchRun]] = {m.name: [] for m in methods}
    history = {m.name: len(m.policy.history) for m in methods if getattr(m.policy, "history", None) is not None}
    for r in range(max(repeats, 1)):
        t = dict.fromkeys(times, 0.0)
        k = dict.fromkeys(times, 0)
        for i, rows in enumerate(groups):
            j = (r + i) % len(methods)
            for m in methods[j:] + methods[:j]:
                res, dt = _timed(m, rows, slots, device)
                t[m.name] += dt
                k[m.name] += sum(len(x) for x in res.tokens)
                if r == 0:
                    first[m.name].append(res)
        for name in times:
            times[name].append(t[name])
            toks[name].append(k[name])
    out = {}
    ref = [x for res in first["vanilla"] for x in res.tokens]
    for m in methods:
        runs = first[m.name]
        tps = [n / s if s > 0 else 0.0 for n, s in zip(toks[m.name], times[m.name])]
        row_steps, passes = sum(x.row_steps for x in runs), sum(x.passes for x in runs)
        got = [x for res in runs for x in res.tokens]
        e = {"family": m.family, "tokens_per_s": statistics.median(tps), "tokens_per_s_passes": tps,
             "tau": sum(x.produced for x in runs) / row_steps if row_steps else 1.0,
             "identical_to_vanilla": got == ref, "rows_differing": sum(a != b for a, b in zip(got, ref)),
             "new_tokens": sum(len(x) for x in got)}
        if passes and m.family == "treedec" and m.name != "vanilla":
            e["mean_tree_size"] = sum(x.tree_nodes for x in runs) / passes
        if m.name in history:  # tree=auto's shapes during this batch size's runs, most frequent first
            arms = Counter(m.policy.history[history[m.name]:]).most_common(4)
            e["auto_arms"] = [{"total_tokens": T, "depth": d, "steps": c} for (T, d), c in arms]
        out[m.name] = e
    for e in out.values():
        e["speedup"] = e["tokens_per_s"] / out["vanilla"]["tokens_per_s"] if out["vanilla"]["tokens_per_s"] else None
    return out


def run(cfg: DictConfig, target, draft, eos_ids: list[int], prompts: list[Prompt], policies: dict) -> dict:
    """``metrics["batched"]``: ``{"sizes": [...], "by_size": {"4": {method: {...}}}, "failures": [...]}``."""
    sizes = [int(b) for b in cfg.bench.batch_sizes]
    mode = str(cfg.bench.get("batch_mode", "static"))
    if mode not in ("continuous", "static"):
        raise ValueError(f"bench.batch_mode={mode!r}: use static (full batches) or continuous (queues through b slots)")
    methods, skipped = build(cfg, target, draft, eos_ids, policies)
    by_size, failures = {}, []
    for b in sizes:
        if mode == "continuous":  # every prompt once (wrapping around only to fill the slots), in queues of
            rows = [prompts[i % len(prompts)].ids for i in range(max(len(prompts), b))]  # QUEUE_ROUNDS * b
            q = QUEUE_ROUNDS * b
            groups = [rows[i: i + q] for i in range(0, len(rows), q)]
        else:
            groups = batches(prompts, b)
        log.info("batch %d (%s): %d prompts of %d-%d tokens", b, mode, sum(map(len, groups)),
                 min(len(r) for g in groups for r in g), max(len(r) for g in groups for r in g))
        table = measure(methods, groups, int(cfg.bench.repeats), target.device, slots=b)
        by_size[str(b)] = table
        log.info("batch %d: %s", b, ", ".join(f"{n} {e['tokens_per_s']:.1f} tok/s ({e['speedup']:.2f}x)"
                                               for n, e in table.items()))
        for name, e in table.items():
            if e["family"] == "treedec" and not e["identical_to_vanilla"]:
                msg = f"{name} at batch {b}: {e['rows_differing']} row(s) differ from batched vanilla"
                if target.dtype == torch.float32:
                    failures.append(msg)
                else:
                    log.warning("%s (%s: a near-tie may round either way)", msg, target.dtype)
    return {"sizes": sizes, "mode": mode, "by_size": by_size, "skipped": skipped, "failures": failures}


def markdown(batched: dict) -> list[str]:
    """The results.md section: per method, tok/s, τ and × vanilla at each batch size."""
    sizes = [str(b) for b in batched["sizes"]]
    names = list(dict.fromkeys(n for s in sizes for n in batched["by_size"][s]))
    head = " | ".join(f"b={s} tok/s | τ | ×" for s in sizes)
    how = {"continuous": "continuous batching: the prompts queue for b slots, a finished row's slot takes the next "
                          "one (hf_greedy: static batches of b)",
           "static": "static batches of b prompts"}.get(batched.get("mode", "static"), "")
    lines = ["", f"Throughput by batch size ({how}; total new tokens / wall time, ragged prompts; × = vs vanilla at "
                 "the same batch size; τ = tokens per row per decoding pass):", "",
             f"| method | {head} |", "|---|" + "---:|---:|---:|" * len(sizes)]
    for n in names:
        cells = []
        for s in sizes:
            e = batched["by_size"][s].get(n)
            cells += (["–"] * 3 if e is None else
                      [f"{e['tokens_per_s']:.1f}", f"{e['tau']:.2f}",
                       f"{e['speedup']:.2f}" + ("" if e["identical_to_vanilla"] or e["family"] == "peer" else "≠")])
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    auto = [(s, n, e["auto_arms"]) for s in sizes for n, e in batched["by_size"][s].items() if e.get("auto_arms")]
    if auto:
        lines += ["", "tree=auto, most chosen (T, depth) per batch size: " + "; ".join(
            f"{n} b={s}: " + ", ".join(f"({a['total_tokens']}, {a['depth']})×{a['steps']}" for a in arms)
            for s, n, arms in auto)]
    if batched.get("failures"):
        lines += ["", "**BATCHED FAILURES**:", *[f"- {f}" for f in batched["failures"]]]
    return lines


def plot(batched: dict, out_dir: str | Path, plt) -> Path:
    """batch_throughput.png: total tok/s (left) and × vanilla (right) against the batch size, one line per method."""
    sizes = batched["sizes"]
    names = list(dict.fromkeys(n for s in sizes for n in batched["by_size"][str(s)]))
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.6))
    for n in names:
        pts = [(s, batched["by_size"][str(s)][n]) for s in sizes if n in batched["by_size"][str(s)]]
        style = "--" if pts and pts[0][1]["family"] == "peer" else "-"
        for ax, key in zip(axes, ("tokens_per_s", "speedup")):
            ax.plot([s for s, _ in pts], [e[key] for _, e in pts], "o" + style, label=n)
    axes[0].set_ylabel("tokens / s (all rows)")
    axes[1].set_ylabel("× vanilla (same batch size)")
    axes[1].axhline(1.0, color="gray", lw=0.8, ls=":")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("batch size (rows)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(out_dir) / "batch_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["BatchMethod", "BatchRun", "batches", "build", "markdown", "measure", "plot", "run"]
