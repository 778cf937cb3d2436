"""What every benchmark module shares: the prompt set, a method (a decoding call and its metadata) and
one run's output, and how treedec's methods are built from the config (below harness.py and peers.py)."""
from __future__ import annotations

import copy
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from treedec.bench.heads import head_name, rejects
from treedec.config import bundled, instantiate_checked
from treedec.data.chat import chat_prompt_ids
from treedec.data.prompts import load_prompt_set, read_prompt_file
from treedec.decoding import vanilla
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.errors import ConfigError
from treedec.profiling import count_ops
from treedec.sampling import SamplingParams

log = logging.getLogger("treedec.bench")


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
            ids = chat_prompt_ids(tokenizer, t.text, "pass bench.chat=false")
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
    depth_hits: Counter = field(default_factory=Counter)  # depth -> steps that accepted a node there (speculative)
    depth_trials: Counter = field(default_factory=Counter)  # depth -> steps whose path reached a parent with children
    seconds: float | None = None  # the run's own time (a peer timed in its own process); None: the bench's clock


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
    policy: object = None  # a speculative method's tree policy (tree=auto's arms, prompt lookup's share, after the run)

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
                     Counter(st.accepted), st.tree_nodes, Counter(st.depth_hits), Counter(st.depth_trials))


def measure_ops(call: Callable[..., object]) -> dict:
    """Aten ops and host reads of one ``call(hook=...)`` (a ``generate``) inside :func:`count_ops`.

    Per step counts the steady state: from the end of the first decoding step to the end of the
    last, divided by the steps between (the prefill, the first step and the end-of-run read are in
    the totals only). With a single step it is the whole call.
    """
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


def fp32_reference(bench: DictConfig, target) -> bool:
    """``bench.vanilla_fp32``: true, false or auto (on a CPU, when the target is not fp32 already)."""
    v = bench.get("vanilla_fp32", "auto")
    if str(v) == "auto":
        return target.device.type == "cpu" and target.dtype != torch.float32
    return bool(v)


def vanilla_fp32_method(target, max_new_tokens: int, sampling, eos_ids) -> Method:
    """Vanilla decoding of an fp32 copy of the target: the honest baseline on CPUs, where one-token steps run
    faster in fp32 than in bf16 (bf16 matmuls pay a fixed cost per call). Its tokens may differ from the
    bf16 model's (another dtype rounds differently), so it is reported, never a lossless check."""
    fp32 = copy.deepcopy(target).float()
    m = vanilla_method("vanilla_fp32", fp32, max_new_tokens, sampling, eos_ids)
    m.lossless, m.info["dtype"] = False, "float32"
    return m


def speculative_method(name: str, target, draft, policy, max_new_tokens: int, sampling, eos_ids,
                       compile: bool = False, reference: str | None = None, head: str | None = None) -> Method:
    dec = SpeculativeDecoder(target, draft, policy, sampling, eos_ids=eos_ids, compile=compile)

    def call(p: Prompt, seed: int, **kw):
        gen = None if sampling.greedy else _generator(target.device, seed)
        return dec.generate(p.ids, max_new_tokens, generator=gen, **kw)

    info = {"policy": type(policy).__name__, "tree_size": policy.max_size, "tree_depth": policy.max_depth,
            "sampling": _sampling_dict(sampling), "compile": compile}
    if head is not None:  # bench.draft_heads: which head this row drafts with
        info.update(head=head, head_kind=draft.config.kind)
    ref = reference or _reference(sampling)
    return Method(name, "treedec", sampling.greedy, lambda p, seed: run_output(call(p, seed, timing=True)), info,
                  reference=ref, ops_fn=lambda p, seed: measure_ops(lambda **kw: call(p, seed, **kw)),
                  compiled=compile, policy=policy)


def _sampling_dict(s) -> dict:
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}


def sample_settings(cfg: DictConfig) -> list:
    """The SamplingParams of the sampled rows: one per ``bench.sample_temperatures`` (null: the group's own
    temperature), with the ``sampling`` group's top-k and top-p; empty when ``bench.sampling`` is false."""
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


# bench.<option>: sizes T -> also <tree>_T<n>, bench.trees.<tree> at total_tokens=n (one implementation for both)
SWEEPS = {"dynamic_sweep": "dynamic",  # autoregressive heads (top_k: auto holds every T at its depth)
          "best_first_sweep": "best_first"}  # one-pass heads
SWEEP_STAR = "auto"  # the per-step-sized tree, drawn on the sweep's curves at its mean T


def sweep_name(n: int, base: str = "dynamic") -> str:
    return f"{base}_T{int(n)}"


def parse_sweep(name: str) -> tuple[str, int] | None:
    """``dynamic_T16`` -> ("dynamic", 16); None for a name no sweep makes."""
    base, sep, n = name.rpartition("_T")
    return (base, int(n)) if sep and base in SWEEPS.values() and n.isdigit() else None


def sweep_methods(bench: DictConfig) -> dict[str, list[str]]:
    """Per sweep option that is set, its method names: ``{"dynamic_sweep": ["dynamic_T8", ...]}``."""
    return {opt: list(dict.fromkeys(sweep_name(n, base) for n in bench.get(opt)))
            for opt, base in SWEEPS.items() if bench.get(opt)}


def method_names(bench: DictConfig) -> list[str]:
    """``bench.methods`` without repeats, vanilla first (every speedup and identity check is measured against it),
    then ``dynamic_T<n>`` / ``best_first_T<n>`` for each size of ``bench.dynamic_sweep`` / ``bench.best_first_sweep``."""
    names = list(dict.fromkeys(bench.methods))
    if "vanilla" not in names:
        log.info("adding `vanilla` to bench.methods: every speedup and identity check is measured against it")
        names.insert(0, "vanilla")
    sweep = [n for ns in sweep_methods(bench).values() for n in ns]
    return names + [n for n in dict.fromkeys(sweep) if n not in names]


def tree_config(bench: DictConfig, name: str):
    """The tree config of method ``name``: ``bench.trees[name]``, or for ``<tree>_T<n>`` (a sweep) that tree at T=n."""
    sweep = parse_sweep(name) if name not in bench.trees else None
    if sweep:
        base, n = sweep
        if base not in bench.trees:
            raise ConfigError(f"a {base}_T<n> sweep needs bench.trees.{base} (the tree the sweep varies T of)")
        return OmegaConf.merge(bench.trees[base], {"total_tokens": n})
    return bench.trees[name]  # (a name with no tree: refused by treedec.config.validate before anything runs)


def resolve_auto(cfg: DictConfig) -> dict[str, str]:
    """Replace ``bench.learned_path`` / ``bench.assistant_path`` = auto by what they mean here (bundled.py).

    The config then records the file and model actually used; returns the reason for each, for the
    log and for ``skipped`` when one resolves to null (a second call finds them resolved: keep the
    first call's reasons).
    """
    bench = cfg.bench
    learned, why_learned = bundled.learned_path(bench.get("learned_path"), OmegaConf.select(cfg, "draft.path"))
    assistant, why_assistant = bundled.assistant_path(bench.get("assistant_path"), OmegaConf.select(cfg, "model.path"))
    bench.learned_path, bench.assistant_path = learned, assistant
    return {"learned": why_learned, "hf_assisted": why_assistant}


def build_policies(cfg: DictConfig) -> dict:
    """The tree policy of every speculative method that will run (no model needed: errors come before loading)."""
    resolve_auto(cfg)
    bench = cfg.bench
    out = {}
    for name in method_names(bench):
        if name == "vanilla" or (name == "learned" and not bench.learned_path):
            continue
        out[name] = instantiate_checked(tree_config(bench, name), f"bench.trees.{name}")
    return out


def build_methods(cfg: DictConfig, target, draft, eos_ids, policies: dict | None = None,
                  why: dict[str, str] | None = None, heads: dict | None = None,
                  head_paths: dict | None = None) -> tuple[list[Method], dict[str, str]]:
    """treedec's methods from ``bench.methods`` (and their sampled variants); returns (methods, skipped).

    ``heads`` ({short name: head}, bench.draft_heads): every speculative method runs with every head as
    ``METHOD@HEAD``, the first head with ``policies``' own objects (batched.py shares them), the others with
    new ones; vanilla runs once. A (method, head) pair whose policy rejects the head (``check_head``) is skipped.
    ``head_paths`` ({short name: the head's path}): a tree that reads its head's files (``draft_path``: its
    calibration.yaml) reads each head's own, never the first's.
    """
    why = {**resolve_auto(cfg), **(why or {})}  # the reasons of the first resolution, when given
    bench = cfg.bench
    n = int(bench.max_new_tokens)
    greedy = SamplingParams()
    names = method_names(bench)
    policies = build_policies(cfg) if policies is None else policies
    compiled = bool(bench.get("compile"))
    settings = sample_settings(cfg)
    heads = heads or {None: draft}
    methods, skipped = [], {}

    def fresh(name: str, short: str | None = None):  # a policy object of its own: a compiled decoder may pad or
        #                                              precompute per policy; it reads head ``short``'s files
        node = tree_config(bench, name)
        if head_paths and short in head_paths and "draft_path" in node:
            node = OmegaConf.merge(node, {"draft_path": str(head_paths[short])})
        return instantiate_checked(node, f"bench.trees.{name}")

    own = OmegaConf.select(cfg, "draft.path")

    for name in names:
        if name == "vanilla":
            methods.append(vanilla_method("vanilla", target, n, greedy, eos_ids))
            if compiled:
                # Eager and compiled kernels round differently: in fp32 a difference is a bug, in bf16 it is reported.
                methods.append(vanilla_method("vanilla_compile", target, n, greedy, eos_ids, compile=True))
                methods[-1].lossless = target.dtype == torch.float32
            if fp32_reference(bench, target):
                methods.append(vanilla_fp32_method(target, n, greedy, eos_ids))
            for s in settings:
                methods.append(vanilla_method(sampled_name("vanilla_sample", s.temperature), target, n, s, eos_ids))
            continue
        if name == "learned" and not bench.learned_path:
            skipped[name] = why["learned"]
            log.info("skipping `learned`: %s", skipped[name])
            continue
        if name == "learned":
            log.info("`learned`: %s", why["learned"])
        for i, (short, head) in enumerate(heads.items()):
            mine = not head_paths or str(head_paths.get(short)) == str(own)  # (its tree reads this head's files)
            policy = policies[name] if i == 0 and mine else fresh(name, short)
            row = head_name(name, short)
            reason = rejects(policy, head)
            if reason:
                skipped[row] = reason
                log.info("skipping `%s`: %s", row, reason)
                continue
            methods.append(speculative_method(row, target, head, policy, n, greedy, eos_ids, head=short))
            if compiled:
                methods.append(speculative_method(head_name(f"{name}_compile", short), target, head, fresh(name, short), n,
                                                  greedy, eos_ids, compile=True, reference="vanilla_compile",
                                                  head=short))
            for s in settings:  # its own policy object per row, as for the compiled variants
                methods.append(speculative_method(sampled_name(head_name(f"{name}_sample", short), s.temperature),
                                                  target, head, fresh(name, short), n, s, eos_ids, head=short))
    return methods, skipped
