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
"""
from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("treedec.bench")



class OutputMismatch(RuntimeError):
    """A greedy method's tokens differ from vanilla's; ``metrics`` holds the full report (already written)."""

    def __init__(self, message: str, metrics: dict):
        super().__init__(message)
        self.metrics = metrics


# --------------------------------------------------------------------------- prompts
@dataclass
class Prompt:
    id: str
    text: str
    ids: list[int]
    source: dict | None = None  # where the text came from (file and line; third_party: the package too)


def prompt_source_name(bench: DictConfig) -> str:
    """How metrics.json names a generated prompt set: ``heldout_stdlib`` or ``third_party``."""
    source = str(bench.get("prompt_source", "third_party"))
    return "heldout_stdlib" if source == "stdlib" else source


def load_prompts(bench: DictConfig, tokenizer) -> list[Prompt]:
    """The prompt set: ``bench.prompts`` (a file) or ``bench.n_prompts`` prompts of ``bench.prompt_source``."""
    from treedec.data.prompts import load_prompt_set, read_prompt_file

    if bench.prompts:
        texts = read_prompt_file(bench.prompts, "bench.prompts")
    else:
        packages = bench.get("third_party_packages")
        texts = load_prompt_set(str(bench.get("prompt_source", "third_party")), int(bench.n_prompts),
                                int(bench.prompt_tokens), tokenizer, seed=int(bench.seed),
                                packages=list(packages) if packages is not None else None,
                                hint="pass bench.prompts=<file.jsonl>")
    prompts = []
    for t in texts:
        if bench.get("chat"):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": t.text}], tokenize=True)
        else:
            ids = tokenizer.encode(t.text)
        if not ids:
            where = f" ({t.source['file']}:{t.source['line']})" if t.source else ""
            raise ValueError(f"prompt {t.id!r}{where} encodes to no tokens; give it some text")
        prompts.append(Prompt(t.id, t.text, list(ids), t.source))
    return prompts


# --------------------------------------------------------------------------- methods
@dataclass
class RunOutput:
    """One method on one prompt."""

    tokens: list[int]
    passes: int  # target forward passes after the prefill (verification steps)
    produced: int  # tokens those passes emitted, after the max_new_tokens/EOS cut (τ = produced / passes)
    forwards: int  # every target forward, prefill included
    split: dict[str, float] = field(default_factory=dict)  # seconds, by phase (the method's own clocks)
    accepted: Counter = field(default_factory=Counter)  # accepted drafts per step -> steps (speculative)
    tree_nodes: int = 0  # tree nodes verified, summed over passes (speculative; mean tree size = / passes)


@dataclass
class Method:
    name: str
    family: str  # "treedec" | "peer"
    greedy: bool
    fn: Callable[[Prompt, int], RunOutput]  # (prompt, seed) -> output
    info: dict = field(default_factory=dict)
    reference: str = "vanilla"  # the method its speedup (and, when greedy, its tokens) are measured against
    ops_fn: Callable[[Prompt, int], dict] | None = None  # (prompt, seed) -> op counts per step (treedec methods)
    compiled: bool = False  # torch.compile'd: the first warm-up run pays the compilation (compile_s)
    lossless: bool | None = None  # a token mismatch with `reference` fails the run (default: treedec methods)

    def __post_init__(self):
        if self.lossless is None:
            self.lossless = self.family == "treedec"

    def __call__(self, prompt: Prompt, seed: int) -> RunOutput:
        return self.fn(prompt, seed)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def run_output(res) -> RunOutput:
    """A treedec GenerateResult (one row) as a RunOutput: τ counts only the tokens actually emitted."""
    st = res.stats
    split = {k: v for k, v in st.as_dict()["time_split"].items() if k != "total"}
    return RunOutput(res.tokens[0], st.row_steps, st.step_tokens, st.target_passes + st.prefills, split,
                     Counter(st.accepted), st.tree_nodes)


def measure_ops(call: Callable[..., object]) -> dict:
    """Aten ops and host reads of one ``call(hook=...)`` (a ``generate``) inside :func:`count_ops`.

    Per step counts the steady state: from the end of the first decoding step to the end of the
    last, divided by the steps between (the prefill, the first step and the end-of-run read are in
    the totals only). With a single step it is the whole call.
    """
    from treedec.profiling import count_ops

    marks: list[tuple[int, int]] = []
    with count_ops() as c:
        res = call(hook=lambda _info: marks.append((c.aten_ops, c.host_reads)))
        total = (c.aten_ops, c.host_reads)
    steps = res.stats.target_passes
    if len(marks) >= 2:
        n = len(marks) - 1
        per = ((marks[-1][0] - marks[0][0]) / n, (marks[-1][1] - marks[0][1]) / n)
    else:
        n = max(steps, 1)
        per = (total[0] / n, total[1] / n)
    return {"aten_ops_per_step": per[0], "host_reads_per_step": per[1], "steps": steps, "steps_averaged": n,
            "aten_ops_total": total[0], "host_reads_total": total[1], "reads_total": dict(c.reads),
            "top_ops_total": dict(c.ops.most_common(8))}


def sampled_name(base: str, temperature: float) -> str:
    """The unique name of a sampled row: ``chain_sample@0.8`` (metrics.json shows ``chain_sample`` under 0.8)."""
    return f"{base}@{temperature:g}"


def temperature_key(temperature: float) -> str:
    """How metrics.json's ``sampled`` section names a temperature group: ``"0.8"``."""
    return f"{temperature:g}"


def _reference(sampling) -> str:
    return "vanilla" if sampling.greedy else sampled_name("vanilla_sample", sampling.temperature)


def vanilla_method(name: str, target, max_new_tokens: int, sampling, eos_ids, compile: bool = False,
                   reference: str | None = None) -> Method:
    from treedec.decoding import vanilla

    # Compiled: one decoder for every call, so its context-sized cache (and, on CUDA, the graphs' static
    # addresses) is reused; eager: vanilla.generate, a new cache per call like the speculative decoder's.
    dec = vanilla.VanillaDecoder(target, sampling, eos_ids, compile=True) if compile else None

    def call(p: Prompt, seed: int, **kw):
        gen = None if sampling.greedy else _generator(target.device, seed)
        if dec is not None:
            return dec.generate(p.ids, max_new_tokens, generator=gen, **kw)
        return vanilla.generate(target, p.ids, max_new_tokens, sampling=sampling, eos_ids=eos_ids, generator=gen, **kw)

    ref = reference or _reference(sampling)
    return Method(name, "treedec", sampling.greedy, lambda p, seed: run_output(call(p, seed, timing=True)),
                  {"policy": None, "sampling": _sampling_dict(sampling), "compile": compile}, reference=ref,
                  ops_fn=lambda p, seed: measure_ops(lambda **kw: call(p, seed, **kw)), compiled=compile)


def speculative_method(name: str, target, draft, policy, max_new_tokens: int, sampling, eos_ids,
                       compile: bool = False, reference: str | None = None) -> Method:
    from treedec.decoding.speculative import SpeculativeDecoder

    dec = SpeculativeDecoder(target, draft, policy, sampling, eos_ids=eos_ids, compile=compile)

    def call(p: Prompt, seed: int, **kw):
        gen = None if sampling.greedy else _generator(target.device, seed)
        return dec.generate(p.ids, max_new_tokens, generator=gen, **kw)

    info = {"policy": type(policy).__name__, "tree_size": policy.max_size, "tree_depth": policy.max_depth,
            "sampling": _sampling_dict(sampling), "compile": compile}
    ref = reference or _reference(sampling)
    return Method(name, "treedec", sampling.greedy, lambda p, seed: run_output(call(p, seed, timing=True)), info,
                  reference=ref, ops_fn=lambda p, seed: measure_ops(lambda **kw: call(p, seed, **kw)),
                  compiled=compile)


def _sampling_dict(s) -> dict:
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}


def sample_settings(cfg: DictConfig) -> list:
    """The SamplingParams of the sampled rows: one per ``bench.sample_temperatures`` (null: the group's own
    temperature), with the ``sampling`` group's top-k and top-p; empty when ``bench.sampling`` is false."""
    from dataclasses import replace

    from treedec.config_schema import instantiate_checked

    if not cfg.bench.sampling:
        return []
    base = instantiate_checked(cfg.sampling, "sampling")
    temps = cfg.bench.get("sample_temperatures")
    if temps is None:
        if base.greedy:
            log.warning("bench.sampling=true, bench.sample_temperatures=null and the sampling group is greedy "
                        "(temperature 0): no sampled rows; pick sampling=sample or list temperatures")
            return []
        return [base]
    return [replace(base, temperature=float(t)) for t in temps]


SWEEP_BASE = "dynamic_auto"  # bench.dynamic_sweep's fixed budgets use this method's tree, so auto is on the same curve


def sweep_name(n: int) -> str:
    return f"dynamic_T{int(n)}"


def method_names(bench: DictConfig) -> list[str]:
    """``bench.methods`` without repeats, vanilla first (every speedup and identity check is measured against it),
    then ``dynamic_T<n>`` for each size of ``bench.dynamic_sweep``."""
    names = list(dict.fromkeys(bench.methods))
    if "vanilla" not in names:
        log.info("adding `vanilla` to bench.methods: every speedup and identity check is measured against it")
        names.insert(0, "vanilla")
    sweep = [sweep_name(n) for n in (bench.get("dynamic_sweep") or [])]
    return names + [n for n in dict.fromkeys(sweep) if n not in names]


def tree_config(bench: DictConfig, name: str):
    """The tree config of method ``name``: ``bench.trees[name]``, or for ``dynamic_T<n>`` the sweep base at T=n."""
    from treedec.config_schema import ConfigError

    if name.startswith("dynamic_T") and name[len("dynamic_T"):].isdigit() and name not in bench.trees:
        if SWEEP_BASE not in bench.trees:
            raise ConfigError(f"bench.dynamic_sweep needs bench.trees.{SWEEP_BASE} (the tree the sweep varies T of)")
        node = OmegaConf.merge(bench.trees[SWEEP_BASE], {"total_tokens": int(name[len("dynamic_T"):])})
        return node
    if name not in bench.trees:
        raise ConfigError(f"bench.methods names {name!r}, which has no tree config under bench.trees "
                          f"(have: vanilla, {', '.join(bench.trees)}); add bench.trees.{name} with a _target_")
    return bench.trees[name]


def resolve_auto(cfg: DictConfig) -> dict[str, str]:
    """Replace ``bench.learned_path`` / ``bench.assistant_path`` = auto by what they mean here (bundled.py).

    The config then records the file and model actually used; returns the reason for each, for the
    log and for ``skipped`` when one resolves to null (a second call finds them resolved: keep the
    first call's reasons).
    """
    from treedec.bench import bundled

    bench = cfg.bench
    learned, why_learned = bundled.learned_path(bench.get("learned_path"), OmegaConf.select(cfg, "draft.path"))
    assistant, why_assistant = bundled.assistant_path(bench.get("assistant_path"), OmegaConf.select(cfg, "model.path"))
    bench.learned_path, bench.assistant_path = learned, assistant
    return {"learned": why_learned, "hf_assisted": why_assistant}


def build_policies(cfg: DictConfig) -> dict:
    """The tree policy of every speculative method that will run (no model needed: errors come before loading)."""
    from treedec.config_schema import instantiate_checked

    resolve_auto(cfg)
    bench = cfg.bench
    out = {}
    for name in method_names(bench):
        if name == "vanilla" or (name == "learned" and not bench.learned_path):
            continue
        out[name] = instantiate_checked(tree_config(bench, name), f"bench.trees.{name}")
    return out


def build_methods(cfg: DictConfig, target, draft, eos_ids, policies: dict | None = None,
                  why: dict[str, str] | None = None) -> tuple[list[Method], dict[str, str]]:
    """treedec's methods from ``bench.methods`` (and their sampled variants); returns (methods, skipped)."""
    from treedec.config_schema import instantiate_checked
    from treedec.decoding.sampling import SamplingParams

    why = {**resolve_auto(cfg), **(why or {})}  # the reasons of the first resolution, when given
    bench = cfg.bench
    n = int(bench.max_new_tokens)
    greedy = SamplingParams()
    names = method_names(bench)
    policies = build_policies(cfg) if policies is None else policies
    compiled = bool(bench.get("compile"))
    settings = sample_settings(cfg)
    methods, skipped = [], {}
    for name in names:
        if name == "vanilla":
            methods.append(vanilla_method("vanilla", target, n, greedy, eos_ids))
            if compiled:
                # Eager and compiled kernels round differently: in fp32 a difference is a bug, in bf16 it is reported.
                methods.append(vanilla_method("vanilla_compile", target, n, greedy, eos_ids, compile=True))
                methods[-1].lossless = target.dtype == torch.float32
            for s in settings:
                methods.append(vanilla_method(sampled_name("vanilla_sample", s.temperature), target, n, s, eos_ids))
            continue
        if name == "learned" and not bench.learned_path:
            skipped[name] = why["learned"]
            log.info("skipping `learned`: %s", skipped[name])
            continue
        if name == "learned":
            log.info("`learned`: %s", why["learned"])
        methods.append(speculative_method(name, target, draft, policies[name], n, greedy, eos_ids))
        if compiled:  # its own policy object: a compiled decoder may pad or precompute per policy
            methods.append(speculative_method(f"{name}_compile", target, draft,
                                              instantiate_checked(tree_config(bench, name), f"bench.trees.{name}"), n,
                                              greedy, eos_ids, compile=True, reference="vanilla_compile"))
        for s in settings:  # its own policy object per row, as for the compiled variants
            methods.append(speculative_method(sampled_name(f"{name}_sample", s.temperature), target, draft,
                                              instantiate_checked(tree_config(bench, name), f"bench.trees.{name}"), n,
                                              s, eos_ids))
    return methods, skipped


# --------------------------------------------------------------------------- machine
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return sorted(have & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"})
    except OSError:
        pass
    return []


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(target) -> dict:
    dev = target.device
    info = {
        "cpu": _cpu_model(), "cpu_flags": _cpu_flags(), "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "device": str(dev), "dtype": str(target.dtype).removeprefix("torch."),
        "attn_backend": target.backend(),
        "git_commit": _git_commit(),
    }
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["cuda"] = torch.version.cuda
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    return info


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
    return out, time.perf_counter() - t0


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
                why = "a peer" if m.family == "peer" else "compiled kernels round differently from eager ones"
                log.warning("%s (%s: numerics may differ, e.g. in bf16)", msg, why)
    return out, failures


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
    from treedec.bench import peers as peer_mod
    from treedec.bench import report
    from treedec.cli import load_stack, write_text_atomic
    from treedec.config_schema import validate

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
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    target, tok, draft = load_stack(cfg)  # the first thing that takes time: every option is checked by now
    eos_ids = list(tok.eos_ids) or list(target.config.eos_ids)
    prompts = load_prompts(bench, tok)
    log.info("%d prompts (%d-%d tokens), max_new_tokens=%d, %d threads, %s %s on %s", len(prompts),
             min(len(p.ids) for p in prompts), max(len(p.ids) for p in prompts), int(bench.max_new_tokens),
             torch.get_num_threads(), str(target.dtype).removeprefix("torch."), cfg.model.attn_backend, target.device)
    methods, skipped = build_methods(cfg, target, draft, eos_ids, policies, why)
    peer_methods, peer_skipped = peer_mod.build_peers(cfg, target, eos_ids, why["hf_assisted"])
    methods += peer_methods
    skipped.update(peer_skipped)

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
    for name, pol in policies.items():  # the auto budget's choices over the whole run, most frequent first
        if getattr(pol, "budget", None) is not None and name in table:
            arms = Counter(pol.budget.history).most_common(6)
            table[name]["auto_arms"] = [{"total_tokens": T, "depth": d, "steps": k} for (T, d), k in arms]
    greedy_rows, sampled_rows = group_sampled(table, methods)
    machine = machine_info(target)
    try:
        machine["loadavg_start"], machine["loadavg_end"] = load_start, list(os.getloadavg())
    except OSError:
        pass
    sweep = [sweep_name(n) for n in (bench.get("dynamic_sweep") or []) if sweep_name(n) in greedy_rows]
    metrics = {
        "methods": greedy_rows,
        **({"dynamic_sweep": {"methods": sweep, "auto": SWEEP_BASE if SWEEP_BASE in greedy_rows else None}}
           if sweep else {}),
        **({"sampled": sampled_rows} if sampled_rows else {}),
        "machine": machine,
        "prompts": {"n": len(prompts), "source": str(bench.prompts) if bench.prompts else prompt_source_name(bench),
                    "ids": [p.id for p in prompts], "prompt_tokens": [len(p.ids) for p in prompts],
                    "sources": {p.id: p.source for p in prompts if p.source}},
        "skipped": skipped,
        "failures": failures,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    if bench.get("batch_sizes"):  # issue 17 hook: throughput at several batch sizes (treedec/bench/batched.py)
        from treedec.bench import batched
        metrics["batched"] = batched.run(cfg, target, draft, eos_ids, prompts, policies)
        failures += metrics["batched"]["failures"]  # end of the issue 17 hook
    write_text_atomic(run_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    write_text_atomic(run_dir / "outputs.jsonl", "".join(
        json.dumps({"method": m.name.rsplit("@", 1)[0], "prompt": p.id,
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


__all__ = ["Method", "OutputMismatch", "Prompt", "RunOutput", "build_methods", "build_policies", "count_method_ops",
           "first_difference", "group_sampled", "load_prompts", "machine_info", "measure_ops", "method_names",
           "resolve_auto", "run", "sample_settings", "sampled_name", "summarize", "sweep_name", "temperature_key",
           "time_methods", "tree_config"]
