"""What a published head directory is, from its ``config.json`` and tensor names alone (no weights read): its kind,
block size and feature layers, so that a config check (``train init_from=``, ``calibrate draft.path=``) can refuse a
head of the wrong kind before any model loads. :func:`treedec.heads.formats.published.convert` reads the same keys."""
from __future__ import annotations

from pathlib import Path

import treedec.heads.formats.peagle as peagle
from treedec.models.checkpoint import WEIGHTS, _keys, read_json_object


def published_summary(path: str | Path) -> dict:
    """``{"kind", "block_size", "feature_layers"}`` of the published head at ``path`` (``feature_layers`` None where
    the config names none: EAGLE-3's default for the target). Errors are the loader's (:func:`head_formats.detect`)."""
    from treedec.heads.formats.published import detect

    path = Path(path)
    raw = read_json_object(path / "config.json", "restore the head's config.json from where it was published")
    layout = detect(raw, path / "config.json")
    if layout == "eagle":
        return {"kind": "eagle", "block_size": 0, "feature_layers": [-1]}
    if layout == "eagle3" and (path / WEIGHTS).is_file() and "mask_hidden" in _keys(path / WEIGHTS):
        layout = "peagle"  # an EAGLE-3 config over P-EAGLE tensors (convert() decides the same way)
    layers = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if layout == "peagle":
        return {"kind": "parallel", "block_size": peagle.block_size(raw, path), "feature_layers": layers}
    return {"kind": "eagle3", "block_size": 0, "feature_layers": layers}


__all__ = ["published_summary"]
