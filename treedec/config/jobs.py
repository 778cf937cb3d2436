"""The checks of the ``treedec.train`` / ``treedec.pretrain`` configs, before any data, model or training step (a
typo must not run with defaults, and a bad ``export_dtype`` must not fail after an hour of training).

* Keys and types: the plain groups merge onto :mod:`treedec.config.job_schema` (the same structured-schema merge
  as every command's); ``draft_arch`` and ``model_arch`` onto a schema made from
  :class:`~treedec.heads.config.DraftConfig` and :class:`~treedec.models.config.LlamaConfig`; the instantiated
  groups (``data``, ``trainer``, ``module``, ``logger.*``, ``callbacks.*`` and nested ``_target_`` nodes) take the
  arguments of their ``_target_``'s signature (anything, if it takes ``**kwargs``).
* Values: dtypes, counts, ``trainer.max_time``, ``requeue``, a GPU trainer on a machine without one, the export
  target, the target / tokenizer paths, and the head options against ``init_from`` (:mod:`.draft_arch`).

Lightning is imported on first use (the GPU check): it takes seconds, and every command imports this layer.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib
import inspect
import typing
from pathlib import Path
from typing import Any, Callable

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from treedec.config.checks import check_dtype, check_out_path, merge_schema, unknown_key_hint, value_at
from treedec.config.draft_arch import check_draft_arch
from treedec.config.renamed import renamed
from treedec.data.tokenizer_train import tokenizer_file
from treedec.errors import ConfigError
from treedec.heads.config import BUNDLED_HEAD, DraftConfig
from treedec.models.checkpoint import resolve_path
from treedec.models.config import LlamaConfig, check_sizes
from treedec.models.paths import bundled_dir, export_path

HYDRA_KEYS = ("_target_", "_recursive_", "_convert_", "_partial_", "_args_")
REQUEUE = ("auto", "submitit", "lightning", "none")


def seconds(max_time) -> float:
    """Lightning's max_time "DD:HH:MM:SS" (or a dict of timedelta kwargs) in seconds."""
    if isinstance(max_time, str):
        d, h, m, sec = (int(x) for x in max_time.split(":"))
        return float(((d * 24 + h) * 60 + m) * 60 + sec)
    return datetime.timedelta(**dict(max_time)).total_seconds()


# ------------------------------------------------------------------------------------------- keys
def schema_of(cls: type, extra: tuple[str, ...] = ()) -> type:
    """The fields of dataclass ``cls`` (plus ``extra``, untyped) as a structured schema to merge a group onto: each
    field typed where OmegaConf can type it (a union of containers it cannot: any value), none required."""
    hints = typing.get_type_hints(cls)
    fields: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        try:
            OmegaConf.structured(dataclasses.make_dataclass("Probe", [(f.name, hint, dataclasses.field(default=MISSING))]))
        except OmegaConfBaseException:
            hint = Any
        fields.append((f.name, hint, dataclasses.field(default=MISSING)))
    fields += [(name, Any, dataclasses.field(default=None)) for name in extra]
    return dataclasses.make_dataclass(cls.__name__, fields)


DRAFT_ARCH_SCHEMA = schema_of(DraftConfig)
MODEL_ARCH_SCHEMA = schema_of(LlamaConfig, extra=("asset_name",))


def _unknown(keys, known: list[str], group: str) -> None:
    for key in keys:
        if key not in known:
            raise ConfigError(f"unknown key {group}.{key}; {unknown_key_hint(str(key), known, group)}")


def _signature_keys(target: str, where: str) -> list[str] | None:
    """Keyword arguments the ``_target_`` callable takes (None: it takes ``**kwargs``, anything goes)."""
    module, _, name = str(target).rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{where}._target_={target!r} cannot be imported ({e}); check the class name") from None
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_instantiated(node: Any, group: str) -> None:
    """An instantiated node's keys against its ``_target_``'s arguments, recursively through nested targets."""
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            check_instantiated(item, f"{group}[{i}]")
        return
    if not isinstance(node, DictConfig):
        return
    target = node.get("_target_") if "_target_" in node else None
    if target is not None:
        known = _signature_keys(target, group)
        if known is not None:
            _unknown([k for k in node.keys() if k not in HYDRA_KEYS], known, group)
    for key in node.keys():
        if key not in HYDRA_KEYS:
            check_instantiated(node._get_node(key), f"{group}.{key}")


def check_named_targets(node: Any, group: str) -> None:
    """``logger`` / ``callbacks``: a mapping name -> config with a ``_target_`` (or null)."""
    if node is None:
        return
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{group} must be a mapping name -> {{_target_: ..., ...}}, not {node!r}")
    for name in node.keys():
        item = node._get_node(name)
        if isinstance(item, DictConfig) and "_target_" not in item:
            raise ConfigError(f"{group}.{name} has no _target_: give the class to instantiate, "
                              f"e.g. +{group}.{name}={{_target_:lightning.pytorch.callbacks.LearningRateMonitor}}")
        check_instantiated(item, f"{group}.{name}")


def check_job_keys(node: DictConfig, kind: str) -> None:
    """The groups the plain schema merge leaves open: the architecture and the instantiated groups."""
    if kind == "train":
        arch = node.get("draft_arch") or {}
        merge_schema(DRAFT_ARCH_SCHEMA, {k: v for k, v in arch.items() if not (k == "feature_layers" and v is None)},
                     kind, "draft_arch", f"Keys of draft_arch: {', '.join(DRAFT_ARCH_SCHEMA.__dataclass_fields__)}")
    else:
        merge_schema(MODEL_ARCH_SCHEMA, node.get("model_arch") or {}, kind, "model_arch",
                     f"Keys of model_arch: {', '.join(MODEL_ARCH_SCHEMA.__dataclass_fields__)}")
    try:
        for group in ("data", "trainer", "module"):
            check_instantiated(node._get_node(group), group)
        for group in ("logger", "callbacks"):
            check_named_targets(node._get_node(group) if group in node else None, group)
    except ConfigError as e:
        raise ConfigError(f"invalid {kind} config: {e}") from None


def renamed_in(kind: str) -> Callable[[str], str | None]:
    return lambda key: renamed(key, kind)


# ----------------------------------------------------------------------------------------- values
def _get(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, throw_on_missing=True)
    except Exception as e:
        raise ConfigError(f"{key}: {' '.join(str(e).split())}") from None


def _at_least(cfg: DictConfig, key: str, low: int, what: str = "") -> None:
    v = _get(cfg, key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < low):
        raise ConfigError(f"{key}={v!r} must be a number >= {low}{what}")


def check_accelerator(cfg: DictConfig) -> None:
    """A GPU trainer (``trainer=gpu | ddp | fsdp``) on a machine without one is one clear error before any data or
    model loads (Lightning would say "No supported gpu backend found!" with a traceback, after both)."""
    # (Lightning is imported here, not at the top: generate and bench, which import this layer too, never need it)
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    acc = str(value_at(cfg, "trainer.accelerator") or "auto")
    needs = {"gpu": (CUDAAccelerator, MPSAccelerator), "cuda": (CUDAAccelerator,), "mps": (MPSAccelerator,)}
    if acc in needs and not any(a.is_available() for a in needs[acc]):
        raise ConfigError(f"trainer.accelerator={acc} needs a GPU, and this machine has none that Lightning can use "
                          f"(no {acc if acc != 'gpu' else 'CUDA or MPS'} device): run on the CPU with "
                          f"trainer.accelerator=cpu (trainer=cpu for one process; trainer=ddp trainer.accelerator=cpu "
                          f"trainer.devices=2 for DDP over CPU processes)")


def check_common(cfg: DictConfig, kind: str) -> None:
    for key in ("export_dtype",) + (("model.dtype",) if kind == "train" else ()):
        check_dtype(cfg, key)
    for key in ("num_threads", "ckpt_every_n_steps", "log_every"):
        _at_least(cfg, key, 1)
    if _get(cfg, "requeue") not in REQUEUE:
        raise ConfigError(f"requeue={_get(cfg, 'requeue')!r}; choose one of {', '.join(REQUEUE)}")
    trainer = cfg.get("trainer")
    if not isinstance(trainer, DictConfig) or "_target_" not in trainer:
        raise ConfigError("trainer must be a Trainer config (trainer=cpu | gpu | ddp | fsdp)")
    steps = _get(cfg, "trainer.max_steps")
    if steps is not None and steps != -1:
        _at_least(cfg, "trainer.max_steps", 1, " (or -1: no step limit)")
    max_time = _get(cfg, "trainer.max_time")
    if max_time is not None:
        try:
            if seconds(max_time) <= 0:
                raise ValueError
        except (ValueError, TypeError):
            raise ConfigError(f"trainer.max_time={max_time!r} is not a positive duration \"DD:HH:MM:SS\" "
                              f"(or null: no time cap)") from None
    budget = _get(cfg, "optim.time_budget_s")
    if budget not in (None, "auto") and (isinstance(budget, (str, bool)) or budget <= 0):
        raise ConfigError(f"optim.time_budget_s={budget!r} must be auto (trainer.max_time - 60 s), "
                          f"a number of seconds > 0, or null (steps only)")
    _at_least(cfg, "data.seq_len", 1)
    _at_least(cfg, "data.batch_size", 1)
    check_accelerator(cfg)


def check_train(cfg: DictConfig) -> None:
    draft = _get(cfg, "draft_arch") or {}
    _at_least(cfg, "optim.unroll", 1, " (null: 3 for eagle3, 1 for eagle)")
    if "target" in draft:
        raise ConfigError("draft_arch.target is set from model.path; drop draft_arch.target")
    for key in ("eval.n_prompts", "eval.prompt_tokens", "eval.max_new_tokens"):
        _at_least(cfg, key, 1)
    _at_least(cfg, "eval.every_n_steps", 0, " (0: only at the end)")
    target = _get(cfg, "model.path")
    try:
        resolve_path(target)
    except FileNotFoundError as e:
        raise ConfigError(f"model.path={target}: {e}") from None
    # the kind, block and feature layers against init_from's head (any head draft.path accepts) and the target
    check_draft_arch(draft, _get(cfg, "init_from"), target)
    tok = _get(cfg, "paths.tokenizer")
    if tok is not None and not Path(tok).expanduser().is_file():
        raise ConfigError(f"paths.tokenizer={tok} is not a file; the head trains on the target's own tokenizer "
                          f"(null: the target's tokenizer.json)")
    if _get(cfg, "export_dir") == "bundled" and str(target) != "tiny-code":
        raise ConfigError(f"export_dir=bundled replaces the head shipped for tiny-code, but model.path={target}; "
                          f"export a head for another target to a directory of its own")
    _check_export(cfg, BUNDLED_HEAD[draft.get("kind", "eagle")])


def check_pretrain(cfg: DictConfig) -> None:
    arch = dict(_get(cfg, "model_arch"))
    name = arch.pop("asset_name", None)
    try:
        check_sizes(arch)
        conf = LlamaConfig(**arch)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid model_arch: {e}") from None
    seq = _get(cfg, "data.seq_len")
    if isinstance(seq, int) and seq > conf.max_position_embeddings:
        raise ConfigError(f"data.seq_len={seq} exceeds model_arch.max_position_embeddings="
                          f"{conf.max_position_embeddings}; lower data.seq_len or raise the context")
    try:
        tokenizer_file(_get(cfg, "paths.tokenizer"))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if _get(cfg, "export_dir") == "bundled" and not name:
        raise ConfigError("export_dir=bundled writes treedec/assets/<model_arch.asset_name>, and this model_arch "
                          "has no asset_name; export to a directory instead")
    _check_export(cfg, name or "tiny-code")


def _check_export(cfg: DictConfig, asset: str) -> None:
    try:
        export = export_path(_get(cfg, "export_dir"), bundled_dir(asset))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if export is not None and _get(cfg, "export_dir") != "bundled":
        check_out_path(_get(cfg, "export_dir"), "export_dir")


JOB_CHECKS: dict[str, Callable[[DictConfig], None]] = {"train": check_train, "pretrain": check_pretrain}
