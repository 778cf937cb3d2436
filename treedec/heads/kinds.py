"""The head kinds treedec builds, by a :class:`~treedec.heads.config.DraftConfig`'s ``kind``: :data:`HEAD_KINDS`.

A new kind is its own file (a :class:`~treedec.heads.head.DraftHead` subclass) and one row of the table; the
config checks, the loader and the trainer read the kinds from here.
"""
from __future__ import annotations

from treedec.heads.config import DraftConfig
from treedec.heads.dflash import DFlashHead
from treedec.heads.eagle import EagleHead
from treedec.heads.eagle3 import Eagle3Head
from treedec.heads.head import DraftHead
from treedec.heads.parallel import ParallelHead

HEAD_KINDS: dict[str, type[DraftHead]] = {
    "eagle": EagleHead,  # EAGLE-1/2: the target's final hidden state, its LM head
    "eagle3": Eagle3Head,  # EAGLE-3: three target layers' inputs, its own LM head over a draft vocabulary
    "parallel": ParallelHead,  # one-pass (P-EAGLE): an EAGLE-3 head drafting block_size positions in one forward
    "dflash": DFlashHead,  # one-pass (DFlash): draft_layers layers reading the target's features as keys/values
}
KINDS = tuple(HEAD_KINDS)


def build_head(cfg: DraftConfig) -> DraftHead:
    """A new head of ``cfg.kind`` (fresh weights; ``bind`` it to its target)."""
    cls = HEAD_KINDS.get(cfg.kind)
    if cls is None:
        raise ValueError(f"unknown draft kind {cfg.kind!r}; treedec builds {', '.join(KINDS)}")
    return cls(cfg)


__all__ = ["HEAD_KINDS", "KINDS", "build_head"]
