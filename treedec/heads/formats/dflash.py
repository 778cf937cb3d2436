"""DFlash drafters (z-lab's ``DFlashDraftModel``, speculators' ``dflash``): recognised and refused with one line, as no
head kind of treedec reads them yet (the target's features enter every layer as extra keys and values, and a block is
drafted with non-causal attention)."""
from __future__ import annotations

from pathlib import Path

from treedec.heads.formats.peagle import MASK_KEYS


def refuse_dflash(raw: dict, keys: set[str], path: Path) -> None:
    """A one-line error for a DFlash drafter (z-lab's ``DFlashDraftModel``, speculators' ``dflash``, or tensors laid
    out as one: a top-level ``hidden_norm`` and no ``lm_head``); nothing for anything else."""
    archs = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    auto = " ".join(str(v) for v in (raw.get("auto_map") or {}).values()) if isinstance(raw.get("auto_map"), dict) else ""
    named = str(raw.get("speculators_model_type", "")).lower().startswith("dflash") or \
        any("dflash" in a.lower() for a in archs) or "dflash" in auto.lower() or \
        ("dflash_config" in raw and not any(k in raw for k in MASK_KEYS[1:]))
    laid_out = "hidden_norm.weight" in keys and "lm_head.weight" not in keys
    if named or laid_out:
        what = f"architectures {archs}" if archs else f"speculators_model_type {raw.get('speculators_model_type')!r}" \
            if "speculators_model_type" in raw else "tensors hidden_norm.weight without lm_head.weight"
        raise ValueError(f"{path / 'config.json'} is a DFlash drafter ({what}); DFlash drafters are not a head kind "
                         "treedec loads: the target's features enter every layer as extra keys/values and a block is "
                         "drafted with non-causal attention, where a treedec head is one causal EAGLE layer fed the "
                         "features through fc")


__all__ = ["refuse_dflash"]
