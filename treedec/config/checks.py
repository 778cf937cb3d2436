"""The generic checks of the config layer, which every command's checks (:mod:`treedec.config.commands`,
:mod:`.bench`, :mod:`.jobs`) build on: a node merged once against its structured schema (unknown keys with the
closest match, wrong types), a tree node against the schema of its ``_target_`` and its policy's own rule, keys
left ``???``, output paths, the model group's device, dtype, kernel and draft quantization, and the one
``instantiate`` wrapper. Each raises :class:`~treedec.errors.ConfigError`, one line naming the key and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from treedec.config.schema import KERNEL_BACKENDS, LookupTreeSchema, ShapeSchema, tree_schema
from treedec.errors import USER_ERRORS, ConfigError
from treedec.heads.quantized import check_quantize
from treedec.models.checkpoint import resolve_device, resolve_dtype
from treedec.tree.policies.dynamic import DynamicPolicy
from treedec.tree.tree import TreeError


# ------------------------------------------------------------------------------------- schema merge
def fields_of(schema: type) -> list[str]:
    return [k for k in schema.__dataclass_fields__ if k != "_target_"]


def _schema_at(schema: type, path: Sequence[str]) -> type | None:
    """The dataclass at ``path`` below ``schema`` (None where the path leaves the schemas)."""
    for part in path:
        t = typing.get_type_hints(schema).get(part)
        if t is None or not dataclasses.is_dataclass(t):
            return None
        schema = t
    return schema


def unknown_key_hint(key: str, known: Sequence[str], group: str = "", label: str | None = None) -> str:
    """``Did you mean <group>.<closest>? Keys of <group>: ...`` for a mistyped ``key`` (``label``: another noun)."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    did = f"Did you mean {group + '.' if group and label is None else ''}{close[0]}? " if close else ""
    label = label or (f"Keys of {group}" if group else "Top-level keys")
    return f"{did}{label}: {', '.join(known)}"


def _fail(kind: str, where: str, e: OmegaConfBaseException, schema: type, hint: str,
          renamed: Callable[[str], str | None] | None) -> ConfigError:
    """The one line for OmegaConf's error ``e`` merging a node at ``where`` (``""``: the top) of ``kind``'s config."""
    msg = str(getattr(e, "msg", None) or e).strip().splitlines()[0]
    key = str(getattr(e, "full_key", None) or "")
    at = ".".join(p for p in (where, key) if p) or kind
    if isinstance(e, ConfigKeyError) and key:
        *parents, leaf = key.split(".")
        if renamed is not None and (moved := renamed(at)):
            return ConfigError(moved)
        sub = _schema_at(schema, parents)
        if sub is not None:
            hint = unknown_key_hint(leaf, fields_of(sub), ".".join(p for p in (where, *parents) if p))
        return ConfigError(f"invalid {where or kind} config: unknown key {at}; {hint}")
    return ConfigError(f"invalid {where or kind} config at {at}: {msg}")


def merge_schema(schema: type, node: Any, kind: str, where: str = "", hint: str = "",
                 renamed: Callable[[str], str | None] | None = None) -> DictConfig:
    """``node`` merged onto ``schema``'s structured config: an unknown key or a wrong type is a ConfigError
    (``renamed``: the message for a key that was renamed, if any). Returns the merged node (schema defaults filled)."""
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), node)
    except OmegaConfBaseException as e:
        raise _fail(kind, where, e, schema, hint, renamed) from None


# ------------------------------------------------------------------------------------------- trees
# The rule a policy class keeps for its own Python callers, run here on the config's values (one copy of it).
POLICY_RULES: dict[type, tuple[Callable[..., Any], tuple[str, ...]]] = {
    DynamicPolicy: (DynamicPolicy.check_sizes, ("total_tokens", "depth", "top_k", "node_share")),
}


def validate_tree(node: Any, where: str = "tree", kind: str = "generate") -> None:
    """Check a tree-policy node against the schema of its ``_target_`` (unknown targets pass), then against the
    policy class's own rule (:data:`POLICY_RULES`), before any policy is built."""
    if node is None or not isinstance(node, (DictConfig, dict)):
        raise ConfigError(f"invalid {where} config: expected a policy config with a _target_, got {node!r}")
    target = node.get("_target_")
    schema = tree_schema(target)
    if schema is None:
        return
    merged = merge_schema(schema, node, kind, where, f"{target.rsplit('.', 1)[-1]} takes: {', '.join(fields_of(schema))}")
    for cls, (rule, keys) in POLICY_RULES.items():
        if schema is tree_schema(f"{cls.__module__}.{cls.__qualname__}"):
            try:
                given = inspect.signature(cls).parameters  # a key the node leaves out: the class's default (the YAML's)
                rule(**{k: OmegaConf.select(merged, k, throw_on_resolution_failure=False) if k in node
                        else given[k].default for k in keys})
            except TreeError as e:
                raise ConfigError(f"invalid {where} config: {e}") from None
    shape = node.get("shape")
    if isinstance(shape, (DictConfig, dict)):
        merge_schema(ShapeSchema, shape, kind, f"{where}.shape", "a tree shape has `name` and `choices` (a list of paths)")
    if schema is LookupTreeSchema:
        validate_tree(node.get("inner"), f"{where}.inner", kind)


def instantiate_checked(node, where: str | None = None, **kwargs: Any):
    """``hydra.utils.instantiate(node, **kwargs)``, without Hydra's InstantiationException around what a user can
    fix: with ``where`` (a policy or sampling node), a constructor's ValueError becomes a ConfigError naming
    ``where``; a loader's own user error (a missing checkpoint, a bad config.json) is raised as it is, so the
    one-line ``Error:`` stays."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        if where is not None and isinstance(cause, ValueError):
            raise ConfigError(f"invalid {where} config: {cause}") from None
        if isinstance(cause, USER_ERRORS):
            raise cause from None
        raise


# ------------------------------------------------------------------------------------------- values
def value_at(cfg, key: str):
    """The value at dotted ``key`` (None when absent; an interpolation that does not resolve: None)."""
    return OmegaConf.select(cfg, key, throw_on_resolution_failure=False)


def check_rules(cfg, rules: Sequence[tuple[str, Callable[[Any], bool], str]]) -> None:
    """Each ``(key, test, what the value must be)``; None values pass (the schema decides where null is allowed)."""
    for key, ok, need in rules:
        value = value_at(cfg, key)
        if value is not None and not ok(value):
            raise ConfigError(f"{key}={value!r}: must be {need}")


def at_least(n: float) -> Callable[[Any], bool]:
    return lambda v: v >= n


def check_dtype(cfg, key: str) -> None:
    """``key`` names a dtype :func:`~treedec.models.checkpoint.resolve_dtype` knows (null passes)."""
    value = value_at(cfg, key)
    if value is not None:
        try:
            resolve_dtype(value)
        except ValueError as e:
            raise ConfigError(f"invalid {key}: {e}") from None


def check_model(cfg, kind: str) -> None:
    """The model group: a known device and dtype, a kernel backend this machine runs, and the draft group's
    quantization (each by the one function its loader uses)."""
    backend = value_at(cfg, "model.attn_backend")
    if backend is not None and backend not in KERNEL_BACKENDS:
        raise ConfigError(f"invalid {kind} config: model.attn_backend={backend!r}; "
                          f"choose one of {', '.join(KERNEL_BACKENDS)} (or kernel=<one of them>)")
    try:
        resolve_device(value_at(cfg, "model.device"))
    except ValueError as e:
        raise ConfigError(f"invalid model.device: {e}") from None
    check_dtype(cfg, "model.dtype")
    _check_triton(backend, value_at(cfg, "model.device"))
    quantize = value_at(cfg, "draft.quantize")
    try:
        check_quantize(quantize)
    except ValueError as e:
        raise ConfigError(f"invalid {kind} config: {e}") from None


def _check_triton(backend: Any, device: Any) -> None:
    """The Triton kernel runs on CUDA tensors, or on CPU ones only in Triton's interpreter (``TRITON_INTERPRET=1``,
    read when the kernel is defined): refused here, not with a RuntimeError at the first decoding step."""
    if backend != "triton" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ConfigError(f"model.attn_backend=triton (kernel=triton) runs on CUDA, and model.device is {dev.type}: "
                          f"use kernel=sdpa or kernel=auto on a CPU, or set TRITON_INTERPRET=1 in the environment "
                          f"to run the Triton kernel in its (slow) interpreter")


# ------------------------------------------------------------------- required keys and output paths
# What to pass for a key a config group leaves unset (``???``), e.g. draft.path after draft=path.
REQUIRED_HINTS: dict[str, str] = {
    "model.path": "DIR (a local Hugging Face model directory, or tiny-code)",
    "draft.path": "DIR (a draft head directory, e.g. the export of python -m treedec.train)",
    "tree.path": "FILE (the learned_tree.yaml that python -m treedec.calibrate wrote)",
    "data.path": "FILE (a .jsonl of {\"text\": ...} lines or chats)",
    "input": "FILE (a .jsonl of {\"text\": ...} lines or chats)",
    "out": "DIR (the directory to create)",
}


def missing_keys(node: Any, prefix: str = "") -> list[str]:
    """The full keys of ``node`` left ``???`` (interpolations are not resolved; the ``hydra`` node is skipped)."""
    if not isinstance(node, (DictConfig, ListConfig)) or node._is_none() or node._is_missing():
        return []
    out: list[str] = []
    for key in (node.keys() if isinstance(node, DictConfig) else range(len(node))):
        if not prefix and key == "hydra":
            continue
        child, path = node._get_node(key), f"{prefix}.{key}" if prefix else str(key)
        if child._is_missing():
            out.append(path)
        elif isinstance(child, (DictConfig, ListConfig)) and not child._is_interpolation():
            out += missing_keys(child, path)
    return out


def group_choices(cfg: Any = None) -> dict[str, str]:
    """Hydra's config-group choices of this job (``draft`` -> ``path``), from ``cfg.hydra`` or the running job."""
    node = OmegaConf.select(cfg, "hydra.runtime.choices") if isinstance(cfg, DictConfig) else None
    if node is None:
        node = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    return {str(k): str(v) for k, v in dict(node).items() if v is not None}


def required_error(key: str, choices: dict[str, str] | None = None) -> ConfigError:
    """``<key> is required with <group>=<choice>: pass <key>=<what>``, the one line for an unset ``???`` key."""
    group = key.split(".", 1)[0]
    choice = (choices or {}).get(group) if "." in key else None
    leaf = key.rsplit(".", 1)[-1]
    hint = REQUIRED_HINTS.get(key) or (REQUIRED_HINTS.get(f"tree.{leaf}") if ".trees." in key else None) or "VALUE"
    return ConfigError(f"{key} is required{f' with {group}={choice}' if choice else ''}: pass {key}={hint}")


def check_required(cfg: DictConfig) -> None:
    """A key left ``???`` (``draft=path`` without ``draft.path``) is one clear error before anything loads,
    not OmegaConf's MissingMandatoryValue traceback when the key is first read."""
    missing = missing_keys(cfg)
    if missing:
        raise required_error(missing[0], group_choices(cfg))


def check_out_path(path: Any, key: str, is_dir: bool = True) -> None:
    """An output ``path`` that cannot be written fails now, naming ``key``, not with an OSError after the work:
    a directory to create or fill (``is_dir``; a file to write otherwise) must not be a file (a directory),
    nor lie below a file."""
    if path is None or "${" in str(path):
        return
    p = Path(str(path)).expanduser()
    if p.exists() and p.is_dir() != is_dir:
        what, want = ("a file", "a directory") if is_dir else ("a directory", "the path of a file to write")
        raise ConfigError(f"{key}={str(path)!r} is {what}; pass {want}")
    above = next((q for q in p.parents if q.exists()), None)
    if above is not None and not above.is_dir():
        raise ConfigError(f"{key}={str(path)!r} lies below {above}, which is a file; pass a path outside it")


def plain(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` without the ``hydra`` node, interpolations unresolved (what the schemas are merged with)."""
    node = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    node.pop("hydra", None)
    return node
