"""Draft heads: the kinds treedec builds and trains, their files, and the layouts other projects publish.

One file per kind: :mod:`~treedec.heads.eagle` (EAGLE-1/2), :mod:`~treedec.heads.eagle3` (EAGLE-3),
:mod:`~treedec.heads.parallel` (one-pass, P-EAGLE),
:mod:`~treedec.heads.dflash` (one-pass, DFlash); :mod:`~treedec.heads.kinds` is the ``kind -> class`` table,
:mod:`~treedec.heads.head` what every kind shares. Shared drafting pieces: :mod:`~treedec.heads.ttt` (training-time
test), :mod:`~treedec.heads.dtype` (the dtype a head drafts in on this machine), :mod:`~treedec.heads.quantized`
(int8 weights). :mod:`~treedec.heads.config` is the config, :mod:`~treedec.heads.checkpoint` loading (a head saves
itself), :mod:`~treedec.heads.formats` the published layouts.
"""
from treedec.heads.checkpoint import head_summary, load_head
from treedec.heads.config import BUNDLED_DRAFTS, DraftConfig, target_fingerprint
from treedec.heads.dflash import DFlashHead
from treedec.heads.eagle import EagleHead
from treedec.heads.eagle3 import Eagle3Head
from treedec.heads.head import DraftHead
from treedec.heads.kinds import HEAD_KINDS, KINDS, build_head
from treedec.heads.parallel import ParallelHead

__all__ = ["BUNDLED_DRAFTS", "HEAD_KINDS", "KINDS", "DFlashHead", "DraftConfig", "DraftHead", "Eagle3Head", "EagleHead", "ParallelHead",
           "build_head", "head_summary", "load_head", "target_fingerprint"]
