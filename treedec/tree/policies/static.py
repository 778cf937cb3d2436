"""Static trees (EAGLE-1 / Medusa): grow a fixed shape level by level from the draft's top-k.

A node of rank r takes its parent's r-th most likely draft token. With ``sample_drafts`` the
children are instead drawn i.i.d. from the draft distribution q (which verification then
uses with the SpecInfer rule); that is classic speculative sampling on a chain.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Sequence

import torch

from treedec.decoding.sampling import SamplingParams, target_probs
from treedec.tree.policies.base import DraftTree, TreePolicy
from treedec.tree.shapes import load_shape
from treedec.tree.tree import Tree, TreeError


class StaticPolicy(TreePolicy):
    def __init__(self, choices: Sequence[Sequence[int]] | None = None, shape: str | Mapping | None = None,
                 sample_drafts: bool = False):
        """``shape``: a shipped shape name, a YAML/JSON file, or a mapping with ``choices`` (a ``tree/shape`` config)."""
        if choices is None and shape is None:
            raise TreeError("a static tree needs `choices` (path lists) or a `shape` name/file")
        if choices is None:
            choices = shape["choices"] if isinstance(shape, Mapping) else load_shape(shape)
        self.shape = Tree.from_choices([list(c) for c in choices])
        if len(self.shape) < 2:
            raise TreeError("a static tree needs at least one draft node besides the root")
        self.sample_drafts = sample_drafts
        self.max_depth = self.shape.max_depth
        self.max_size = len(self.shape)
        kids = self.shape.children()
        depth = self.shape.depth.tolist()
        # Per depth: the nodes drafted there, and which of the previous depth's nodes must be expanded.
        self.levels = [[i for i in range(len(depth)) if depth[i] == d] for d in range(self.max_depth + 1)]
        self.expanded = [[i for i in lvl if kids[i]] for lvl in self.levels]
        self.fan_out = max(len(k) for k in kids)
        self.max_inputs = sum(len(e) for e in self.expanded[1:])

    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> DraftTree:
        shape, B = self.shape, drafter.batch
        T, dev = len(shape), drafter.device
        parents, ranks = shape.parents.tolist(), shape.rank.tolist()
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        tokens[:, 0] = drafter.root_tokens
        scores = torch.zeros(B, T, device=dev)
        sampled = self.sample_drafts and params is not None and not params.greedy
        probs_out = torch.zeros(B, T, drafter.vocab_size, device=dev) if sampled else None
        logp = {0: drafter.root_logp}  # node -> draft log-probs of its children [B, V]
        feat = {0: drafter.root_feat}  # node -> the draft feature its children read
        forest: list[int] = []  # drafter inputs so far (tree node ids), in input order
        for d in range(1, self.max_depth + 1):
            for p in self.expanded[d - 1]:
                kids = [c for c in self.levels[d] if parents[c] == p]
                k = max(ranks[c] for c in kids) + 1
                if sampled:
                    q = target_probs(logp[p], params)
                    probs_out[:, p] = q
                    picks = torch.multinomial(q, k, replacement=True, generator=generator)
                else:
                    picks = logp[p].topk(k, dim=-1).indices
                for c in kids:
                    tokens[:, c] = picks[:, ranks[c]]
                    scores[:, c] = scores[:, p] + logp[p].gather(1, tokens[:, c:c + 1]).squeeze(1)
            grow = self.expanded[d] if d < self.max_depth else []
            if grow:
                idx = torch.tensor(grow, device=dev)
                forest_parents = [forest.index(parents[n]) if parents[n] in forest else -1 for n in forest + grow]
                f, lp = drafter.expand(tokens[:, idx], torch.stack([feat[parents[n]] for n in grow], 1),
                                       depth=d, forest_parents=forest_parents, n_prev=len(forest))
                for j, n in enumerate(grow):
                    feat[n], logp[n] = f[:, j], lp[:, j]
                forest += grow
        rep = lambda t: t[None].expand(B, -1).to(dev)  # noqa: E731
        return DraftTree(rep(shape.parents), rep(shape.depth), rep(shape.rank), tokens, scores, probs_out)


class ChainPolicy(StaticPolicy):
    """A single path of ``depth`` draft tokens: classic speculative decoding, the baseline a tree must beat."""

    def __init__(self, depth: int = 5, sample_drafts: bool = False):
        if depth < 1:
            raise TreeError(f"chain depth must be >= 1, got {depth}")
        super().__init__(choices=[[0] * d for d in range(1, depth + 1)], sample_drafts=sample_drafts)
