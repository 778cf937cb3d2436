"""What every tree policy returns: a batch of draft trees of one size T."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from treedec.tree.layout import ancestor_matrix, pack_bits
from treedec.tree.tree import Tree


@dataclass
class DraftTree:
    """B draft trees of T nodes each (node 0 = root, the last verified token).

    parents/depth/rank/tokens/scores are [B, T]; ``draft_probs`` [B, T, V] is set only when
    children were *sampled* from the draft (then it is the distribution q they were drawn from,
    which verification needs); for deterministic top-k drafts it is None.
    """

    parents: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor
    draft_probs: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.parents.shape[1]

    def ancestor_bits(self) -> torch.Tensor:
        """Int64 [B, T, W] (per-row trees)."""
        return pack_bits(ancestor_matrix(self.parents, self.depth))

    def tree(self, row: int = 0) -> Tree:
        return Tree.from_parents(self.parents[row], tokens=self.tokens[row], scores=self.scores[row], rank=self.rank[row])

    def children(self, row: int) -> list[list[int]]:
        """Children of each node in rank order (the order verification tries them)."""
        out: list[list[int]] = [[] for _ in range(self.size)]
        ranks = self.rank[row].tolist()
        for i, p in enumerate(self.parents[row].tolist()[1:], start=1):
            out[p].append(i)
        for kids in out:
            kids.sort(key=lambda c: ranks[c])
        return out


class TreePolicy:
    """Draws a tree of candidates from a drafter; subclasses are the static/dynamic/chain/learned policies."""

    max_depth: int  # deepest node below the root
    max_size: int  # T, root included
    max_inputs: int  # tree nodes the draft head reads per step (its cache must hold them)

    def draft(self, drafter, params=None, generator: torch.Generator | None = None) -> DraftTree:
        raise NotImplementedError
