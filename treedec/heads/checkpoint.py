"""Loading a draft head: :func:`load_head` reads treedec's files (draft_config.json + draft.safetensors, what
``DraftHead.save`` writes) or a published layout (:mod:`treedec.heads.formats`), and builds the head of its kind
through :data:`~treedec.heads.kinds.HEAD_KINDS`; :func:`head_summary` reads what a config check needs of a head
without its weights. Never unpickles.

``load_head`` (the ``_target_`` of conf/draft/*.yaml) is :func:`load_head`.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file

from treedec.heads.config import DRAFT_CONFIG, DRAFT_WEIGHTS, DraftConfig, head_dir
from treedec.heads.dtype import inference_dtype, with_bf16_for_wide_batches
from treedec.heads.formats.read import convert, published_summary
from treedec.heads.head import DraftHead, check_target
from treedec.heads.kinds import build_head
from treedec.heads.quantized import check_quantize
from treedec.models.checkpoint import check_finite, resolve_dtype
from treedec.models.llama import Transformer


def load_head(path: str | Path, target: Transformer | None = None, dtype=None, device=None,
              quantize: str | None = None) -> DraftHead:
    """A head of its file's kind from a bundled head ("tiny-code-eagle", "tiny-code-eagle3", "tiny-code-parallel") or
    a directory (draft_config.json + draft.safetensors, or a published EAGLE / EAGLE-3 / P-EAGLE / speculators
    layout), in its inference form (:meth:`~treedec.heads.head.DraftHead.prepare`), bound to ``target`` when given.

    ``dtype``: None keeps the file's; "auto" is :func:`inference_dtype` for the target (and, for an fp32 head of a
    bf16 CPU target, a bf16 copy for wide batches); else a dtype or its name.
    ``quantize``: "int8" rounds the head's weights to int8 for its passes of few rows (:mod:`treedec.heads.quantized`;
    the output does not change, the drafts only where the head's top tokens nearly tie); "auto": int8 on a CPU
    where that measures faster than the head's dtype (:func:`~treedec.heads.quantized.int8_is_faster`); None keeps
    them.
    """
    check_target(target)
    check_quantize(quantize)
    auto = str(dtype) == "auto"
    dtype = inference_dtype(target, device) if auto else dtype
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype)
    path = head_dir(path)
    if (path / DRAFT_CONFIG).is_file():
        head, state = _read_treedec(path)
    else:  # config.json: EAGLE / EAGLE-3 / speculators / P-EAGLE
        head, state = _read_published(path, target)
    head = head.to(device=device or "cpu", dtype=dtype or state["fc.weight"].dtype)
    return with_bf16_for_wide_batches(head.prepare(target, quantize), auto)


def _read_treedec(path: Path) -> tuple[DraftHead, dict]:
    """(the head of treedec's files at ``path``, its weights loaded, the state they came from)."""
    try:
        cfg = DraftConfig(**json.loads((path / DRAFT_CONFIG).read_text()))
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt {path / DRAFT_CONFIG}: {e}") from e
    head = build_head(cfg)
    try:
        state = load_file(str(path / DRAFT_WEIGHTS))
    except (FileNotFoundError, SafetensorError, OSError) as e:
        raise ValueError(f"cannot read draft weights {path / DRAFT_WEIGHTS} ({e}); re-save or retrain the head") from e
    check_finite(path / DRAFT_WEIGHTS, state)
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor whose shape does not fit the config
        raise ValueError(f"draft weights in {path} do not fit {DRAFT_CONFIG}: {e}") from e
    if missing or unexpected:
        raise ValueError(f"draft weights in {path} do not match its config: missing {missing}, unexpected {unexpected}")
    return head, state


def _read_published(path: Path, target: Transformer | None) -> tuple[DraftHead, dict]:
    """(the head of the published layout at ``path``, its weights loaded, in eval mode; the converted state)."""
    cfg, state, layout = convert(path, target)
    head = build_head(cfg)
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor whose shape does not fit the config
        raise ValueError(f"{path} ({layout} layout): the weights do not fit its config.json: {e}") from e
    if missing or unexpected:
        raise ValueError(f"{path} ({layout} layout) does not hold a whole head: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    return head.eval(), state


def head_summary(path: str | Path) -> dict:
    """``{"kind", "block_size", "feature_layers"}`` of the head ``path`` names (bundled name or directory), read from
    its config alone, no weights: what a config check compares with the options before any model loads
    (``feature_layers`` None: the kind's default for the target)."""
    path = head_dir(path)
    if not (path / DRAFT_CONFIG).is_file():
        return published_summary(path)
    try:
        raw = json.loads((path / DRAFT_CONFIG).read_text())
        cfg = DraftConfig(**raw)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt {path / DRAFT_CONFIG}: {e}") from e
    return {"kind": cfg.kind, "block_size": cfg.block_size, "feature_layers": list(cfg.feature_layers)}


__all__ = ["head_summary", "load_head"]
