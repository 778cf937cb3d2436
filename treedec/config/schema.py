"""Structured-config schemas (Hydra ConfigStore) for the entry points and the config groups.

Importing this module registers, in Hydra's ConfigStore:

* ``schema/generate``, ``schema/calibrate`` and ``schema/bench``: the keys and types of
  ``conf/generate.yaml`` / ``conf/calibrate.yaml`` / ``conf/bench.yaml`` (each lists
  ``- optional schema@_here_: <name>`` first in its defaults, so once this module is imported,
  composing it rejects an unknown key or a wrong type with OmegaConf's own message, before
  anything is loaded);
* ``schema/tree/{static,dynamic,chain,learned,lookup,auto,best_first}``, ``schema/tree/shape``, ``schema/model``,
  ``schema/draft``, ``schema/sampling``: the group schemas.

The schemas declare keys and types only: every value, default included, is written once, in the YAML under conf/
(tests/test_config_defaults.py fails on a second copy). A config of your own extends a shipped one
(``defaults: [/tree/dynamic@_here_, _self_]``) for its values.

:func:`treedec.config.validate` checks a composed config against them, and its values.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from treedec.attention import BACKENDS

KERNEL_BACKENDS = ("auto", *BACKENDS)  # model.attn_backend: auto picks one of the tree-attention backends


# ------------------------------------------------------------------------------------------ groups
@dataclass
class ModelSchema:  # conf/model: the target checkpoint to load (its loader is _target_)
    _target_: str = MISSING  # treedec.models.load_model
    path: str = MISSING  # "tiny-code" or a local Hugging Face directory
    dtype: str = MISSING
    device: str = MISSING  # auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    attn_backend: str = MISSING  # auto | eager | sdpa | triton (the kernel group sets it: kernel=sdpa)


@dataclass
class DraftSchema:  # conf/draft: the draft head to load
    _target_: str = MISSING  # treedec.heads.load_head
    path: str = MISSING  # "tiny-code-eagle" or a draft head directory
    dtype: Optional[str] = MISSING  # auto: fp32 on a CPU (its small matmuls are faster), else the target's | float32 | bfloat16
    quantize: Optional[str] = MISSING  # auto: int8 weights on a CPU where they measure faster | int8 | null (full precision)


@dataclass
class SamplingSchema:  # conf/sampling/*.yaml give every value
    _target_: str = MISSING  # treedec.sampling.SamplingParams
    temperature: float = MISSING
    top_k: int = MISSING
    top_p: float = MISSING


@dataclass
class ShapeSchema:
    name: Optional[str] = MISSING
    choices: List[List[int]] = MISSING


@dataclass
class StaticTreeSchema:
    _target_: str = MISSING
    shape: Any = MISSING  # a tree/shape config (name + choices), a shipped shape name, or a file
    choices: Optional[List[List[int]]] = MISSING
    sample_drafts: bool = MISSING


@dataclass
class DynamicTreeSchema:
    _target_: str = MISSING
    total_tokens: Any = MISSING  # as conf/tree/dynamic.yaml (an int; checked by DynamicPolicy)
    depth: int = MISSING
    top_k: Any = MISSING  # an int, or auto: the narrowest width that holds total_tokens at depth
    calibration: Optional[str] = MISSING  # a calibration.yaml, auto (the one next to draft_path's head) or null
    draft_path: Optional[str] = MISSING  # conf: ${oc.select:draft.path,null}
    node_share: float = MISSING  # per-row budgets: share of the batch's B*(T-1) candidate slots kept (rest: padding)


@dataclass
class AutoTreeSchema:  # conf/tree/auto.yaml
    _target_: str = MISSING
    max_depth: int = MISSING
    top_k: int = MISSING
    max_total_tokens: int = MISSING
    draft_path: Optional[str] = MISSING


@dataclass
class ChainTreeSchema:
    _target_: str = MISSING
    depth: int = MISSING
    sample_drafts: bool = MISSING


@dataclass
class LearnedTreeSchema:
    _target_: str = MISSING
    path: str = MISSING
    total_tokens: Optional[int] = MISSING
    sample_drafts: bool = MISSING


@dataclass
class LookupTreeSchema:
    _target_: str = MISSING
    inner: Any = MISSING  # the policy whose tree the copied chain joins (checked by its own _target_)
    tokens: int = MISSING
    ngram: List[int] = MISSING
    max_rows: int = MISSING  # copies only while the batch holds at most this many rows
    skip_draft: bool = MISSING  # after a step whose copies outran the inner tree in every row: the copies alone


@dataclass
class BestFirstTreeSchema:  # conf/tree/best_first.yaml (one-pass heads)
    _target_: str = MISSING
    total_tokens: int = MISSING
    depth: int = MISSING
    calibration: Optional[str] = MISSING  # a calibration.yaml, auto (the one next to draft_path's head) or null
    draft_path: Optional[str] = MISSING  # conf: ${oc.select:draft.path,null}


@dataclass
class CombProbeSchema:
    _target_: str = MISSING
    top_k: int = MISSING
    depth: int = MISSING


@dataclass
class PathsSchema:  # conf/paths/default.yaml
    root_dir: str = MISSING
    data_dir: str = MISSING
    output_dir: str = MISSING
    run_dir: str = MISSING


# Policy classes (by their defining module and name) whose config node validate() checks; other targets are user code.
TREE_SCHEMAS: dict[str, type] = {
    "treedec.tree.policies.static.StaticPolicy": StaticTreeSchema,
    "treedec.tree.policies.dynamic.DynamicPolicy": DynamicTreeSchema,
    "treedec.tree.policies.auto.policy.AutoPolicy": AutoTreeSchema,
    "treedec.tree.policies.chain.ChainPolicy": ChainTreeSchema,
    "treedec.tree.policies.learned.LearnedPolicy": LearnedTreeSchema,
    "treedec.tree.sequoia.comb_probe": CombProbeSchema,
    "treedec.tree.policies.lookup.LookupPolicy": LookupTreeSchema,
    "treedec.tree.policies.best_first.BestFirstPolicy": BestFirstTreeSchema,
}


def tree_schema(target: Any) -> type | None:
    """The schema of a tree-policy ``_target_``, looked up by the class (or function) it names, so every import
    path of one class (``treedec.tree.policies.StaticPolicy``, ``...policies.static.StaticPolicy``) finds it;
    None for a target of your own (left alone) or one that does not import (instantiating it says why)."""
    module, _, name = str(target).rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return TREE_SCHEMAS.get(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}")


# ------------------------------------------------------------------------------------- entry points
@dataclass
class GenerateSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    draft: DraftSchema = field(default_factory=DraftSchema)
    tree: Any = MISSING  # checked by validate() against the schema of tree._target_'s class
    sampling: SamplingSchema = field(default_factory=SamplingSchema)
    prompt: str = MISSING
    prompt_file: Optional[str] = MISSING
    chat: bool = MISSING
    max_new_tokens: int = MISSING
    compare: bool = MISSING
    compile: bool = MISSING
    stream: bool = MISSING
    seed: int = MISSING
    num_threads: Optional[int] = MISSING
    optimized_metric: Optional[str] = MISSING  # the metrics.json key an Optuna sweep maximises
    paths: PathsSchema = field(default_factory=PathsSchema)


@dataclass
class PromptsSchema:
    source: str = MISSING  # heldout (stdlib validation files) | third_party (site-packages) | file (jsonl or text)
    file: Optional[str] = MISSING
    n: int = MISSING
    prompt_tokens: int = MISSING
    root: Optional[str] = MISSING  # corpus root for heldout prompts (null: this Python's stdlib)
    val_fraction: float = MISSING
    packages: Optional[List[str]] = MISSING  # third_party: only these top-level packages (null: every installed one)


@dataclass
class DPSchema:
    max_budget: int = MISSING  # largest T (root included) the DP solves for
    max_depth: int = MISSING
    max_width: Optional[int] = MISSING  # children per node (null: the probe's top_k)
    per_depth: bool = MISSING  # acceptance by (depth, rank) rather than by rank only
    prior_strength: float = MISSING  # pseudo-trials shrinking sparse (depth, rank) cells to the rank's pooled rate
    budget: Optional[int] = MISSING  # fixed T; null: chosen by timing (or max_budget without timing)
    depth: Optional[int] = MISSING  # fixed depth limit; null: the best one


@dataclass
class TimingSchema:
    enabled: bool = MISSING
    budgets: Optional[List[int]] = MISSING  # T values to time (null: a grid up to dp.max_budget); others interpolate
    repeats: int = MISSING
    warmup: int = MISSING
    prefix_len: int = MISSING  # KV-cache length the verify pass attends to
    overhead: bool = MISSING  # add the probe run's per-step accept + commit time to each step's cost


@dataclass
class CalibrationFitSchema:
    prior_strength: float = MISSING  # pseudo-trials shrinking a sparse confidence bin towards the identity
    map: str = MISSING  # the map the dynamic policy applies: power or isotonic (the file holds both)


@dataclass
class CalibrateSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    draft: DraftSchema = field(default_factory=DraftSchema)
    sampling: SamplingSchema = field(default_factory=SamplingSchema)
    probe: Any = MISSING  # a tree policy config; default treedec.tree.sequoia.comb_probe
    prompts: PromptsSchema = field(default_factory=PromptsSchema)
    max_new_tokens: int = MISSING
    chat: bool = MISSING
    dp: DPSchema = field(default_factory=DPSchema)
    timing: TimingSchema = field(default_factory=TimingSchema)
    calibration: CalibrationFitSchema = field(default_factory=CalibrationFitSchema)
    out: str = MISSING
    seed: int = MISSING
    num_threads: Optional[int] = MISSING
    paths: PathsSchema = field(default_factory=PathsSchema)


@dataclass
class BenchOptionsSchema:
    prompts: Optional[str] = MISSING  # a .jsonl (or text) prompt file; null: generated prompts of prompt_source
    prompt_source: str = MISSING  # third_party (installed packages) | stdlib (held-out stdlib files)
    third_party_packages: Optional[List[str]] = MISSING  # third_party: only these packages (null: every installed one)
    n_prompts: int = MISSING
    prompt_tokens: int = MISSING
    chat: bool = MISSING
    max_new_tokens: int = MISSING
    repeats: int = MISSING
    warmup: int = MISSING
    num_threads: Optional[int] = MISSING
    seed: int = MISSING
    methods: List[str] = MISSING  # conf/bench.yaml
    sampling: bool = MISSING
    sample_temperatures: Optional[List[float]] = MISSING  # null: the group's
    learned_path: Optional[str] = MISSING  # auto: the tree shipped for the bundled head (treedec/bench/bundled.py)
    vanilla_fp32: Any = MISSING  # true | false | auto: also vanilla on an fp32 copy of the target (CPU baseline)
    compile: bool = MISSING  # also run vanilla and each tree method with compile=True (NAME_compile)
    draft_heads: Optional[List[str]] = MISSING  # draft config names or head directories: every method x head (METHOD@HEAD)
    dynamic_sweep: Optional[List[int]] = MISSING  # also dynamic_T<n> (bench.trees.dynamic at total_tokens=n) per n
    best_first_sweep: Optional[List[int]] = MISSING  # also best_first_T<n> (bench.trees.best_first at total_tokens=n) per n
    batch_sizes: Optional[List[int]] = MISSING  # e.g. [1, 4, 16]: also decode in batches of each size (bench/batched.py)
    batch_mode: str = MISSING  # static: full batches of b | continuous: queues of 4*b prompts through b slots
    trees: Dict[str, Any] = MISSING  # method name -> tree policy config (checked by _target_)
    peers: List[str] = MISSING  # conf/bench.yaml
    vllm_tokens: int = MISSING
    prompt_lookup_num_tokens: int = MISSING
    assistant_path: Optional[str] = MISSING  # auto: tiny-code-assistant for the bundled target; or a directory
    tie_ulps: float = MISSING
    strict_peers: bool = MISSING
    plots: bool = MISSING


@dataclass
class BenchSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    draft: DraftSchema = field(default_factory=DraftSchema)
    sampling: SamplingSchema = field(default_factory=SamplingSchema)
    bench: BenchOptionsSchema = field(default_factory=BenchOptionsSchema)
    paths: PathsSchema = field(default_factory=PathsSchema)


@dataclass
class ExportHeadSchema:
    draft: DraftSchema = field(default_factory=DraftSchema)  # the head to export
    format: str = MISSING  # eagle | eagle3 | peagle (the head's kind): the public layout to write
    out: str = MISSING  # the directory to create
    target: Optional[str] = MISSING  # format=peagle: the target whose embedding table travels along (null: the head's)
    dtype: Optional[str] = MISSING  # null: the head's own
    paths: PathsSchema = field(default_factory=PathsSchema)


SCHEMAS: dict[str, type] = {"generate": GenerateSchema, "calibrate": CalibrateSchema, "bench": BenchSchema,
                            "export_head": ExportHeadSchema}



@dataclass
class RegenerateSchema:  # conf/regenerate.yaml (python -m treedec.regenerate, docs/regenerate.md)
    model: ModelSchema = field(default_factory=ModelSchema)
    draft: DraftSchema = field(default_factory=DraftSchema)
    tree: Any = MISSING
    sampling: SamplingSchema = field(default_factory=SamplingSchema)
    trainer: Any = MISSING  # a conf/trainer node (Lightning's own arguments)
    input: str = MISSING
    out_dir: str = MISSING
    format: str = MISSING
    prompt_tokens: int = MISSING
    max_new_tokens: int = MISSING
    chat_template: Optional[str] = MISSING
    batch_size: int = MISSING
    slots: Optional[int] = MISSING  # rows decoding at once (continuous batching); null: batch_size
    shard_size: int = MISSING
    on_error: str = MISSING
    part: int = MISSING
    parts: int = MISSING
    progress: bool = MISSING
    compile: bool = MISSING
    seed: int = MISSING
    num_threads: Optional[int] = MISSING
    engine: str = MISSING  # lightning | vllm
    vllm_args: Dict[str, Any] = MISSING  # engine=vllm: more vllm.LLM arguments
    paths: PathsSchema = field(default_factory=PathsSchema)


SCHEMAS["regenerate"] = RegenerateSchema


def register_configs() -> None:
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(group="schema", name=name, node=node)
    for name, node in (("static", StaticTreeSchema), ("dynamic", DynamicTreeSchema), ("chain", ChainTreeSchema),
                       ("learned", LearnedTreeSchema), ("lookup", LookupTreeSchema), ("auto", AutoTreeSchema),
                       ("best_first", BestFirstTreeSchema)):
        cs.store(group="schema/tree", name=name, node=node)
    for name, node in (("tree/shape", ShapeSchema), ("model", ModelSchema), ("draft", DraftSchema),
                       ("sampling", SamplingSchema)):
        group, _, leaf = f"schema/{name}".rpartition("/")
        cs.store(group=group, name=leaf, node=node)


register_configs()
