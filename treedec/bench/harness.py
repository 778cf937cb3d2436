"""The end-to-end benchmark: treedec's methods and its peers, side by side in one process.

Every method decodes every prompt (batch 1) from the same token ids with the same EOS ids.
After ``warmup`` untimed runs of each method on the first prompt, ``repeats`` timed passes
go over all prompts; within a pass the methods take turns on each prompt (the order rotates
from prompt to prompt and pass to pass), so that background load and thermal drift hit every
method alike. A method's figure for one pass is its total new tokens over its total wall
time (prefill included, measured here around the call, with a CUDA sync on a GPU); the
reported ``tokens_per_s`` is the median over passes and ``speedup`` is its ratio to
treedec's vanilla decoding measured in the same passes.

Greedy methods must reproduce vanilla's tokens exactly (treedec's speculative methods by
construction, design §7). A treedec method that does not is an error: :func:`run` writes
everything, then raises :class:`OutputMismatch` (the CLI exits 1). A peer that differs is
reported as such (in bf16, transformers rounds differently, so its greedy path may part from
ours after a while) and fails the run only with ``bench.strict_peers=true``.

Untimed, after the warm-up, each treedec method decodes the first prompt once more inside
:func:`treedec.profiling.count_ops`, which gives its aten ops and host reads per decoding step
(a dispatch mode slows a run down, so it never touches the timed passes). With
``bench.compile=true`` every tree method and vanilla also run compiled (``NAME_compile``); the
first warm-up run (on the longest prompt, so that its cache bucket serves every prompt) pays the
compilation and is reported as ``compile_s``, apart from tokens/s.

With ``bench.sampling=true`` every treedec method (and the ``hf_sample`` peer) also runs sampled at
each of ``bench.sample_temperatures`` (top-k/top-p from the ``sampling`` group), as ``NAME_sample@T``;
each prompt's generator is seeded with ``bench.seed + i``. Speedups are against ``vanilla_sample@T``
(the same temperature), outputs are not compared (they are random), and metrics.json groups these
rows by temperature under ``sampled`` (:func:`group_sampled`).

The pieces: bench/methods.py (the prompt set, :class:`Method`, :class:`RunOutput`, building treedec's methods;
below this module and peers.py), bench/timing.py (the timing loop and op counts), bench/machine.py (what
metrics.json records of the machine); here: the run, the summary table and the greedy-output checks.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
from collections import Counter
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from treedec.atomic import write_text_atomic
from treedec.bench import batched, report
from treedec.bench import peers as peer_mod
from treedec.bench.heads import check_compared, head_configs, head_info, head_name, load_heads, rejects
from treedec.bench.machine import machine_info
from treedec.bench.methods import (
    SWEEP_STAR,
    Method,
    Prompt,
    RunOutput,
    build_methods,
    build_policies,
    load_prompts,
    method_names,
    prompt_source_name,
    resolve_auto,
    sweep_methods,
    temperature_key,
)
from treedec.bench.timing import time_methods
from treedec.bench.vllm_peers import build_vllm_peers
from treedec.cli import load_stack
from treedec.config import validate

log = logging.getLogger("treedec.bench")


class OutputMismatch(RuntimeError):
    """A greedy method's tokens differ from vanilla's; ``metrics`` holds the full report (already written)."""

    def __init__(self, message: str, metrics: dict):
        super().__init__(message)
        self.metrics = metrics


def first_difference(ref: list[int], got: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None when identical."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


def summarize(methods: list[Method], prompts: list[Prompt], timing: dict[str, dict]) -> tuple[dict, list[str]]:
    """The ``methods`` section of metrics.json and the list of failures (treedec greedy mismatches)."""
    out, failures = {}, []
    for m in methods:
        d = timing[m.name]
        tps = [n / t if t > 0 else 0.0 for n, t in zip(d["tokens"], d["times"])]
        med = statistics.median(tps)
        mid = sorted(range(len(tps)), key=lambda j: tps[j])[len(tps) // 2]  # the median pass (upper on ties)
        outs: list[RunOutput] = d["outputs"]
        passes, produced = sum(o.passes for o in outs), sum(o.produced for o in outs)
        entry = {
            "family": m.family, "greedy": m.greedy,
            "tokens_per_s": med, "tau": produced / passes if passes else 1.0, "speedup": None,
            "speedup_over_tau": None, "identical_to_vanilla": None,
            "new_tokens": sum(len(o.tokens) for o in outs),
            "target_forwards": sum(o.forwards for o in outs),
            "time_s": d["times"][mid],
            "time_split": {**{k: v for k, v in d["splits"][mid].items() if v}, "total": d["times"][mid]},
            "tokens_per_s_passes": tps,
            "warmup_s": d.get("warmup_s", []),
            **m.info,
        }
        if m.compiled:  # paid by the first warm-up run, never part of tokens_per_s
            entry["compile_s"] = d.get("compile_s")
            entry["graphs_compiled_in_timed_runs"] = d.get("graphs_in_timed", 0)
        ops = d.get("ops")
        if ops is not None:
            entry["aten_ops_per_step"] = ops.get("aten_ops_per_step")
            entry["host_reads_per_step"] = ops.get("host_reads_per_step")
            entry["op_counts"] = ops
        # The accept phase's share of wall time (vanilla: its pick of the next token); a peer's loop has no clocks.
        total = entry["time_split"]["total"]
        entry["accept_share"] = (entry["time_split"].get("accept", 0.0) / total
                                 if m.family == "treedec" and total > 0 else None)
        acc = sum((o.accepted for o in outs), Counter())
        if acc:
            entry["accepted_hist"] = {int(k): v for k, v in sorted(acc.items())}
            steps = sum(o.passes for o in outs)
            entry["mean_tree_size"] = sum(o.tree_nodes for o in outs) / steps if steps else None
            hits, trials = sum((o.depth_hits for o in outs), Counter()), sum((o.depth_trials for o in outs), Counter())
            entry["accept_by_depth"] = {int(k): hits[k] / trials[k] for k in sorted(trials) if trials[k]}
        if m.family == "treedec" and total > 0:
            entry["step_split"] = step_split(entry["time_split"])
        out[m.name] = entry
    for m in methods:
        e, ref = out[m.name], out.get(m.reference)
        if ref is not None and ref["tokens_per_s"] > 0:
            e["speedup"] = e["tokens_per_s"] / ref["tokens_per_s"]
            e["speedup_over_tau"] = e["speedup"] / e["tau"] if e["tau"] else None
        if not m.greedy or m.name == "vanilla" or m.reference not in timing:
            if m.name == "vanilla":
                e["identical_to_vanilla"] = True
            continue
        if m.reference != "vanilla":  # e.g. a compiled tree method against compiled vanilla (same kernels)
            e["checked_against"] = m.reference
        diffs = []
        for i, (p, a, b) in enumerate(zip(prompts, timing[m.reference]["outputs"], timing[m.name]["outputs"])):
            pos = first_difference(a.tokens, b.tokens)
            if pos is not None:
                diffs.append({"prompt": p.id, "prompt_index": i, "position": pos,
                              "vanilla": a.tokens[pos] if pos < len(a.tokens) else None,
                              "got": b.tokens[pos] if pos < len(b.tokens) else None,
                              "agreeing_prefix": pos})
        e["identical_to_vanilla"] = not diffs
        if diffs:
            e["mismatches"] = diffs
            first = diffs[0]
            ref = m.reference
            msg = (f"{m.name}: greedy output differs from {ref} on {len(diffs)}/{len(prompts)} prompt(s); first at "
                   f"prompt {first['prompt']!r}, token {first['position']} ({ref} {first['vanilla']}, "
                   f"{m.name} {first['got']})")
            if m.lossless:
                e["failure_message"], e["lossless_check"] = msg, True
                failures.append(msg)
            else:
                e["failure_message"] = msg
                why = ("a peer" if m.family == "peer" else "another dtype rounds differently" if "dtype" in m.info
                       else "compiled kernels round differently from eager ones")
                log.warning("%s (%s: numerics may differ, e.g. in bf16)", msg, why)
    return out, failures


STEP_PHASES = ("draft", "verify", "accept", "commit", "other")


def step_split(time_split: dict) -> dict[str, float]:
    """The decode time's split (wall time less the prefill) as shares, by phase: where a decoding step's time goes.
    ``other`` is the rest of that wall time (the decoder's own other plus the call around it, which grows with the
    machine's load), so the shares sum to 1."""
    decode = time_split.get("total", 0.0) - time_split.get("prefill", 0.0)
    if decode <= 0:
        return {}
    named = {p: time_split.get(p, 0.0) for p in STEP_PHASES if p != "other"}
    return {**{p: v / decode for p, v in named.items()}, "other": max(decode - sum(named.values()), 0.0) / decode}


@torch.inference_mode()
def logit_gap(target, ids: list[int]) -> tuple[float | None, float | None]:
    """(top-1 minus top-2 target logit, one rounding unit of the model dtype at the top-1 logit) after ``ids``.

    A gap within the dtype's rounding unit (bf16: 2^-7 relative, i.e. 0.06 at logit 8-16) is a
    numerical tie that a tree pass and a one-token pass (different matmul shapes) may round either
    way; a larger gap points at a real bug.
    """
    try:
        cache = target.new_cache(1, len(ids))
        logits = target(torch.tensor([ids], device=target.device), cache, logits="last").logits[0, -1].float()
        top = logits.topk(2).values
        ulp = torch.finfo(target.dtype).eps * max(abs(float(top[0])), 1.0)
        return float(top[0] - top[1]), ulp
    except Exception as exc:  # a diagnostic must never hide the mismatch itself
        log.warning("could not compute the logit gap at the mismatch: %s", exc)
        return None, None


def classify_mismatches(table: dict, tie_ulps: float) -> list[str]:
    """Failures among treedec greedy mismatches: any whose logit gap exceeds ``tie_ulps`` rounding units.

    Mismatches at numerical ties are kept in metrics.json (``identical_to_vanilla`` stays false,
    ``tie_flips`` counts them) and logged as warnings; everything else is a lossless violation.
    Entries that cannot fail (peers, compiled vanilla outside fp32) get ``tie_flips`` too, for the report.
    """
    failures = []
    for name, e in table.items():
        if not e.get("mismatches"):
            continue
        ties = [d for d in e["mismatches"] if d.get("logit_gap") is not None and d["logit_gap"] <= tie_ulps * d["ulp"]]
        e["tie_flips"] = len(ties)
        if not e.get("lossless_check"):
            continue
        if len(ties) == len(e["mismatches"]):
            log.warning("%s: %d mismatch(es) at numerical ties (logit gap within %g rounding unit(s) of %s): %s",
                        name, len(ties), tie_ulps, "the model dtype", e["failure_message"])
        else:
            log.error("LOSSLESS VIOLATION: %s", e["failure_message"])
            failures.append(e["failure_message"])
    return failures


def group_sampled(table: dict, methods: list[Method]) -> tuple[dict, dict]:
    """Split the summary into (greedy rows, sampled rows by temperature).

    The second is ``{"0.8": {"temperature", "top_k", "top_p", "reference", "methods": {"vanilla_sample": ...}}}``,
    rows named without their ``@T`` suffix, in run order.
    """
    greedy, sampled = {}, {}
    for m in methods:
        s = m.info.get("sampling") or {}
        if m.greedy or not s:
            greedy[m.name] = table[m.name]
            continue
        group = sampled.setdefault(temperature_key(s["temperature"]), {**s, "reference": "vanilla_sample",
                                                                       "methods": {}})
        group["methods"][m.name.rsplit("@", 1)[0]] = table[m.name]
    return greedy, sampled


# --------------------------------------------------------------------------- entry
def run(cfg: DictConfig) -> dict:
    """Run the benchmark described by a composed ``bench`` config; write metrics.json, results.md, plots."""
    validate(cfg, "bench")
    bench = cfg.bench
    why = resolve_auto(cfg)  # bench.learned_path / assistant_path = auto -> what they mean here
    policies = build_policies(cfg)
    try:
        load_start = list(os.getloadavg())
    except OSError:
        load_start = None
    if bench.num_threads:
        torch.set_num_threads(int(bench.num_threads))
    torch.manual_seed(int(bench.seed))

    nodes = head_configs(cfg)  # bench.draft_heads: every method with every head (null: the draft group's head)
    # load_stack loads the first head as the draft group's (the others load beside it): the first thing that takes
    # time, every option is checked by now
    first = {"draft": OmegaConf.to_container(next(iter(nodes.values())))} if nodes else {}
    target, tok, draft = load_stack(OmegaConf.merge(cfg, first) if nodes else cfg)
    heads = load_heads(cfg, target, draft)
    eos_ids = list(tok.eos_ids) or list(target.config.eos_ids)
    prompts = load_prompts(bench, tok)
    log.info("%d prompts (%d-%d tokens), max_new_tokens=%d, %d threads, %s %s on %s", len(prompts),
             min(len(p.ids) for p in prompts), max(len(p.ids) for p in prompts), int(bench.max_new_tokens),
             torch.get_num_threads(), str(target.dtype).removeprefix("torch."), cfg.model.attn_backend, target.device)
    methods, skipped = build_methods(cfg, target, draft, eos_ids, policies, why, heads,
                                     {short: node.path for short, node in nodes.items()} if nodes else None)
    check_compared(cfg, method_names(bench), methods, skipped, heads or {OmegaConf.select(cfg, "draft.path"): draft})
    run_dir = Path(cfg.paths.run_dir)  # made once the config is known to run, before the timing
    run_dir.mkdir(parents=True, exist_ok=True)
    peer_methods, peer_skipped = peer_mod.build_peers(cfg, target, eos_ids, why["hf_assisted"])
    head_paths = {short: str(node.path) for short, node in nodes.items()} if nodes else \
        {"draft": str(OmegaConf.select(cfg, "draft.path"))}
    vllm_methods, vllm_skipped = build_vllm_peers(cfg, target, head_paths, eos_ids, prompts, run_dir)
    methods += peer_methods + vllm_methods
    skipped.update(peer_skipped)
    skipped.update(vllm_skipped)

    timing = time_methods(methods, prompts, int(bench.repeats), int(bench.warmup), int(bench.seed), target.device)
    table, _ = summarize(methods, prompts, timing)
    methods_by_name = {m.name: m for m in methods}
    for name, e in table.items():
        for d in e.get("mismatches", []):
            i = d["prompt_index"]
            van = timing[methods_by_name[name].reference]["outputs"][i].tokens
            d["logit_gap"], d["ulp"] = logit_gap(target, prompts[i].ids + van[: d["position"]])
    failures = classify_mismatches(table, float(bench.tie_ulps))
    if bench.strict_peers:
        failures += [e["failure_message"] for e in table.values() if e.get("failure_message") and not e.get("lossless_check")]
    for m in methods:  # tree=auto's choices over the whole run, most frequent first
        pol, name = m.policy, m.name
        if getattr(pol, "history", None) and name in table:
            arms = Counter(pol.history).most_common(6)
            table[name]["auto_arms"] = [{"total_tokens": T, "depth": d, "steps": k} for (T, d), k in arms]
        if getattr(pol, "steps", 0) and hasattr(pol, "skipped_steps") and name in table:  # prompt lookup
            table[name]["copy_alone_share"] = pol.skipped_steps / pol.steps  # steps that ran no draft-head pass
    greedy_rows, sampled_rows = group_sampled(table, methods)
    machine = machine_info(target, draft)
    try:
        machine["loadavg_start"], machine["loadavg_end"] = load_start, list(os.getloadavg())
    except OSError:
        pass
    shorts = list(heads) if heads else [None]
    stars = [head_name(SWEEP_STAR, h) for h in shorts if head_name(SWEEP_STAR, h) in greedy_rows]
    sweeps = {opt: {"methods": run, "auto": stars}
              for opt, names in sweep_methods(bench).items()
              if (run := [head_name(n, h) for n in names for h in shorts if head_name(n, h) in greedy_rows])}
    metrics = {
        "methods": greedy_rows,
        **sweeps,  # dynamic_sweep / best_first_sweep: {"methods": the rows run, "auto": tree=auto's rows}
        **({"heads": head_info(heads, nodes)} if heads else {}),
        **({"sampled": sampled_rows} if sampled_rows else {}),
        "machine": machine,
        "prompts": {"n": len(prompts), "source": str(bench.prompts) if bench.prompts else prompt_source_name(bench),
                    "ids": [p.id for p in prompts], "prompt_tokens": [len(p.ids) for p in prompts],
                    "sources": {p.id: p.source for p in prompts if p.source}},
        "skipped": skipped,
        "failures": failures,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if bench.get("batch_sizes"):  # throughput at several batch sizes (treedec/bench/batched.py)
        usable = {n: p for n, p in policies.items() if not rejects(p, draft)}  # with the (first) head
        metrics["batched"] = batched.run(cfg, target, draft, eos_ids, prompts, usable)
        failures += metrics["batched"]["failures"]
    write_text_atomic(run_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    write_text_atomic(run_dir / "outputs.jsonl", "".join(
        json.dumps({"method": m.name if m.greedy else m.name.rsplit("@", 1)[0], "prompt": p.id,  # less its @T
                    **({} if m.greedy else {"temperature": m.info["sampling"]["temperature"]}),
                    "new_tokens": len(o.tokens), "tokens": o.tokens, "text": tok.decode(o.tokens)}) + "\n"
        for m in methods for p, o in zip(prompts, timing[m.name]["outputs"])))
    md = report.markdown(metrics)
    write_text_atomic(run_dir / "results.md", md)
    if bench.plots:
        report.plots(metrics, run_dir)
    print(md)
    log.info("wrote %s", run_dir / "metrics.json")
    if failures:
        raise OutputMismatch("; ".join(failures), metrics)
    return metrics
