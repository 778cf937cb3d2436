"""Structured-config schemas (Hydra ConfigStore) for the entry points and the config groups.

Importing this module registers, in Hydra's ConfigStore:

* ``schema/generate`` and ``schema/calibrate``: the top-level keys and types of
  ``conf/generate.yaml`` / ``conf/calibrate.yaml`` (both list ``- optional schema@_here_: <name>``
  first in their defaults, so once this module is imported, composing either config rejects an
  unknown key or a wrong type with OmegaConf's own message, before anything is loaded);
* ``schema/tree/{static,dynamic,chain,learned}``, ``schema/tree/shape``, ``schema/model``,
  ``schema/draft``, ``schema/kernel``, ``schema/sampling``: the group schemas, for configs of
  your own (``defaults: [/schema/tree@_here_: dynamic, _self_]``).

:func:`validate` checks a composed config against them, including the node of a ``tree`` (or
``probe``) group by its ``_target_`` (a policy class of your own is left alone). The
``treedec.callbacks.ValidateConfig`` Hydra callback runs it before every ``generate`` job, so a
typo or a wrong type is a clear error before any model loads, even where nothing imported this
module before composition.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

KERNEL_BACKENDS = ("auto", "eager", "sdpa", "triton")


class ConfigError(ValueError):
    """A config that does not match its schema (unknown key, wrong type, bad value)."""


# ------------------------------------------------------------------------------------------ groups
@dataclass
class ModelSchema:
    path: str = MISSING  # "tiny-code" or a local Hugging Face directory
    dtype: str = "bfloat16"
    device: str = "cpu"


@dataclass
class DraftSchema:
    path: str = MISSING  # "tiny-code-eagle" or a draft head directory


@dataclass
class KernelSchema:
    backend: str = "auto"  # auto | eager | sdpa | triton


@dataclass
class SamplingSchema:
    _target_: str = "treedec.decoding.sampling.SamplingParams"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


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
    total_tokens: int = 16  # as conf/tree/dynamic.yaml
    depth: int = 5
    top_k: int = 4


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
class CombProbeSchema:
    _target_: str = "treedec.tree.sequoia.comb_probe"
    top_k: int = 6
    depth: int = 6


@dataclass
class PathsSchema:
    run_dir: str = MISSING


# Policies (by `_target_`) whose config node validate() checks; other targets are user code.
TREE_SCHEMAS: dict[str, type] = {
    "treedec.tree.policies.StaticPolicy": StaticTreeSchema,
    "treedec.tree.policies.static.StaticPolicy": StaticTreeSchema,
    "treedec.tree.policies.DynamicPolicy": DynamicTreeSchema,
    "treedec.tree.policies.dynamic.DynamicPolicy": DynamicTreeSchema,
    "treedec.tree.policies.ChainPolicy": ChainTreeSchema,
    "treedec.tree.policies.static.ChainPolicy": ChainTreeSchema,
    "treedec.tree.policies.LearnedPolicy": LearnedTreeSchema,
    "treedec.tree.policies.learned.LearnedPolicy": LearnedTreeSchema,
    "treedec.tree.sequoia.comb_probe": CombProbeSchema,
}


# ------------------------------------------------------------------------------------- entry points
@dataclass
class GenerateSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    draft: DraftSchema = field(default_factory=DraftSchema)
    tree: Any = MISSING  # checked by validate() against TREE_SCHEMAS[tree._target_]
    kernel: KernelSchema = field(default_factory=KernelSchema)
    sampling: SamplingSchema = field(default_factory=SamplingSchema)
    prompt: str = ""
    prompt_file: Optional[str] = None
    chat: bool = False
    max_new_tokens: int = 128
    compare: bool = False
    stream: bool = True
    seed: int = 0
    num_threads: Optional[int] = None
    optimized_metric: Optional[str] = None  # the metrics.json key an Optuna sweep maximises
    paths: PathsSchema = field(default_factory=PathsSchema)


@dataclass
class PromptsSchema:
    source: str = "heldout"  # heldout (validation files of the stdlib corpus) | file (jsonl or text)
    file: Optional[str] = None
    n: int = 8
    prompt_tokens: int = 128
    root: Optional[str] = None  # corpus root for heldout prompts (null: this Python's stdlib)
    val_fraction: float = 0.03


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
class CalibrateSchema:
    model: ModelSchema = field(default_factory=ModelSchema)
    draft: DraftSchema = field(default_factory=DraftSchema)
    kernel: KernelSchema = field(default_factory=KernelSchema)
    sampling: SamplingSchema = field(default_factory=SamplingSchema)
    probe: Any = MISSING  # a tree policy config; default treedec.tree.sequoia.comb_probe
    prompts: PromptsSchema = field(default_factory=PromptsSchema)
    max_new_tokens: int = 64
    chat: bool = False
    dp: DPSchema = field(default_factory=DPSchema)
    timing: TimingSchema = field(default_factory=TimingSchema)
    out: str = MISSING
    seed: int = 0
    num_threads: Optional[int] = None
    paths: PathsSchema = field(default_factory=PathsSchema)


SCHEMAS: dict[str, type] = {"generate": GenerateSchema, "calibrate": CalibrateSchema}


def register_configs() -> None:
    cs = ConfigStore.instance()
    for name, node in SCHEMAS.items():
        cs.store(group="schema", name=name, node=node)
    for name, node in (("static", StaticTreeSchema), ("dynamic", DynamicTreeSchema), ("chain", ChainTreeSchema),
                       ("learned", LearnedTreeSchema)):
        cs.store(group="schema/tree", name=name, node=node)
    for name, node in (("tree/shape", ShapeSchema), ("model", ModelSchema), ("draft", DraftSchema),
                       ("kernel", KernelSchema), ("sampling", SamplingSchema)):
        group, _, leaf = f"schema/{name}".rpartition("/")
        cs.store(group=group, name=leaf, node=node)


register_configs()


# ------------------------------------------------------------------------------------------ checks
def _fail(where: str, e: OmegaConfBaseException, hint: str) -> ConfigError:
    msg = str(getattr(e, "msg", None) or e).strip().splitlines()[0]
    key = getattr(e, "full_key", None)
    at = f"{where}.{key}" if key and where not in SCHEMAS else (key or where)
    return ConfigError(f"invalid {where} config at {at}: {msg}. {hint}")


def _merge(schema: type, node, where: str, hint: str) -> None:
    try:
        OmegaConf.merge(OmegaConf.structured(schema), node)
    except OmegaConfBaseException as e:
        raise _fail(where, e, hint) from None


def validate_tree(node, where: str = "tree") -> None:
    """Check a tree-policy node against the schema of its ``_target_`` (unknown targets pass)."""
    if node is None or not isinstance(node, (DictConfig, dict)):
        raise ConfigError(f"invalid {where} config: expected a policy config with a _target_, got {node!r}")
    target = node.get("_target_")
    schema = TREE_SCHEMAS.get(str(target))
    if schema is None:
        return
    keys = ", ".join(k for k in schema.__dataclass_fields__ if k != "_target_")
    _merge(schema, node, where, f"{target.rsplit('.', 1)[-1]} takes: {keys}")
    shape = node.get("shape")
    if isinstance(shape, (DictConfig, dict)):
        _merge(ShapeSchema, shape, f"{where}.shape", "a tree shape has `name` and `choices` (a list of paths)")


def validate(cfg: DictConfig, kind: str = "generate") -> None:
    """Raise :class:`ConfigError` if ``cfg`` (a composed ``generate``/``calibrate`` config) has an
    unknown key, a value of the wrong type, or an unknown kernel backend. Values are not resolved."""
    if kind not in SCHEMAS:
        raise ValueError(f"unknown schema {kind!r}; known: {', '.join(SCHEMAS)}")
    node = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    node.pop("hydra", None)
    fields = ", ".join(SCHEMAS[kind].__dataclass_fields__)
    _merge(SCHEMAS[kind], node, kind,
           f"Known top-level keys: {fields} (a new key belongs in treedec/config_schema.py too)")
    for group in ("tree", "probe"):
        if group in node and group in SCHEMAS[kind].__dataclass_fields__:
            validate_tree(node[group], group)
    backend = OmegaConf.select(node, "kernel.backend")
    if backend is not None and backend not in KERNEL_BACKENDS:
        raise ConfigError(f"invalid {kind} config: kernel.backend={backend!r}; "
                          f"choose one of {', '.join(KERNEL_BACKENDS)}")
