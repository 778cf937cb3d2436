"""The config check every entry point runs first (:func:`validate`), and the one ``instantiate`` wrapper.

:func:`validate` checks a composed config against the schemas of :mod:`treedec.config.schema` (``+key=...``
appends pass Hydra, so this is where they are caught, with the keys of the group meant and the closest match),
checks the node of a ``tree`` (or ``probe``, or ``bench.trees.*``) group by its ``_target_`` (a policy class of
your own is left alone), and checks values: ranges, the device and dtype, prompt files (readable text,
well-formed JSON lines, unique ids), learned-tree paths, keys left ``???``, output paths below a file. Each
entry's ``run`` calls it first (once per job, multirun jobs included), so every mistake is a clear error before
any model loads. :func:`instantiate_checked` builds a config node with the errors a user can act on kept whole.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from treedec.config.schema import (KERNEL_BACKENDS, SCHEMAS, DynamicTreeSchema, LookupTreeSchema, ShapeSchema,
                                   tree_schema)
from treedec.errors import USER_ERRORS, ConfigError


# ------------------------------------------------------------------------------------------ checks
def _fields(schema: type) -> list[str]:
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


def _fail(where: str, e: OmegaConfBaseException, schema: type, hint: str) -> ConfigError:
    msg = str(getattr(e, "msg", None) or e).strip().splitlines()[0]
    key = getattr(e, "full_key", None)
    at = f"{where}.{key}" if key and where not in SCHEMAS else (key or where)
    if isinstance(e, ConfigKeyError) and key:
        *parents, leaf = str(key).split(".")
        sub = _schema_at(schema, parents)
        if sub is not None:
            group = ".".join(([] if where in SCHEMAS else [where]) + parents)
            hint = unknown_key_hint(leaf, _fields(sub), group)
    return ConfigError(f"invalid {where} config at {at}: {msg}. {hint}")


def _merge(schema: type, node, where: str, hint: str) -> None:
    try:
        OmegaConf.merge(OmegaConf.structured(schema), node)
    except OmegaConfBaseException as e:
        raise _fail(where, e, schema, hint) from None


def validate_tree(node, where: str = "tree") -> None:
    """Check a tree-policy node against the schema of its ``_target_`` (unknown targets pass)."""
    if node is None or not isinstance(node, (DictConfig, dict)):
        raise ConfigError(f"invalid {where} config: expected a policy config with a _target_, got {node!r}")
    target = node.get("_target_")
    schema = tree_schema(target)
    if schema is None:
        return
    _merge(schema, node, where, f"{target.rsplit('.', 1)[-1]} takes: {', '.join(_fields(schema))}")
    total = node.get("total_tokens")
    if schema is DynamicTreeSchema and total == "auto":
        raise ConfigError(f"{where}.total_tokens=auto is now its own policy: pass tree=auto (sized per step)")
    if schema is DynamicTreeSchema and (isinstance(total, bool) or not isinstance(total, int)):
        raise ConfigError(f"invalid {where}.total_tokens={total!r}: a tree size (int, root included)")
    shape = node.get("shape")
    if isinstance(shape, (DictConfig, dict)):
        _merge(ShapeSchema, shape, f"{where}.shape", "a tree shape has `name` and `choices` (a list of paths)")
    if schema is LookupTreeSchema:
        validate_tree(node.get("inner"), f"{where}.inner")


def instantiate_checked(node, where: str | None = None, **kwargs: Any):
    """``hydra.utils.instantiate(node, **kwargs)``, without Hydra's InstantiationException around what a user can
    fix: with ``where`` (a policy or sampling node), a constructor's ValueError becomes a ConfigError naming
    ``where``; a loader's own user error (a missing checkpoint, a bad config.json) is raised as it is, so the
    one-line ``Error:`` stays."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        if where is not None and isinstance(cause, ValueError):
            raise ConfigError(f"invalid {where} config: {cause}") from None
        if isinstance(cause, USER_ERRORS):
            raise cause from None
        raise


# Value rules: (key, test, what the value must be). None values pass (the schema decides where null is allowed).
def _ge(n: float):
    return lambda v: v >= n


_RULES: dict[str, list[tuple[str, Any, str]]] = {
    "generate": [("max_new_tokens", _ge(0), ">= 0"), ("num_threads", _ge(1), ">= 1 (or null: torch's default)")],
    "calibrate": [
        ("max_new_tokens", _ge(1), ">= 1 (the probe needs decoding steps)"),
        ("num_threads", _ge(1), ">= 1 (or null: torch's default)"),
        ("prompts.n", _ge(1), ">= 1 (how many calibration prompts)"), ("prompts.prompt_tokens", _ge(1), ">= 1"),
        ("prompts.val_fraction", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("dp.max_budget", _ge(2), ">= 2 (T counts the root: a tree needs the root and one draft node)"),
        ("dp.max_depth", _ge(1), ">= 1"), ("dp.max_width", _ge(1), ">= 1 (or null: the probe's ranks)"),
        ("dp.prior_strength", _ge(0), ">= 0"), ("calibration.prior_strength", _ge(0), ">= 0"),
        ("calibration.map", lambda v: v in ("power", "isotonic"), "power or isotonic"),
        ("timing.repeats", _ge(1), ">= 1"), ("timing.warmup", _ge(0), ">= 0"), ("timing.prefix_len", _ge(1), ">= 1"),
    ],
    "export_head": [],
    "bench": [
        ("bench.n_prompts", _ge(1), ">= 1"), ("bench.prompt_tokens", _ge(1), ">= 1"),
        ("bench.max_new_tokens", _ge(1), ">= 1"),
        ("bench.repeats", _ge(1), ">= 1 (timed passes; the median is reported)"),
        ("bench.warmup", _ge(0), ">= 0"), ("bench.num_threads", _ge(1), ">= 1 (or null: torch's current count)"),
        ("bench.tie_ulps", _ge(0), ">= 0"), ("bench.prompt_lookup_num_tokens", _ge(1), ">= 1"),
        ("bench.batch_mode", lambda v: v in ("continuous", "static"),
         "continuous (a queue of prompts through b slots) or static (full batches of b)"),
    ],
}
OPTIMIZABLE = ("tau", "tokens_per_s", "new_tokens", "steps", "prompt_tokens")  # numeric metrics.json keys of generate
CALIBRATE_SOURCES = ("heldout", "third_party", "file")


def value_at(cfg, key: str):
    """The value at dotted ``key`` (None when absent; an interpolation that does not resolve: None)."""
    return OmegaConf.select(cfg, key, throw_on_resolution_failure=False)


def _check_triton(backend: Any, device: Any) -> None:
    """The Triton kernel runs on CUDA tensors, or on CPU ones only in Triton's interpreter (``TRITON_INTERPRET=1``,
    read when the kernel is defined): refused here, not with a RuntimeError at the first decoding step."""
    import os

    from treedec.models.checkpoint import resolve_device

    if backend != "triton" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    try:
        dev = resolve_device(device)
    except ValueError:
        return  # _check_model names the bad device
    if dev.type != "cuda":
        raise ConfigError(f"model.attn_backend=triton (kernel=triton) runs on CUDA, and model.device is {dev.type}: "
                          f"use kernel=sdpa or kernel=auto on a CPU, or set TRITON_INTERPRET=1 in the environment "
                          f"to run the Triton kernel in its (slow) interpreter")


def _check_model(cfg) -> None:
    from treedec.models.checkpoint import resolve_device, resolve_dtype

    for key, fn in (("model.device", resolve_device), ("model.dtype", resolve_dtype)):
        value = value_at(cfg, key)
        try:
            fn(value)
        except ValueError as e:
            raise ConfigError(f"invalid {key}: {e}") from None


def _check_generate(cfg) -> None:
    from treedec.data.prompts import read_text

    if value_at(cfg, "prompt_file") not in (None, "-"):
        read_text(value_at(cfg, "prompt_file"), "prompt_file")
    metric = value_at(cfg, "optimized_metric")
    known = OPTIMIZABLE + (("speedup",) if value_at(cfg, "compare") else ())
    if metric is not None and metric not in known:
        hint = " (speedup needs compare=true)" if metric == "speedup" else ""
        raise ConfigError(f"optimized_metric={metric!r} is not a numeric metric of generate{hint}; "
                          f"choose one of {', '.join(known)}")


def _check_calibrate(cfg) -> None:
    from treedec.data.prompts import read_prompt_file

    source = value_at(cfg, "prompts.source")
    if source not in CALIBRATE_SOURCES:
        raise ConfigError(f"prompts.source={source!r}; choose one of {', '.join(CALIBRATE_SOURCES)}")
    if source == "file":
        if not value_at(cfg, "prompts.file"):
            raise ConfigError("prompts.source=file needs prompts.file=<a .jsonl with one prompt per line, "
                              "or a text file>")
        read_prompt_file(value_at(cfg, "prompts.file"), "prompts.file")
    root = value_at(cfg, "prompts.root")
    if source == "heldout" and root is not None and not Path(root).expanduser().is_dir():
        raise ConfigError(f"prompts.root={root!r} is not a directory; pass a folder of .py files (null: the stdlib)")
    top, depth = value_at(cfg, "dp.max_budget"), value_at(cfg, "dp.max_depth")
    budget, fixed_depth = value_at(cfg, "dp.budget"), value_at(cfg, "dp.depth")
    if budget is not None and not 2 <= budget <= top:
        raise ConfigError(f"dp.budget={budget} must be in [2, dp.max_budget={top}] (or null: chosen by timing)")
    if fixed_depth is not None and not 1 <= fixed_depth <= depth:
        raise ConfigError(f"dp.depth={fixed_depth} must be in [1, dp.max_depth={depth}] (or null: the best)")
    bad = [b for b in (value_at(cfg, "timing.budgets") or []) if not 2 <= b <= top]
    if bad:
        raise ConfigError(f"timing.budgets has {bad[0]}: every budget must be in [2, dp.max_budget={top}]")


def _check_export_head(cfg) -> None:
    from treedec.models.checkpoint import resolve_dtype

    if value_at(cfg, "format") not in ("eagle", "eagle3"):
        raise ConfigError(f"format={value_at(cfg, 'format')!r}; choose eagle (an EAGLE-1/2 head) or eagle3 (an EAGLE-3 head)")
    if value_at(cfg, "dtype") is not None:
        try:
            resolve_dtype(value_at(cfg, "dtype"))
        except ValueError as e:
            raise ConfigError(f"invalid dtype: {e}") from None


# (bench's own options are checked by treedec.bench.config: the benchmark sits above the configs)
_CHECKS = {"generate": _check_generate, "calibrate": _check_calibrate, "bench": lambda cfg: None,
           "export_head": _check_export_head}


def _check_regenerate(cfg) -> None:
    for key, known in (("format", ("auto", "text", "chat")), ("on_error", ("fail", "skip"))):
        if value_at(cfg, key) not in known:
            raise ConfigError(f"{key}={value_at(cfg, key)!r}; choose one of {', '.join(known)}")
    src = value_at(cfg, "input")
    if not src:
        raise ConfigError("input is required: input=<records.jsonl> ({\"text\": ...} lines or chats)")
    if not Path(src).expanduser().is_file():
        raise ConfigError(f"input={src!r} is not a file; pass input=<records.jsonl> ({{\"text\": ...}} lines or chats)")
    if not 0 <= value_at(cfg, "part") < value_at(cfg, "parts"):
        raise ConfigError(f"part={value_at(cfg, 'part')} must be in [0, parts={value_at(cfg, 'parts')})")


_RULES["regenerate"] = [(k, _ge(1), ">= 1") for k in ("prompt_tokens", "max_new_tokens", "batch_size", "shard_size",
                                                       "parts", "num_threads", "slots")]
_CHECKS["regenerate"] = _check_regenerate


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
        from hydra.core.hydra_config import HydraConfig

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


OUT_PATHS: dict[str, list[tuple[str, bool]]] = {  # per entry point: (key, is a directory) of what it writes
    "generate": [], "bench": [], "calibrate": [("out", False)], "export_head": [("out", True)],
    "regenerate": [("out_dir", True)]}


def validate(cfg: DictConfig, kind: str = "generate") -> None:
    """Raise :class:`ConfigError` if ``cfg`` (a composed ``generate``/``calibrate``/``bench`` config) has an
    unset required key, an unknown key, a value of the wrong type or out of range, an unknown kernel backend or
    device, an output path below a file, or a prompt file that cannot be read: every option is checked before
    any model loads."""
    if kind not in SCHEMAS:
        raise ValueError(f"unknown schema {kind!r}; known: {', '.join(SCHEMAS)}")
    check_required(cfg)
    node = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    node.pop("hydra", None)
    _merge(SCHEMAS[kind], node, kind, f"Known top-level keys: {', '.join(_fields(SCHEMAS[kind]))} "
                                      "(a new key belongs in treedec/config/schema.py too)")
    for group in ("tree", "probe"):
        if group in node and group in SCHEMAS[kind].__dataclass_fields__:
            validate_tree(node[group], group)
    from treedec.heads.quantized import QUANTIZE

    quantize = OmegaConf.select(node, "draft.quantize")
    if quantize is not None and quantize not in QUANTIZE:
        raise ConfigError(f"invalid {kind} config: draft.quantize={quantize!r}; choose auto (int8 weights where "
                          "they measure faster), int8 or null (the head's full-precision weights)")
    backend = OmegaConf.select(node, "model.attn_backend")
    if backend is not None and backend not in KERNEL_BACKENDS:
        raise ConfigError(f"invalid {kind} config: model.attn_backend={backend!r}; "
                          f"choose one of {', '.join(KERNEL_BACKENDS)} (or kernel=<one of them>)")
    _check_triton(backend, value_at(cfg, "model.device"))
    for key, ok, need in _RULES[kind]:
        value = value_at(cfg, key)
        if value is not None and not ok(value):
            raise ConfigError(f"{key}={value!r}: must be {need}")
    _check_model(cfg)
    for key, is_dir in [("paths.run_dir", True), *OUT_PATHS[kind]]:
        check_out_path(value_at(cfg, key), key, is_dir)
    _CHECKS[kind](cfg)

