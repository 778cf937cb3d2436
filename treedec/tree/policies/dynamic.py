"""EAGLE-2 dynamic tree: expand by draft confidence, then rerank to a node budget.

Per depth, the ``top_k`` drafted nodes with the highest cumulative draft log-probability are
expanded, each proposing its ``top_k`` most likely children. After ``depth`` levels every
drafted node competes on cumulative log-probability and the best ``total_tokens - 1`` are
kept. A child never scores above its parent, and ties go to the earlier (shallower) node, so
the kept set is a connected tree; kept nodes stay in drafting order, which is topological.
Under sampling a child is accepted with the target's probability of it at the sampling
temperature, so the draft's log-probs are taken at that temperature too: a flat (hot)
distribution then spreads the budget wide, a peaked (cold) one sends it deep.
All bookkeeping is batched tensor work on the device; nothing is read back.
"""
from __future__ import annotations

import torch

from treedec.decoding.sampling import SamplingParams
from treedec.tree.policies.base import ForestAncestry, TreePolicy, ancestry
from treedec.tree.tree import Tree, TreeError


class DynamicPolicy(TreePolicy):
    def __init__(self, total_tokens: int = 60, depth: int = 6, top_k: int = 10):
        if top_k < 1 or depth < 1:
            raise TreeError(f"dynamic tree needs top_k >= 1 and depth >= 1, got top_k={top_k}, depth={depth}")
        n_drafted = top_k + (depth - 1) * top_k * top_k
        if not 2 <= total_tokens <= n_drafted + 1:
            raise TreeError(
                f"total_tokens={total_tokens} must be in [2, {n_drafted + 1}]: top_k={top_k} and depth={depth} "
                f"draft only {n_drafted} nodes (raise depth/top_k or lower total_tokens)"
            )
        self.total_tokens, self.max_depth, self.top_k = total_tokens, depth, top_k
        self.max_size = total_tokens
        self.max_inputs = top_k * (depth - 1)
        self.max_rank = top_k - 1

    def _constants(self, B: int, dev) -> dict:
        """Index tensors every step needs, made once per (batch, device): depth and rank of each candidate."""
        key = (B, str(dev))
        if getattr(self, "_const_key", None) != key:
            k, D = self.top_k, self.max_depth
            depth = [1] * k + [d for d in range(2, D + 1) for _ in range(k * k)]
            rank = list(range(k)) + list(range(k)) * (k * (D - 1))
            t = torch.tensor([depth, rank], device=dev)
            self._const = dict(depth=t[0].expand(B, -1), rank=t[1].expand(B, -1),
                               first=torch.arange(k, device=dev).expand(B, k),
                               slots=torch.arange(1, self.total_tokens, device=dev).expand(B, -1))
            self._const_key = key
        return self._const

    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Tree:
        B, k, dev = drafter.batch, self.top_k, drafter.device
        c = self._constants(B, dev)
        temp = 1.0 if params is None or params.greedy else float(params.temperature)
        n_all = k + (self.max_depth - 1) * k * k
        # Every drafted node (candidate): token, cumulative score, parent candidate (-1 = root).
        toks = torch.empty(B, n_all, dtype=torch.long, device=dev)
        scores = torch.empty(B, n_all, device=dev)
        parents = torch.empty(B, n_all, dtype=torch.long, device=dev)
        scores[:, :k], toks[:, :k] = drafter.root_topk(k, temp)
        parents[:, :k] = -1
        frontier = c["first"]  # candidate ids of nodes to expand next
        front_feat = drafter.root_feat[:, None].expand(-1, k, -1)  # the feature each frontier node reads
        forest = ForestAncestry(B, max(self.max_inputs, 1), dev)
        parent_inputs = None  # drafter-input ids of the frontier's parents (None: children of the root)
        n_cand = k
        for d in range(2, self.max_depth + 1):
            n_prev = forest.n
            anc_rows = forest.add(parent_inputs, k)
            feat, logits = drafter.expand(toks.gather(1, frontier), front_feat, depth=d - 1,
                                          anc_rows=anc_rows, n_prev=n_prev)
            child_score, child_tok = drafter.topk(logits, k, temp)  # [B, k, k]
            cum = (scores.gather(1, frontier)[:, :, None] + child_score).reshape(B, k * k)
            new = slice(n_cand, n_cand + k * k)
            toks[:, new], scores[:, new] = child_tok.reshape(B, k * k), cum
            parents[:, new] = frontier[:, :, None].expand(B, k, k).reshape(B, k * k)
            if d < self.max_depth:
                best = torch.sort(cum, dim=1, descending=True, stable=True).indices[:, :k]
                src = best // k  # which frontier slot each new frontier node came from
                front_feat = feat.gather(1, src[:, :, None].expand(-1, -1, feat.shape[-1]))
                parent_inputs = n_prev + src
                frontier = n_cand + best
            n_cand += k * k
        return self._rerank(drafter.root_tokens, toks, scores, parents)

    def _rerank(self, root, toks, scores, parents) -> Tree:
        B, dev = toks.shape[0], toks.device
        c = self._constants(B, dev)
        depths, ranks = c["depth"], c["rank"]
        keep = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : self.total_tokens - 1]
        keep = keep.sort(dim=1).values  # drafting order is topological
        pick = lambda t: t.gather(1, keep)  # noqa: E731
        # Map a candidate's parent id to its position in the kept tree (+1 for the root; -1 -> root 0).
        pos = torch.full((B, toks.shape[1] + 1), -1, dtype=torch.long, device=dev)
        pos[:, 0] = 0
        pos.scatter_(1, keep + 1, c["slots"])
        new_par = pos.gather(1, pick(parents) + 1)  # connected by construction: never -1 (tests check it)
        z = lambda dtype: torch.zeros(B, 1, dtype=dtype, device=dev)  # noqa: E731
        par = torch.cat([z(torch.long) - 1, new_par], 1)
        return Tree(
            parents=par,
            depth=torch.cat([z(torch.long), pick(depths)], 1),
            rank=torch.cat([z(torch.long), pick(ranks)], 1),
            tokens=torch.cat([root[:, None], pick(toks)], 1),
            scores=torch.cat([z(scores.dtype), pick(scores)], 1),
            anc=ancestry(par, self.max_depth),
        )
