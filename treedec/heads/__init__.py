"""Draft heads: the EAGLE-1/2, EAGLE-3 and one-pass (P-EAGLE) kinds, their files and the published layouts."""
from treedec.heads import eagle3, parallel  # noqa: F401  (registers DraftHead's kinds "eagle3" and "parallel")
from treedec.heads.head import DraftHead

__all__ = ["DraftHead"]
