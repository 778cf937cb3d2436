"""A draft head's files: :func:`save_head` writes draft_config.json + draft.safetensors, :func:`load_head` reads
them (or a published EAGLE / EAGLE-3 / speculators layout, :mod:`treedec.heads.formats.published`). Never unpickles.

``DraftHead.save`` and ``DraftHead.load`` (the ``_target_`` of conf/draft/*.yaml) call these.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch.nn as nn

from treedec.heads.config import DRAFT_CONFIG, DRAFT_WEIGHTS, DraftConfig, head_dir, target_fingerprint
from treedec.heads.dtype import inference_dtype, with_bf16_for_wide_batches
from treedec.models.llama import Transformer
from treedec.heads.quantized import check_quantize, is_quantized


def check_target(target: object) -> None:
    """A head binds to a loaded model: a name (``target="tiny-code"``) would fail deep inside binding, or later."""
    if target is not None and not isinstance(target, Transformer):
        raise TypeError(f"a draft head's target is a loaded model (treedec.models.load_model({target!r})), not "
                        f"{type(target).__name__} {target!r}")


def save_head(head: nn.Module, path: str | Path) -> None:
    """Write draft_config.json + draft.safetensors; a bound head records its target's fingerprint."""
    from safetensors.torch import save_file

    from treedec.atomic import follow_umask

    if is_quantized(head):
        raise ValueError("this draft head's weights are int8 (draft.quantize=int8): a file of them would not load; "
                         "save the head loaded without quantize")
    if head._target:
        head.config.target_fingerprint = target_fingerprint(head.target)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / DRAFT_CONFIG).write_text(json.dumps(asdict(head.config), indent=2))
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}, str(path / DRAFT_WEIGHTS))
    follow_umask(path / DRAFT_WEIGHTS)


def load_head(cls: type, path: str | Path, target: Transformer | None = None, dtype=None, device=None,
              quantize: str | None = None) -> nn.Module:
    """``DraftHead.load``: a head (``cls``, by its config's kind) from a bundled head ("tiny-code-eagle",
    "tiny-code-eagle3", "tiny-code-parallel") or a directory (draft_config.json + draft.safetensors, or a published
    layout).

    ``dtype``: None keeps the file's; "auto" is :func:`inference_dtype` for the target; else a dtype or its name.
    ``quantize``: "int8" rounds the head's weights to int8 for its passes of few rows (:mod:`treedec.heads.quantized`;
    the output does not change, the drafts only where the head's top tokens nearly tie); "auto": int8 on a CPU
    where that measures faster than the head's dtype (:func:`~treedec.heads.quantized.int8_is_faster`); None keeps
    them.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from treedec.models.checkpoint import check_finite

    check_target(target)
    check_quantize(quantize)

    auto = str(dtype) == "auto"
    dtype = inference_dtype(target, device) if auto else dtype
    if isinstance(dtype, str):
        from treedec.models.checkpoint import resolve_dtype

        dtype = resolve_dtype(dtype)
    path = head_dir(path)
    if not (path / DRAFT_CONFIG).is_file():  # config.json: EAGLE / EAGLE-3 / speculators
        from treedec.heads.formats.published import load_published

        head = load_published(path, cls, target, dtype=dtype, device=device, quantize=quantize)
        return with_bf16_for_wide_batches(head, auto)
    try:
        cfg = DraftConfig(**json.loads((path / DRAFT_CONFIG).read_text()))
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt {path / DRAFT_CONFIG}: {e}") from e
    head = cls(cfg)
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
    head = head.to(device=device or "cpu", dtype=dtype or state["fc.weight"].dtype)
    return with_bf16_for_wide_batches(head.prepare(target, quantize), auto)


def head_summary(path: str | Path) -> dict:
    """``{"kind", "block_size", "feature_layers"}`` of the head ``path`` names (bundled name or directory), read from
    its config alone, no weights: what a config check compares with the options before any model loads
    (``feature_layers`` None: the kind's default for the target)."""
    path = head_dir(path)
    if not (path / DRAFT_CONFIG).is_file():
        from treedec.heads.formats.summary import published_summary

        return published_summary(path)
    try:
        raw = json.loads((path / DRAFT_CONFIG).read_text())
        cfg = DraftConfig(**raw)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"corrupt {path / DRAFT_CONFIG}: {e}") from e
    return {"kind": cfg.kind, "block_size": cfg.block_size, "feature_layers": list(cfg.feature_layers)}


__all__ = ["check_target", "head_summary", "load_head", "save_head"]
