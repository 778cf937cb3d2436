"""Every default is written once, in the YAML under conf/ (as lightning-hydra-template does).

Walks every config file of every group, the entry configs too, and fails on a second copy of a value:
(a) a schema dataclass field with a default (the schemas declare keys and types only);
(b) a callable named by a ``_target_`` whose signature default differs from the YAML's value for that key;
(c) a key a schema declares that no YAML gives, or a YAML key its schema lacks.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

import treedec.config.schema as schema
from tests.helpers import compose_config
from treedec.conf_defaults import HYDRA_KEYS
from treedec.config import job_schema as train_schema
from treedec.models.paths import CONF

FILES = sorted(p.relative_to(CONF).as_posix() for p in CONF.rglob("*.yaml"))
ENTRIES = sorted(p.stem for p in CONF.glob("*.yaml"))
ENTRY_SCHEMAS = {**schema.SCHEMAS, "train": train_schema.TrainSchema, "pretrain": train_schema.PretrainSchema}
# Groups whose options have a schema: each option is composed into generate and its node compared with the schema.
SCHEMA_GROUPS = ("tree", "sampling", "model", "draft", "kernel")
# Python-API defaults that deliberately differ from the configs', each with why (a callable a user calls directly).
PYTHON_API = {
    ("load_head", "dtype"): "None: the head's dtype as saved (README's load_head(name, target=...)); "
                                 "the configs ask for auto",
    ("load_head", "quantize"): "None: full precision, as saved; the configs ask for auto",
}


def _composed(name: str, overrides=(), yaml_only: bool = False) -> DictConfig:
    """The composed config; ``yaml_only``: without the ``optional schema@_here_`` entry schemas (taken out of the
    ConfigStore while composing), so a key only a schema gives is absent."""
    repo = ConfigStore.instance().repo
    saved = repo.pop("schema") if yaml_only else None
    try:
        return compose_config(name, overrides, config_dir=CONF if yaml_only else None)  # (no import while popped)
    finally:
        if saved is not None:
            repo["schema"] = saved


def _schemas() -> set[type]:
    """Every schema dataclass: the ConfigStore's ``schema/`` group, the tree schemas, the training schemas, and the
    dataclasses nested in their fields."""
    found: set[type] = set()

    def add(cls: type) -> None:
        if cls in found:
            return
        found.add(cls)
        for hint in typing.get_type_hints(cls).values():
            if dataclasses.is_dataclass(hint):
                add(hint)

    def walk(repo: dict) -> None:
        for value in repo.values():
            if isinstance(value, dict):
                walk(value)
            else:
                cls = OmegaConf.get_type(value.node)
                if dataclasses.is_dataclass(cls):
                    add(cls)

    walk(ConfigStore.instance().repo["schema"])
    for cls in [*schema.TREE_SCHEMAS.values(), *ENTRY_SCHEMAS.values()]:
        add(cls)
    return found


SCHEMA_CLASSES = sorted(_schemas(), key=lambda c: c.__qualname__)


@pytest.mark.parametrize("cls", SCHEMA_CLASSES, ids=lambda c: c.__name__)
def test_schema_fields_have_no_default(cls):
    """(a) A schema declares a key and its type; the YAML gives its value (a nested schema is structure, not one)."""
    second = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            if not dataclasses.is_dataclass(f.default_factory()):
                second.append(f"{f.name}={f.default_factory()!r}")
        elif f.default is not MISSING:
            second.append(f"{f.name}={f.default!r}")
    assert not second, f"{cls.__name__} gives defaults the YAML gives too (make them = MISSING): {', '.join(second)}"


# ------------------------------------------------------------------------------ (b) signature defaults
def _callable(target: str):
    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError:  # Class.method
        owner, _, cls = module.rpartition(".")
        return getattr(getattr(importlib.import_module(owner), cls), name)


def _targets():
    """(file, node path, _target_, {key: value}) for every node with a ``_target_`` of treedec's (other packages'
    defaults are theirs), in every YAML file. Interpolations (wiring to another key) and ``???`` are left out."""
    for name in FILES:
        stack = [("", OmegaConf.load(CONF / name))]
        while stack:
            path, node = stack.pop()
            children = node.keys() if isinstance(node, DictConfig) else range(len(node))
            for key in children:
                child = node._get_node(key)
                if isinstance(child, (DictConfig, ListConfig)) and not child._is_interpolation():
                    stack.append((f"{path}.{key}" if path else str(key), child))
            target = node.get("_target_") if isinstance(node, DictConfig) else None
            if isinstance(target, str) and target.startswith("treedec."):
                values = {}
                for key in node.keys():
                    child = node._get_node(key)
                    if key in HYDRA_KEYS or child._is_interpolation() or child._is_missing():
                        continue
                    plain = OmegaConf.to_container(child) if isinstance(child, (DictConfig, ListConfig)) else child._value()
                    values[key] = plain
                yield name, path or "(top)", target, values


def _same(default, value) -> bool:
    if isinstance(default, (tuple, list)) and isinstance(value, (tuple, list)):
        return list(default) == list(value)
    return type(default) is type(value) and default == value or (
        isinstance(default, float) and isinstance(value, int) and default == value)


def _defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}


def _by_target() -> dict[str, list[tuple[str, str, dict]]]:
    out: dict[str, list] = {}
    for name, path, target, values in _targets():
        out.setdefault(target, []).append((name, path, values))
    return out


BY_TARGET = _by_target()


@pytest.mark.parametrize("target", sorted(BY_TARGET))
def test_signature_defaults_are_the_yamls(target):
    """(b) The defaults of a callable a config names are one YAML's values (its home, e.g. tree/dynamic.yaml for
    DynamicPolicy, read by treedec.conf_defaults); the other files naming it are options that choose others
    (sampling/sample.yaml). A default that no YAML naming the callable agrees with is a second, differing copy."""
    fn = _callable(target)
    defaults = {k: v for k, v in _defaults(fn).items() if (fn.__qualname__, k) not in PYTHON_API}
    nodes = BY_TARGET[target]
    given = {k for _, _, values in nodes for k in values} & defaults.keys()
    homes, report = [], []
    for name, path, values in nodes:
        differ = {k: (defaults[k], values[k]) for k in given & values.keys() if not _same(defaults[k], values[k])}
        absent = given - values.keys()
        if not differ and not absent:
            homes.append(path)  # a home: every default it gives agrees
            continue
        report.append(f"{name} at {path}: " + ", ".join(
            [f"{k}: signature {d!r}, yaml {v!r}" for k, (d, v) in sorted(differ.items())] + [f"{k} not given"
                                                                                               for k in sorted(absent)]))
    assert homes or not given, (f"{target}: no YAML gives its defaults {sorted(given)} ({'; '.join(report)}); "
                                f"read them with treedec.conf_defaults.shipped_defaults, or drop them")


@pytest.mark.parametrize("entry", ["train", "pretrain"])
def test_training_module_defaults_are_optims(entry):
    """(b) The LightningModule (conf/module, ``_partial_``) takes ``optim.*`` as its keyword arguments, so its
    signature defaults for them are a second copy unless they agree (a differing one is dropped)."""
    cfg = _composed(entry)
    fn = _callable(cfg.module._target_)
    optim = OmegaConf.to_container(cfg.optim, resolve=False)
    optim.pop("time_budget_s")  # the job resolves auto to seconds first; the module's None is steps only
    differ = {k: (d, optim[k]) for k, d in _defaults(fn).items() if k in optim and not _same(d, optim[k])}
    assert not differ, f"{cfg.module._target_}: signature defaults differ from conf/{entry}.yaml optim: {differ}"


# ---------------------------------------------------------------------------------------- (c) keys
def _schema_of(node, hint) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint
    if isinstance(node, DictConfig) and "_target_" in node:
        return schema.tree_schema(node._get_node("_target_")._value())
    return None


def _key_gaps(node: DictConfig, cls: type, where: str):
    """Keys ``cls`` declares that ``node`` lacks, keys ``node`` gives that ``cls`` lacks, recursively (a nested
    schema field, a tree node by its ``_target_``, a mapping of tree nodes such as bench.trees)."""
    hints = typing.get_type_hints(cls)
    keys = {k for k in node.keys() if k != "_target_"} | ({"_target_"} if "_target_" in hints else set())
    for key in sorted(hints.keys() - set(node.keys())):
        yield f"{where}{key}: declared by {cls.__name__}, given by no YAML"
    for key in sorted(keys - hints.keys()):
        yield f"{where}{key}: given by the YAML, not declared by {cls.__name__}"
    for key in sorted(keys & hints.keys()):
        child = node._get_node(key)
        if not isinstance(child, DictConfig) or child._is_interpolation() or child._is_none():
            continue
        sub = _schema_of(child, hints[key])
        if sub is not None:
            yield from _key_gaps(child, sub, f"{where}{key}.")
        elif typing.get_origin(hints[key]) is dict:
            for name in child.keys():
                item = child._get_node(name)
                sub = _schema_of(item, None)
                if sub is not None and not item._is_interpolation():
                    yield from _key_gaps(item, sub, f"{where}{key}.{name}.")


def _options() -> list[tuple[str, str]]:
    return [(g, p.stem) for g in SCHEMA_GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.mark.parametrize("entry", sorted(ENTRY_SCHEMAS))
def test_entry_schema_keys_are_the_yamls(entry):
    """(c) The composed entry config (its default choices) gives exactly the keys its schema declares."""
    cfg = _composed(entry, yaml_only=True)
    gaps = list(_key_gaps(cfg, ENTRY_SCHEMAS[entry], ""))
    assert not gaps, f"conf/{entry}.yaml: " + "; ".join(gaps)


@pytest.mark.parametrize("group, option", _options())
def test_group_option_keys_are_the_schemas(group, option):
    """(c) Every option of a group with a schema (each tree policy by its ``_target_``, sampling, model, draft)
    gives exactly the keys its schema declares."""
    cfg = _composed("generate", [f"{group}={option}"], yaml_only=True)
    key = "model" if group == "kernel" else group  # kernel=NAME sets model.attn_backend
    node = cfg._get_node(key)
    cls = _schema_of(node, typing.get_type_hints(ENTRY_SCHEMAS["generate"])[key])
    assert cls is not None, f"conf/{group}/{option}.yaml has no schema"
    gaps = list(_key_gaps(node, cls, f"{key}."))
    assert not gaps, f"conf/{group}/{option}.yaml: " + "; ".join(gaps)


def test_every_yaml_file_is_walked():
    """Every group directory's files and the entry configs are in the walk (a new group needs no registration)."""
    groups = {name.split("/")[0] for name in FILES if "/" in name}
    assert {"tree", "sampling", "model", "draft", "data", "trainer", "module", "callbacks", "logger"} <= groups
    assert set(ENTRY_SCHEMAS) <= set(ENTRIES) and "tree/dynamic.yaml" in FILES
