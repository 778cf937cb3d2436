"""Chains: one path of draft tokens, the static shape whose every node is its parent's best draft."""
from __future__ import annotations

from treedec.conf_defaults import shipped_defaults
from treedec.tree.policies.base import whole
from treedec.tree.policies.static import StaticPolicy
from treedec.tree.tree import Tree

_D = shipped_defaults("tree/chain")  # the defaults of tree=chain, written once there


class ChainPolicy(StaticPolicy):
    """A single path of ``depth`` draft tokens: classic speculative decoding, the baseline a tree must beat. A one-pass
    head drafts it in one pass (its marginals' best tokens)."""

    reads = "either"

    def __init__(self, depth: int = _D["depth"], sample_drafts: bool = _D["sample_drafts"], scores: bool = False):
        super().__init__(choices=Tree.chain(whole(depth, "depth") + 1), sample_drafts=sample_drafts, scores=scores)
