"""``treedec.train``'s head options against each other, the ``init_from`` head and the target, before anything loads:
the kind to train agrees with the head it starts from, a one-pass head's block fits the target's context, and the
feature layers exist in the target. Each mistake is a :class:`~treedec.errors.ConfigError` naming the train key
(``draft_arch.*``, ``init_from``, ``model.path``) to change. Called by :mod:`treedec.config.jobs`."""
from __future__ import annotations

from typing import Any

from treedec.errors import ConfigError
from treedec.heads.checkpoint import head_summary
from treedec.models.checkpoint import read_config

KINDS = ("eagle", "eagle3", "parallel", "dflash")
ONE_PASS = ("parallel", "dflash")  # kinds that draft every depth's marginal in one pass of block_size positions
HEAD_NAMES = {"eagle": "an EAGLE-1/2", "eagle3": "an EAGLE-3", "parallel": "a one-pass (P-EAGLE, kind parallel)",
              "dflash": "a DFlash (kind dflash)"}
STARTS = {("eagle3", "parallel")}  # (init_from's kind, draft_arch.kind) pairs that convert: P-EAGLE from EAGLE-3


def check_draft_arch(draft: dict, init: str | None, target: str) -> None:
    """Raise :class:`ConfigError` unless ``draft`` (``draft_arch``), ``init`` (``init_from``) and the target at
    ``target`` (``model.path``, a resolvable directory or bundled name) make one trainable head."""
    kind = draft.get("kind", "eagle")
    if kind not in KINDS:
        raise ConfigError(f"draft_arch.kind={kind!r} is not a head kind: draft_arch=eagle, draft_arch=eagle3, "
                          f"draft_arch=parallel or draft_arch=dflash")
    block = draft.get("block_size")
    if kind in ONE_PASS and not _whole(block):
        raise ConfigError(f"draft_arch.block_size={block!r}: a whole number >= 1 of positions per pass")
    if (kind == "dflash" or draft.get("draft_layers") is not None) and not _whole(draft.get("draft_layers")):
        raise ConfigError(f"draft_arch.draft_layers={draft.get('draft_layers')!r}: a whole number >= 1 of decoder "
                          f"layers (DFlash's drafters have 1 to 8)")
    layers_cfg = _target_config(target)
    head = _init_head(init) if init is not None else None
    if head is not None:
        _check_init_kind(kind, head["kind"], init)
    if kind in ONE_PASS:
        ctx = layers_cfg.context_length
        if block + 1 > ctx:
            raise ConfigError(f"draft_arch.block_size={block}: a one-pass head drafting {block} positions needs "
                              f"{block + 1} positions of context with its root, more than model.path={target}'s "
                              f"{ctx}; lower draft_arch.block_size (P-EAGLE uses 8)")
    n = layers_cfg.num_hidden_layers
    if head is not None and head["kind"] != "eagle":
        ids = head["feature_layers"]
        if ids is not None and not _fit(ids, n):
            raise ConfigError(f"init_from={init} is {HEAD_NAMES[head['kind']]} head reading target layers {list(ids)}, "
                              f"but model.path={target} has {n} layers (ids 0..{n - 1}): it was trained for a deeper "
                              f"model; start from a head trained for this target, or drop init_from to train one")
    elif kind != "eagle" and draft.get("feature_layers") is not None:
        ids, top = draft["feature_layers"], n if kind == "dflash" else n - 1  # (DFlash: id L, the last layer's output)
        if not _fit(ids, top + 1):
            raise ConfigError(f"draft_arch.feature_layers={list(ids)}: {HEAD_NAMES[kind]} head reads the inputs of "
                              f"target layers, and model.path={target} has {n} (ids 0..{top}); pass ids in that "
                              f"range, or draft_arch.feature_layers=null (the kind's default)")


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _fit(ids: Any, n: int) -> bool:
    return bool(ids) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in ids)


def _target_config(target: str):
    try:
        return read_config(target)[0]
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"model.path={target}: {e}") from None


def _init_head(init: str) -> dict:
    try:
        return head_summary(init)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"init_from={init}: {e}") from None


def _check_init_kind(kind: str, has: str, init: str) -> None:
    """The head ``init_from`` names is of the kind ``draft_arch`` trains (or converts into it), as in SpecForge and
    EAGLE's trainers: a head never changes kind unasked, and its saved config says what it is."""
    if has == kind or (has, kind) in STARTS:
        return
    if kind == "parallel":
        how = f"start a one-pass head from an EAGLE-3 head (draft_arch=parallel init_from=<EAGLE-3 head>), or pass " \
              f"draft_arch={has} to fine-tune this one as it is"
    else:
        how = f"pass draft_arch={has} to fine-tune it"
    raise ConfigError(f"init_from={init} is {HEAD_NAMES[has]} head, but draft_arch.kind={kind} trains "
                      f"{HEAD_NAMES[kind]} head: {how}")


__all__ = ["check_draft_arch"]
