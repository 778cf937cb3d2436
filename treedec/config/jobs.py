"""Start-up checks of the ``treedec.train`` / ``treedec.pretrain`` configs: every key known, every
value usable, before any data, model or training step (a typo must not run with defaults, and a
bad ``export_dtype`` must not fail after an hour of training).

* Keys: the plain groups (top level, ``optim``, ``eval``, ``paths``) have a schema here; the
  ``draft`` and ``model_arch`` groups are :class:`~treedec.heads.head.DraftConfig` and
  :class:`~treedec.models.config.LlamaConfig` fields; the instantiated groups (``data``,
  ``trainer``, ``logger.*``, ``callbacks.*`` and nested ``_target_`` nodes) take the arguments of
  their ``_target_``'s signature (anything, if it takes ``**kwargs``). An unknown key is a
  :class:`~treedec.errors.ConfigError` whose hint lists the keys of that group.
* Types of the plain groups, and values: dtypes (one resolver, ``treedec.models.checkpoint.resolve_dtype``),
  counts, ``trainer.max_time``, ``requeue``, the export target, the target / tokenizer paths.

``treedec.cli.entry`` prints a ConfigError as one ``Error: ...`` line.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from treedec.config_checks import check_out_path, check_required, unknown_key_hint
from treedec.config.schema import ModelSchema
from treedec.errors import ConfigError, renamed

HYDRA_KEYS = ("_target_", "_recursive_", "_convert_", "_partial_", "_args_")
REQUEUE = ("auto", "submitit", "lightning", "none")


@dataclass
class EvalSchema:
    n_prompts: int = 6
    prompt_tokens: int = 96
    max_new_tokens: int = 64
    every_n_steps: int = 200


@dataclass
class DraftOptimSchema:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    feature_noise: float = 0.1
    w_feat: float = 1.0
    w_ce: float = 0.1
    time_budget_s: Any = "auto"
    unroll: Optional[int] = None  # training-time test steps (None: 3 for eagle3, 1 for eagle)


@dataclass
class LMOptimSchema:
    lr: float = 2e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    init_std: float = 0.02
    use_cache_path: bool = False
    time_budget_s: Any = "auto"


@dataclass
class TrainPathsSchema:  # conf/paths/default.yaml + the tokenizer
    root_dir: str = MISSING
    data_dir: str = MISSING
    output_dir: str = MISSING
    run_dir: str = MISSING
    tokenizer: Optional[str] = MISSING


@dataclass
class PretrainPathsSchema(TrainPathsSchema):
    tokenizer: str = MISSING


@dataclass
class JobSchema:
    """Keys both jobs share."""
    seed: int = 0
    num_threads: int = 2
    export_dir: Optional[str] = MISSING
    export_dtype: str = "bfloat16"
    ckpt_every_n_steps: int = 100
    log_every: int = 10
    requeue: str = "auto"
    callbacks: Any = MISSING  # name -> callback config (checked by _target_)
    logger: Any = MISSING  # name -> logger config (checked by _target_)
    data: Any = MISSING  # checked by _target_
    trainer: Any = MISSING  # checked by _target_
    module: Any = MISSING  # the LightningModule (conf/module), checked by _target_


@dataclass
class TrainSchema(JobSchema):
    model: Any = MISSING  # the frozen target (conf/model: _target_, path, dtype, device, attn_backend)
    draft_arch: Any = MISSING  # DraftConfig overrides: the head to train
    init_from: Optional[str] = None
    draft_vocab_size: int = 0  # > 0: export with the training data's K most frequent tokens as draft vocabulary
    optim: DraftOptimSchema = field(default_factory=DraftOptimSchema)
    eval: EvalSchema = field(default_factory=EvalSchema)
    paths: TrainPathsSchema = field(default_factory=TrainPathsSchema)


@dataclass
class PretrainSchema(JobSchema):
    model_arch: Any = MISSING  # LlamaConfig fields + asset_name
    optim: LMOptimSchema = field(default_factory=LMOptimSchema)
    paths: PretrainPathsSchema = field(default_factory=PretrainPathsSchema)


# ------------------------------------------------------------------------------------------- keys
def _unknown(keys, known: list[str], group: str) -> None:
    for key in keys:
        if key not in known:
            where = f"{group}.{key}" if group else str(key)
            moved = None if group else renamed(where, "train")
            if moved:
                raise ConfigError(moved)
            raise ConfigError(f"unknown key {where}; {unknown_key_hint(str(key), known, group)}")


def _matches(value: Any, hint: Any) -> bool:
    """Whether a resolved config value fits a type hint (int, float, bool, str, Optional/Union, List, dict)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        args = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return len(args) != 1 or all(_matches(v, args[0]) for v in value)
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    return True  # other classes: left to the code that uses them


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "") if not isinstance(hint, type) else hint.__name__


def _value(node: DictConfig, key: str) -> Any:
    try:
        v = node[key]
    except Exception as e:  # an interpolation that does not resolve
        raise ConfigError(f"{key}: {' '.join(str(e).split())}") from None
    return OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) else v


def check_fields(node: DictConfig | dict, schema: type, group: str = "", *, extra: tuple[str, ...] = ()) -> None:
    """Keys of ``node`` against the fields of dataclass ``schema`` (plus ``extra``), and the types of
    its values; nested dataclass fields are checked in turn."""
    if node is None:
        return
    if not isinstance(node, (DictConfig, dict)):
        raise ConfigError(f"{group or 'the config'} must be a mapping of keys, not {node!r}")
    node = node if isinstance(node, DictConfig) else OmegaConf.create(node)
    hints = typing.get_type_hints(schema)
    known = [f.name for f in dataclasses.fields(schema)] + list(extra)
    _unknown(node.keys(), known, group)
    for key in node.keys():
        if key not in hints:
            continue
        where = f"{group}.{key}" if group else str(key)
        hint = hints[key]
        if hint is Any:
            continue
        if dataclasses.is_dataclass(hint):
            check_fields(node[key], hint, where)
            continue
        value = _value(node, key)
        if not _matches(value, hint):
            raise ConfigError(f"{where}={value!r} is not {_type_name(hint)}")


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
            keys = [k for k in node.keys() if k not in HYDRA_KEYS]
            _unknown(keys, known, group)
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


def _check_common(cfg: DictConfig, kind: str) -> None:
    from treedec.models.checkpoint import resolve_dtype
    from treedec.training.schedule import seconds

    for key in ("export_dtype",) + (("model.dtype",) if kind == "train" else ()):
        try:
            resolve_dtype(_get(cfg, key))
        except ValueError as e:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: {e}") from None
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


def _check_train(cfg: DictConfig) -> None:
    from treedec.models.checkpoint import resolve_path
    from treedec.heads.head import DraftConfig
    from treedec.training.draft_arch_checks import check_draft_arch

    draft = _get(cfg, "draft_arch") or {}
    check_fields({k: v for k, v in draft.items() if not (k == "feature_layers" and v is None)}, DraftConfig,
                 "draft_arch")
    _at_least(cfg, "optim.unroll", 1, " (null: 3 for eagle3, 1 for eagle)")
    if "target" in draft:
        raise ConfigError("draft_arch.target is set from model.path; drop draft_arch.target")
    for key in ("eval.n_prompts", "eval.prompt_tokens", "eval.max_new_tokens"):
        _at_least(cfg, key, 1)
    _at_least(cfg, "eval.every_n_steps", 0, " (0: only at the end)")
    check_fields(_get(cfg, "model"), ModelSchema, "model")
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
    _check_export(cfg, {"eagle3": "tiny-code-eagle3", "parallel": "tiny-code-parallel"}.get(draft.get("kind"),
                                                                                              "tiny-code-eagle"))


def _check_pretrain(cfg: DictConfig) -> None:
    from treedec.models.config import LlamaConfig

    arch = _get(cfg, "model_arch")
    check_fields(arch, LlamaConfig, "model_arch", extra=("asset_name",))
    arch = dict(arch)
    name = arch.pop("asset_name", None)
    try:
        conf = LlamaConfig(**arch)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid model_arch: {e}") from None
    if conf.vocab_size < 1 or conf.hidden_size < 1 or conf.num_hidden_layers < 1:
        raise ConfigError("model_arch: vocab_size, hidden_size and num_hidden_layers must be >= 1")
    seq = _get(cfg, "data.seq_len")
    if isinstance(seq, int) and seq > conf.max_position_embeddings:
        raise ConfigError(f"data.seq_len={seq} exceeds model_arch.max_position_embeddings="
                          f"{conf.max_position_embeddings}; lower data.seq_len or raise the context")
    from treedec.data.tokenizer_train import tokenizer_file

    try:
        tokenizer_file(_get(cfg, "paths.tokenizer"))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if _get(cfg, "export_dir") == "bundled" and not name:
        raise ConfigError("export_dir=bundled writes treedec/assets/<model_arch.asset_name>, and this model_arch "
                          "has no asset_name; export to a directory instead")
    _check_export(cfg, name or "tiny-code")


def _check_export(cfg: DictConfig, asset: str) -> None:
    from treedec.models.paths import bundled_dir, export_path

    try:
        export = export_path(_get(cfg, "export_dir"), bundled_dir(asset))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_out_path(OmegaConf.select(cfg, "paths.run_dir", throw_on_resolution_failure=False), "paths.run_dir")
    if export is not None and _get(cfg, "export_dir") != "bundled":
        check_out_path(_get(cfg, "export_dir"), "export_dir")


def check_job_config(cfg: DictConfig, kind: str) -> None:
    """Raise :class:`ConfigError` unless the composed ``train`` / ``pretrain`` config is fully valid.

    Cheap and side-effect free: reads config files (the target's, the tokenizer path) but loads
    no model and no data.
    """
    schema = {"train": TrainSchema, "pretrain": PretrainSchema}[kind]
    check_required(cfg)
    node = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    node.pop("hydra", None)
    try:
        check_fields(node, schema)
        check_instantiated(node._get_node("data"), "data")
        check_instantiated(node._get_node("trainer"), "trainer")
        check_instantiated(node._get_node("module"), "module")
        check_named_targets(node._get_node("logger") if "logger" in node else None, "logger")
        check_named_targets(node._get_node("callbacks") if "callbacks" in node else None, "callbacks")
    except ConfigError as e:
        raise ConfigError(f"invalid {kind} config: {e}") from None
    _check_common(cfg, kind)
    (_check_train if kind == "train" else _check_pretrain)(cfg)


__all__ = ["PretrainSchema", "TrainSchema", "check_fields", "check_instantiated", "check_job_config"]
