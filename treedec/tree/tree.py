"""The draft tree: parents in topological order plus everything verification needs.

A tree is stored as a parent array (node 0 is the root, ``parents[0] == -1``, every parent
precedes its children). Masks, position ids and root-to-leaf paths are all derived from it,
so one object feeds the draft policies, the attention kernels and the verifier.

One type serves both uses: a *shape* has 1-D fields ``[T]`` (built by ``from_parents`` /
``from_choices``); a *drafted batch* has ``[B, T]`` fields, one tree per batch row, with
tokens, scores and (policies precompute it so the hot path never rebuilds it) the ancestry.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from treedec.attention.layout import ancestor_matrix, pack_bits


class TreeError(ValueError):
    """A malformed tree: the message says what is wrong and how to fix it."""


@dataclass(frozen=True, eq=False)
class Tree:
    """Parents ([T] or [B, T], topological), depth, sibling rank, and optional tokens/scores.

    ``draft_probs`` [B, T, V] is set only when children were *sampled* from the draft: then it
    is the distribution q each node's children were drawn from (the SpecInfer rule needs it).
    ``anc`` is an optional precomputed :meth:`ancestors` matrix (bool [(B,) T, T]).
    ``pad`` (bool [B, T], optional) marks padding nodes: slots that fill a row whose own tree is
    smaller than the batch's T (per-row budgets). A padding node sees only itself (and the prefix),
    is nobody's parent, and :func:`~treedec.decoding.verify.accept_paths` never accepts it.
    ``inner_size``: set when nodes were added beside the policy's own tree (prompt lookup's copy): its
    first ``inner_size`` nodes are that tree (:meth:`first`), whose own acceptance the decoder also reports.
    ``is_chain``: the policy vouches that node i's parent is i - 1 and node i its top-ranked child (rank 0), in every
    row (no padding): the decoder then takes the chain's shorter acceptance
    (:func:`~treedec.decoding.verify.accept_chain`) and reads its counts and top-1 run off the host.
    """

    parents: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor
    tokens: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    anc: torch.Tensor | None = None
    pad: torch.Tensor | None = None
    inner_size: int | None = None
    is_chain: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_parents(
        cls,
        parents: Sequence[int] | torch.Tensor,
        tokens: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        rank: Sequence[int] | torch.Tensor | None = None,
    ) -> "Tree":
        """Build from a parent list; ``rank`` (sibling rank) defaults to order among siblings."""
        p = [int(x) for x in (parents.tolist() if torch.is_tensor(parents) else parents)]
        if not p:
            raise TreeError("empty tree: a tree needs at least the root (parents=[-1])")
        if p[0] != -1:
            raise TreeError(f"node 0 must be the root with parent -1, got parent {p[0]}")
        depth, auto_rank, n_children = [0] * len(p), [0] * len(p), [0] * len(p)
        for i, q in enumerate(p[1:], start=1):
            if q == i:
                raise TreeError(f"node {i} is its own parent (a cycle)")
            if q < 0 or q >= len(p):
                raise TreeError(f"node {i} has parent {q}, outside 0..{len(p) - 1}")
            if q > i:
                raise TreeError(
                    f"node {i} has parent {q}, which comes after it: nodes must be in "
                    "topological order (every parent before its children); reorder the list"
                )
            depth[i] = depth[q] + 1
            auto_rank[i] = n_children[q]
            n_children[q] += 1
        r = auto_rank if rank is None else [int(x) for x in (rank.tolist() if torch.is_tensor(rank) else rank)]
        if len(r) != len(p):
            raise TreeError(f"rank has {len(r)} entries for {len(p)} nodes")
        for name, t in (("tokens", tokens), ("scores", scores)):
            if t is not None and t.shape[0] != len(p):
                raise TreeError(f"{name} has {t.shape[0]} entries for {len(p)} nodes")
        return cls(
            parents=torch.tensor(p, dtype=torch.long),
            depth=torch.tensor(depth, dtype=torch.long),
            rank=torch.tensor(r, dtype=torch.long),
            tokens=tokens,
            scores=scores,
        )

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> "Tree":
        """Build from EAGLE/Medusa path lists: ``[0]`` is the root's best child, ``[0, 1]`` its 2nd-best child.

        The root is implicit. Paths are sorted by (length, ranks) so that the result is
        topological and siblings appear in rank order.
        """
        paths = [tuple(int(x) for x in c) for c in choices]
        seen: set[tuple[int, ...]] = set()
        for c in paths:
            if len(c) == 0:
                raise TreeError("empty path in choices: the root is implicit, list only its descendants")
            if any(x < 0 for x in c):
                raise TreeError(f"negative rank in path {list(c)}: ranks are 0 (best) or more")
            if c in seen:
                raise TreeError(f"duplicate path {list(c)} in choices: list each node once")
            seen.add(c)
        for c in paths:
            if len(c) > 1 and c[:-1] not in seen:
                raise TreeError(f"path {list(c)} has no parent: add {list(c[:-1])} to the choices")
        ordered = sorted(paths, key=lambda c: (len(c), c))
        index = {(): 0}
        parents, rank = [-1], [0]
        for i, c in enumerate(ordered, start=1):
            index[c] = i
            parents.append(index[c[:-1]])
            rank.append(c[-1])
        return cls.from_parents(parents, rank=rank)

    @classmethod
    def root_only(cls, root_tokens: torch.Tensor, size: int = 1) -> "Tree":
        """A batch of one-node trees: the roots [B] alone, i.e. a plain decoding step; with ``size`` > 1 followed by
        padding nodes up to that many (the verify shape of a larger tree, e.g. one a compiled pass already has)."""
        B, dev = root_tokens.shape[0], root_tokens.device
        zero = torch.zeros(B, size, dtype=torch.long, device=dev)
        if size == 1:
            return cls(zero - 1, zero, zero, root_tokens[:, None], torch.zeros(zero.shape, device=dev),
                       anc=torch.ones(1, 1, dtype=torch.bool, device=dev))
        pad = torch.arange(size, device=dev).expand(B, size) > 0  # a padding node: a leaf under the root
        return cls(pad.long() - 1, pad.long(), zero, torch.cat([root_tokens[:, None], zero[:, 1:]], 1),
                   torch.zeros(zero.shape, device=dev), anc=torch.eye(size, dtype=torch.bool, device=dev), pad=pad)

    @classmethod
    def chain(cls, length: int) -> "Tree":
        """A single path of ``length`` nodes, root included (classic speculative decoding)."""
        if length < 1:
            raise TreeError(f"a chain needs at least 1 node, got {length}")
        return replace(cls.from_parents([-1] + list(range(length - 1))), is_chain=True)

    # ---------------------------------------------------------------- derived views
    def __len__(self) -> int:
        return self.parents.shape[-1]

    @property
    def size(self) -> int:
        return len(self)

    @property
    def batched(self) -> bool:
        return self.parents.dim() == 2

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    def with_tokens(self, tokens: torch.Tensor, scores: torch.Tensor | None = None) -> "Tree":
        return replace(self, tokens=tokens, scores=scores if scores is not None else self.scores, _cache={})

    def first(self, n: int) -> "Tree":
        """The tree of the first ``n`` nodes of a drafted batch (a topological prefix is a tree)."""
        cut = lambda t: None if t is None else t[..., :n]
        anc = self.ancestors()
        return Tree(self.parents[..., :n], self.depth[..., :n], self.rank[..., :n], cut(self.tokens), cut(self.scores),
                    None if self.draft_probs is None else self.draft_probs[..., :n, :], anc[..., :n, :n], cut(self.pad))

    def row(self, b: int) -> "Tree":
        """Row ``b`` of a drafted batch as a single tree (a shape returns itself)."""
        if not self.batched:
            return self
        pick = lambda t: None if t is None else t[b]
        anc = self.anc if self.anc is None or self.anc.dim() == 2 else self.anc[b]  # a shared [T, T] ancestry
        return Tree(self.parents[b], self.depth[b], self.rank[b], pick(self.tokens), pick(self.scores),
                    pick(self.draft_probs), anc, pick(self.pad))

    def _memo(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def ancestors(self) -> torch.Tensor:
        """Bool [(B,) T, T]: ``[i, j]`` iff j == i or j is an ancestor of i."""
        if self.anc is not None:
            return self.anc
        return self._memo("anc", lambda: ancestor_matrix(self.parents, self.depth))

    def mask(self) -> torch.Tensor:
        """The dense boolean tree mask (alias of :meth:`ancestors`)."""
        return self.ancestors()

    def ancestor_bits(self) -> torch.Tensor:
        """Int64 [(B,) T, ceil(T/64)]: bit j of row i set iff j == i or j is an ancestor of i."""
        return self._memo("bits", lambda: pack_bits(self.ancestors()))

    def position_ids(self, prefix_len: int | torch.Tensor = 0) -> torch.Tensor:
        """``prefix_len + depth``; a tensor of prefix lengths [B] gives [B, T]."""
        if torch.is_tensor(prefix_len) and prefix_len.dim() == 1:
            return prefix_len[:, None].to(torch.long) + self.depth[None, :]
        return self.depth + int(prefix_len)

    def children(self, row: int | None = None) -> list[list[int]]:
        """Children of each node in sibling-rank order (the order verification tries them)."""
        if self.batched:
            return self.row(row or 0).children()

        def build():
            out: list[list[int]] = [[] for _ in range(len(self))]
            ranks = self.rank.tolist()
            pad = [False] * len(self) if self.pad is None else self.pad.tolist()
            for i, p in enumerate(self.parents.tolist()[1:], start=1):
                if not pad[i]:  # padding nodes are nobody's child: never tried, never accepted
                    out[p].append(i)
            for kids in out:
                kids.sort(key=lambda c: ranks[c])
            return out

        return self._memo("children", build)

    def leaves(self) -> list[int]:
        return [i for i, c in enumerate(self.children()) if not c]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive."""
        path, p = [], node
        parents = self.parents.tolist()
        while p != -1:
            path.append(p)
            p = parents[p]
        return path[::-1]

    def retrieve_indices(self) -> torch.Tensor:
        """LongTensor [n_leaves, max_depth + 1]: each root-to-leaf path, padded with -1."""

        def build():
            leaves = self.leaves()
            out = torch.full((len(leaves), self.max_depth + 1), -1, dtype=torch.long)
            for r, leaf in enumerate(leaves):
                path = self.path_to(leaf)
                out[r, : len(path)] = torch.tensor(path)
            return out

        return self._memo("retrieve", build)

    def to_choices(self) -> list[list[int]]:
        """The inverse of :meth:`from_choices` (paths of sibling ranks, root omitted)."""
        ranks = self.rank.tolist()
        return [[ranks[j] for j in self.path_to(i)[1:]] for i in range(1, len(self))]
