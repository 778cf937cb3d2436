"""The combination checks of ``generate``, ``calibrate``, ``export_head`` and ``regenerate``: ranges, choices,
prompt and input files, and keys that must agree (``dp.budget`` within ``dp.max_budget``), each a one-line
:class:`~treedec.errors.ConfigError` naming the key. :func:`treedec.config.validate` runs them after the schema
merge and the generic checks of :mod:`treedec.config.checks`.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable

from treedec.config.checks import at_least, check_dtype, check_rules, value_at
from treedec.data.prompts import read_prompt_file, read_text
from treedec.errors import ConfigError

OPTIMIZABLE = ("tau", "tokens_per_s", "new_tokens", "steps", "prompt_tokens")  # numeric metrics.json keys of generate
CALIBRATE_SOURCES = ("heldout", "third_party", "file")
THREADS = ("num_threads", at_least(1), ">= 1 (or null: torch's default)")


def check_generate(cfg) -> None:
    check_rules(cfg, [("max_new_tokens", at_least(0), ">= 0"), THREADS])
    if value_at(cfg, "prompt_file") not in (None, "-"):
        read_text(value_at(cfg, "prompt_file"), "prompt_file")
    metric = value_at(cfg, "optimized_metric")
    known = OPTIMIZABLE + (("speedup",) if value_at(cfg, "compare") else ())
    if metric is not None and metric not in known:
        hint = " (speedup needs compare=true)" if metric == "speedup" else ""
        raise ConfigError(f"optimized_metric={metric!r} is not a numeric metric of generate{hint}; "
                          f"choose one of {', '.join(known)}")


_CALIBRATE_RULES = [
    ("max_new_tokens", at_least(1), ">= 1 (the probe needs decoding steps)"), THREADS,
    ("prompts.n", at_least(1), ">= 1 (how many calibration prompts)"), ("prompts.prompt_tokens", at_least(1), ">= 1"),
    ("prompts.val_fraction", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("dp.max_budget", at_least(2), ">= 2 (T counts the root: a tree needs the root and one draft node)"),
    ("dp.max_depth", at_least(1), ">= 1"), ("dp.max_width", at_least(1), ">= 1 (or null: the probe's ranks)"),
    ("dp.prior_strength", at_least(0), ">= 0"), ("calibration.prior_strength", at_least(0), ">= 0"),
    ("calibration.map", lambda v: v in ("power", "isotonic"), "power or isotonic"),
    ("timing.repeats", at_least(1), ">= 1"), ("timing.warmup", at_least(0), ">= 0"),
    ("timing.prefix_len", at_least(1), ">= 1"),
]


def check_calibrate(cfg) -> None:
    check_rules(cfg, _CALIBRATE_RULES)
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


def check_export_head(cfg) -> None:
    if value_at(cfg, "format") not in ("eagle", "eagle3", "peagle"):
        raise ConfigError(f"format={value_at(cfg, 'format')!r}; choose eagle (an EAGLE-1/2 head), eagle3 "
                          f"(an EAGLE-3 head) or peagle (a one-pass head)")
    check_dtype(cfg, "dtype")


def check_regenerate(cfg) -> None:
    check_rules(cfg, [(k, at_least(1), ">= 1") for k in ("prompt_tokens", "max_new_tokens", "batch_size",
                                                          "shard_size", "parts", "num_threads", "slots")])
    for key, known in (("format", ("auto", "text", "chat")), ("on_error", ("fail", "skip")),
                       ("engine", ("lightning", "vllm"))):
        if value_at(cfg, key) not in known:
            raise ConfigError(f"{key}={value_at(cfg, key)!r}; choose one of {', '.join(known)}")
    src = value_at(cfg, "input")
    if not src:
        raise ConfigError("input is required: input=<records.jsonl> ({\"text\": ...} lines or chats)")
    if not Path(src).expanduser().is_file():
        raise ConfigError(f"input={src!r} is not a file; pass input=<records.jsonl> ({{\"text\": ...}} lines or chats)")
    if value_at(cfg, "engine") == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("engine=vllm needs vLLM, which is not installed: make vllm (or pip install -e \".[vllm]\"), "
                          "or engine=lightning")
    if value_at(cfg, "vllm_args") and value_at(cfg, "engine") != "vllm":
        raise ConfigError("vllm_args is for engine=vllm; drop it, or pass engine=vllm")
    if not 0 <= value_at(cfg, "part") < value_at(cfg, "parts"):
        raise ConfigError(f"part={value_at(cfg, 'part')} must be in [0, parts={value_at(cfg, 'parts')})")


# per command: its checks, and the (key, is a directory) of each output path it writes
CHECKS: dict[str, Callable[[Any], None]] = {"generate": check_generate, "calibrate": check_calibrate,
                                           "export_head": check_export_head, "regenerate": check_regenerate}
OUT_PATHS: dict[str, list[tuple[str, bool]]] = {
    "generate": [], "bench": [], "calibrate": [("out", False)], "export_head": [("out", True)],
    "regenerate": [("out_dir", True)]}
