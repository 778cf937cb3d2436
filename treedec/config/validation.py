""":func:`validate`, the one check every entry point runs on its composed config, once, before any model loads.

It merges the config once onto its command's structured schema (:mod:`.schema`, :mod:`.job_schema`: unknown keys
with the closest match, wrong types), checks each tree node by its ``_target_`` and its policy's own rule, the model
group, keys left ``???`` and output paths (:mod:`.checks`), then the command's combinations (:mod:`.commands`,
:mod:`.bench`, :mod:`.jobs`). Every mistake is one :class:`~treedec.errors.ConfigError` line naming the key and
the fix; the config is never changed.
"""
from __future__ import annotations

from typing import Any, Callable

from omegaconf import DictConfig

from treedec.config.bench import check_bench
from treedec.config.checks import (
    check_model,
    check_out_path,
    check_required,
    fields_of,
    merge_schema,
    plain,
    validate_tree,
    value_at,
)
from treedec.config.commands import CHECKS, OUT_PATHS
from treedec.config.job_schema import JOB_SCHEMAS
from treedec.config.jobs import JOB_CHECKS, check_common, check_job_keys, renamed_in
from treedec.config.schema import SCHEMAS


def _check_job(kind: str) -> Callable[[Any], None]:
    def check(cfg) -> None:
        check_common(cfg, kind)
        JOB_CHECKS[kind](cfg)
    return check


COMMANDS: dict[str, tuple[type, Callable[[Any], None]]] = {  # command -> (its schema, its combination checks)
    **{kind: (schema, CHECKS[kind]) for kind, schema in SCHEMAS.items() if kind in CHECKS},
    "bench": (SCHEMAS["bench"], check_bench),
    **{kind: (schema, _check_job(kind)) for kind, schema in JOB_SCHEMAS.items()},
}


def validate(cfg: DictConfig, kind: str) -> None:
    """Raise :class:`~treedec.errors.ConfigError` if the composed config of command ``kind`` (generate, calibrate,
    export_head, regenerate, bench, train, pretrain) has an unset required key, an unknown key, a value of the
    wrong type or out of range, an unknown kernel backend or device, an output path below a file, or a file it
    reads that cannot be read: every option is checked before any model loads."""
    if kind not in COMMANDS:
        raise ValueError(f"unknown command {kind!r}; known: {', '.join(COMMANDS)}")
    schema, check_command = COMMANDS[kind]
    check_required(cfg)
    node = plain(cfg)
    merge_schema(schema, node, kind, "", f"Known top-level keys: {', '.join(fields_of(schema))} "
                                         "(a new key belongs in treedec/config/schema.py too)", renamed_in(kind))
    for group in ("tree", "probe"):
        if group in node and group in schema.__dataclass_fields__:
            validate_tree(node[group], group, kind)
    if kind in JOB_SCHEMAS:
        check_job_keys(node, kind)
    if "model" in node:
        check_model(cfg, kind)
    for key, is_dir in [("paths.run_dir", True), *OUT_PATHS.get(kind, [])]:
        check_out_path(value_at(cfg, key), key, is_dir)
    check_command(cfg)


__all__ = ["COMMANDS", "validate"]
