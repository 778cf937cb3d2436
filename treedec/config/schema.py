"""Structured-config schemas (Hydra ConfigStore) for the entry points and the config groups.

Importing this module registers, in Hydra's ConfigStore:

* ``schema/generate``, ``schema/calibrate`` and ``schema/bench``: the keys and types of
  ``conf/generate.yaml`` / ``conf/calibrate.yaml`` / ``conf/bench.yaml`` (each lists
  ``- optional schema@_here_: <name>`` first in its defaults, so once this module is imported,
  composing it rejects an unknown key or a wrong type with OmegaConf's own message, before
  anything is loaded);
* ``schema/tree/{static,dynamic,chain,learned,lookup}``, ``schema/tree/shape``, ``schema/model``,
  ``schema/draft``, ``schema/sampling``: the group schemas, for configs of
  your own (``defaults: [/schema/tree@_here_: dynamic, _self_]``).

:func:`treedec.config_checks.validate` checks a composed config against them, and its values.
"""
from __future__ import annotations

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
    _target_: str = MISSING  # treedec.heads.head.DraftHead.load
    path: str = MISSING  # "tiny-code-eagle" or a draft head directory
    dtype: Optional[str] = "auto"  # auto: fp32 on a CPU (its small matmuls are faster), else the target's | float32 | bfloat16
    quantize: Optional[str] = "auto"  # auto: int8 weights on a CPU where they measure faster | int8 | null (full precision)


@dataclass
class SamplingSchema:  # conf/sampling/*.yaml give every value
    _target_: str = MISSING  # treedec.sampling.SamplingParams
    temperature: float = MISSING
    top_k: int = MISSING
    top_p: float = MISSING


@dataclass
class ShapeSchema:
    name: Optional[str] = None
    choices: List[List[int]] = MISSING


@dataclass
class StaticTreeSchema:
    _target_: str = "treedec.tree.policies.StaticPolicy"
    shape: Any = None  # a tree/shape config (name + choices), a shipped shape name, or a file
    choices: Optional[List[List[int]]] = None
    sample_drafts: bool = False


@dataclass
class DynamicTreeSchema:
    _target_: str = "treedec.tree.policies.DynamicPolicy"
    total_tokens: Any = 16  # as conf/tree/dynamic.yaml (an int; checked by DynamicPolicy)
    depth: int = 6
    top_k: Any = "auto"  # an int, or auto: the narrowest width that holds total_tokens at depth
    calibration: Optional[str] = "auto"  # a calibration.yaml, auto (the one next to draft_path's head) or null
    draft_path: Optional[str] = None  # conf: ${oc.select:draft.path,null}
    node_share: float = 1.0  # per-row budgets: share of the batch's B*(T-1) candidate slots kept (rest: padding)


@dataclass
class AutoTreeSchema:  # conf/tree/auto.yaml
    _target_: str = "treedec.tree.policies.AutoPolicy"
    max_depth: int = 10
    top_k: int = 4
    max_total_tokens: int = 64
    draft_path: Optional[str] = None


@dataclass
class ChainTreeSchema:
    _target_: str = "treedec.tree.policies.ChainPolicy"
    depth: int = 5
    sample_drafts: bool = False


@dataclass
class LearnedTreeSchema:
    _target_: str = "treedec.tree.policies.LearnedPolicy"
    path: str = MISSING
    total_tokens: Optional[int] = None
    sample_drafts: bool = False


@dataclass
class LookupTreeSchema:
    _target_: str = "treedec.tree.policies.LookupPolicy"
    inner: Any = MISSING  # the policy whose tree the copied chain joins (checked by its own _target_)
    tokens: int = 12
    ngram: List[int] = field(default_factory=lambda: [3, 2])
    max_rows: int = 4  # copies only while the batch holds at most this many rows
    skip_draft: bool = True  # after a step whose copies outran the inner tree in every row: the copies alone


@dataclass
class CombProbeSchema:
    _target_: str = "treedec.tree.sequoia.comb_probe"
    top_k: int = 6
    depth: int = 6


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
}


def tree_schema(target: Any) -> type | None:
    """The schema of a tree-policy ``_target_``, looked up by the class (or function) it names, so every import
    path of one class (``treedec.tree.policies.StaticPolicy``, ``...policies.static.StaticPolicy``) finds it;
    None for a target of your own (left alone) or one that does not import (instantiating it says why)."""
    import importlib

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
    prompt_file: Optional[str] = None
    chat: bool = False
    max_new_tokens: int = 128
    compare: bool = False
    compile: bool = False
    stream: bool = True
    seed: int = 0
    num_threads: Optional[int] = None
    optimized_metric: Optional[str] = None  # the metrics.json key an Optuna sweep maximises
    paths: PathsSchema = field(default_factory=PathsSchema)


@dataclass
class PromptsSchema:
    source: str = "heldout"  # heldout (stdlib validation files) | third_party (site-packages) | file (jsonl or text)
    file: Optional[str] = None
    n: int = 8
    prompt_tokens: int = 128
    root: Optional[str] = None  # corpus root for heldout prompts (null: this Python's stdlib)
    val_fraction: float = 0.03
    packages: Optional[List[str]] = None  # third_party: only these top-level packages (null: every installed one)


@dataclass
class DPSchema:
    max_budget: int = 64  # largest T (root included) the DP solves for
    max_depth: int = 6
    max_width: Optional[int] = None  # children per node (null: the probe's top_k)
    per_depth: bool = True  # acceptance by (depth, rank) rather than by rank only
    prior_strength: float = 10.0  # pseudo-trials shrinking sparse (depth, rank) cells to the rank's pooled rate
    budget: Optional[int] = None  # fixed T; null: chosen by timing (or max_budget without timing)
    depth: Optional[int] = None  # fixed depth limit; null: the best one


@dataclass
class TimingSchema:
    enabled: bool = True
    budgets: Optional[List[int]] = None  # T values to time (null: a grid up to dp.max_budget); others interpolate
    repeats: int = 5
    warmup: int = 2
    prefix_len: int = 128  # KV-cache length the verify pass attends to
    overhead: bool = True  # add the probe run's per-step accept + commit time to each step's cost


@dataclass
class CalibrationFitSchema:
    prior_strength: float = 2.0  # pseudo-trials shrinking a sparse confidence bin towards the identity
    map: str = "power"  # the map the dynamic policy applies: power or isotonic (the file holds both)


@dataclass
class CalibrateSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    draft: DraftSchema = field(default_factory=DraftSchema)
    sampling: SamplingSchema = field(default_factory=SamplingSchema)
    probe: Any = MISSING  # a tree policy config; default treedec.tree.sequoia.comb_probe
    prompts: PromptsSchema = field(default_factory=PromptsSchema)
    max_new_tokens: int = 64
    chat: bool = False
    dp: DPSchema = field(default_factory=DPSchema)
    timing: TimingSchema = field(default_factory=TimingSchema)
    calibration: CalibrationFitSchema = field(default_factory=CalibrationFitSchema)
    out: str = MISSING
    seed: int = 0
    num_threads: Optional[int] = None
    paths: PathsSchema = field(default_factory=PathsSchema)


@dataclass
class BenchOptionsSchema:
    prompts: Optional[str] = None  # a .jsonl (or text) prompt file; null: generated prompts of prompt_source
    prompt_source: str = "third_party"  # third_party (installed packages) | stdlib (held-out stdlib files)
    third_party_packages: Optional[List[str]] = None  # third_party: only these packages (null: every installed one)
    n_prompts: int = 8
    prompt_tokens: int = 128
    chat: bool = False
    max_new_tokens: int = 128
    repeats: int = 3
    warmup: int = 1
    num_threads: Optional[int] = None
    seed: int = 0
    methods: List[str] = MISSING  # conf/bench.yaml
    sampling: bool = False
    sample_temperatures: Optional[List[float]] = field(default_factory=lambda: [0.8, 0.3])  # null: the group's
    learned_path: Optional[str] = "auto"  # auto: the tree shipped for the bundled head (treedec/bench/bundled.py)
    vanilla_fp32: Any = "auto"  # true | false | auto: also vanilla on an fp32 copy of the target (CPU baseline)
    compile: bool = False  # also run vanilla and each tree method with compile=True (NAME_compile)
    draft_heads: Optional[List[str]] = None  # draft config names or head directories: every method x head (METHOD@HEAD)
    dynamic_sweep: Optional[List[int]] = None  # also dynamic_T<n> (bench.trees.dynamic at total_tokens=n) per n
    best_first_sweep: Optional[List[int]] = None  # also best_first_T<n> (bench.trees.best_first at total_tokens=n) per n
    batch_sizes: Optional[List[int]] = None  # e.g. [1, 4, 16]: also decode in batches of each size (bench/batched.py)
    batch_mode: str = "static"  # static: full batches of b | continuous: queues of 4*b prompts through b slots
    trees: Dict[str, Any] = MISSING  # method name -> tree policy config (checked by _target_)
    peers: List[str] = MISSING  # conf/bench.yaml
    prompt_lookup_num_tokens: int = 10
    assistant_path: Optional[str] = "auto"  # auto: tiny-code-assistant for the bundled target; or a directory
    tie_ulps: float = 2.0
    strict_peers: bool = False
    plots: bool = True


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
    format: str = "eagle"  # eagle | eagle3 (the head's kind): the public layout to write
    out: str = MISSING  # the directory to create
    dtype: Optional[str] = None  # null: the head's own
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
    format: str = "auto"
    prompt_tokens: int = 64
    max_new_tokens: int = 128
    chat_template: Optional[str] = "auto"
    batch_size: int = 8
    slots: Optional[int] = None  # rows decoding at once (continuous batching); null: batch_size
    shard_size: int = 256
    on_error: str = "fail"
    part: int = 0
    parts: int = 1
    progress: bool = True
    compile: bool = False
    seed: int = 0
    num_threads: Optional[int] = None
    paths: PathsSchema = field(default_factory=PathsSchema)


SCHEMAS["regenerate"] = RegenerateSchema


def register_configs() -> None:
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(group="schema", name=name, node=node)
    for name, node in (("static", StaticTreeSchema), ("dynamic", DynamicTreeSchema), ("chain", ChainTreeSchema),
                       ("learned", LearnedTreeSchema), ("lookup", LookupTreeSchema), ("auto", AutoTreeSchema)):
        cs.store(group="schema/tree", name=name, node=node)
    for name, node in (("tree/shape", ShapeSchema), ("model", ModelSchema), ("draft", DraftSchema),
                       ("sampling", SamplingSchema)):
        group, _, leaf = f"schema/{name}".rpartition("/")
        cs.store(group=group, name=leaf, node=node)


register_configs()
