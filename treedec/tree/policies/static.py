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
        self._plan()

    def _plan(self) -> None:
        """Precompute, per depth, which nodes are drafted, from which parent slot, and who is expanded."""
        kids, parents = self.shape.children(), self.shape.parents.tolist()
        depth, ranks = self.shape.depth.tolist(), self.shape.rank.tolist()
        levels = [[i for i in range(len(depth)) if depth[i] == d] for d in range(self.max_depth + 1)]
        expanded = [[i for i in lvl if kids[i]] for lvl in levels]  # nodes whose children get drafted
        slot = {n: j for lvl in expanded for j, n in enumerate(lvl)}  # position within its depth's expanded list
        order = [n for lvl in expanded[1:] for n in lvl]  # draft-head inputs, in input order
        forest = {n: i for i, n in enumerate(order)}
        self.max_inputs = len(order)
        self.steps = []
        for d in range(1, self.max_depth + 1):
            nodes = levels[d]
            grow = expanded[d] if d < self.max_depth else []
            self.steps.append(dict(
                nodes=torch.tensor(nodes), parent=torch.tensor([parents[n] for n in nodes]),
                slot=torch.tensor([slot[parents[n]] for n in nodes]), rank=torch.tensor([ranks[n] for n in nodes]),
                k=max(ranks[n] for n in nodes) + 1, grow=torch.tensor(grow, dtype=torch.long),
                grow_parent_slot=torch.tensor([slot[parents[n]] for n in grow], dtype=torch.long),
                forest_parents=[forest.get(parents[n], -1) for n in order[: forest[grow[-1]] + 1]] if grow else [],
                n_prev=forest[grow[0]] if grow else 0,
            ))

    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> DraftTree:
        shape, B = self.shape, drafter.batch
        T, dev = len(shape), drafter.device
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        tokens[:, 0] = drafter.root_tokens
        scores = torch.zeros(B, T, device=dev)
        sampled = self.sample_drafts and params is not None and not params.greedy
        probs_out = torch.zeros(B, T, drafter.vocab_size, device=dev) if sampled else None
        logp = drafter.root_logp[:, None]  # [B, n_expanded, V]: children distributions of the last depth's expanded nodes
        feat = drafter.root_feat[:, None]  # [B, n_expanded, H]: the feature those children read
        parent_ids = torch.zeros(1, dtype=torch.long)  # tree ids of the last depth's expanded nodes
        for st in self.steps:
            nodes, slot, rank = st["nodes"].to(dev), st["slot"].to(dev), st["rank"].to(dev)
            if sampled:
                q = target_probs(logp, params)  # [B, n, V]
                probs_out[:, parent_ids.to(dev)] = q
                picks = torch.multinomial(q.flatten(0, 1), st["k"], replacement=True, generator=generator)
                picks = picks.view(B, -1, st["k"])
            else:
                picks = logp.topk(st["k"], dim=-1).indices  # [B, n, k]
            tok = picks[:, slot, rank]  # [B, n_nodes]
            tokens[:, nodes] = tok
            scores[:, nodes] = scores[:, st["parent"].to(dev)] + logp[:, slot].gather(2, tok[..., None]).squeeze(2).float()
            if len(st["grow"]):
                grow = st["grow"].to(dev)
                feat, logp = drafter.expand(tokens[:, grow], feat[:, st["grow_parent_slot"].to(dev)], depth=int(shape.depth[st["grow"][0]]),
                                            forest_parents=st["forest_parents"], n_prev=st["n_prev"])
                parent_ids = st["grow"]
        rep = lambda t: t[None].expand(B, -1).to(dev)  # noqa: E731
        return DraftTree(rep(shape.parents), rep(shape.depth), rep(shape.rank), tokens, scores, probs_out)


class ChainPolicy(StaticPolicy):
    """A single path of ``depth`` draft tokens: classic speculative decoding, the baseline a tree must beat."""

    def __init__(self, depth: int = 5, sample_drafts: bool = False):
        if depth < 1:
            raise TreeError(f"chain depth must be >= 1, got {depth}")
        super().__init__(choices=[[0] * d for d in range(1, depth + 1)], sample_drafts=sample_drafts)
