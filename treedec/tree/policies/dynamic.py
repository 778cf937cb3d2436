"""EAGLE-2 dynamic tree: expand by draft confidence, then rerank to a node budget.

Per depth, the ``top_k`` drafted nodes with the highest cumulative draft log-probability are
expanded, each proposing its ``top_k`` most likely children. After ``depth`` levels every
drafted node competes on cumulative log-probability and the best ``total_tokens - 1`` are
kept. A child never scores above its parent, and ties go to the earlier (shallower) node, so
the kept set is a connected tree; kept nodes stay in drafting order, which is topological.
"""
from __future__ import annotations

import torch

from treedec.decoding.sampling import SamplingParams
from treedec.tree.policies.base import DraftTree, TreePolicy
from treedec.tree.tree import TreeError


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

    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> DraftTree:
        B, k, dev = drafter.batch, self.top_k, drafter.device
        top = drafter.root_logp.topk(k, dim=-1)
        # Every drafted node: token, cumulative score, parent (candidate index, -1 = root), depth, rank.
        toks, scores = [top.indices], [top.values.float()]
        parents = [torch.full((B, k), -1, dtype=torch.long, device=dev)]
        depths = [torch.ones(B, k, dtype=torch.long, device=dev)]
        ranks = [torch.arange(k, device=dev).expand(B, k)]
        frontier = torch.arange(k, device=dev).expand(B, k)  # candidate ids of nodes to expand next
        front_feat = drafter.root_feat[:, None].expand(-1, k, -1)  # the feature each frontier node reads
        forest_parents = torch.full((B, k), -1, dtype=torch.long, device=dev)  # drafter-input parents
        n_cand = k
        for d in range(2, self.max_depth + 1):
            all_tok, all_score = torch.cat(toks, 1), torch.cat(scores, 1)
            n_prev = forest_parents.shape[1] - k
            feat, logp = drafter.expand(all_tok.gather(1, frontier), front_feat, depth=d - 1,
                                        forest_parents=forest_parents, n_prev=n_prev)
            child = logp.float().topk(k, dim=-1)  # [B, k, k]
            cum = all_score.gather(1, frontier)[:, :, None] + child.values
            toks.append(child.indices.reshape(B, k * k))
            scores.append(cum.reshape(B, k * k))
            parents.append(frontier[:, :, None].expand(B, k, k).reshape(B, k * k))
            depths.append(torch.full((B, k * k), d, dtype=torch.long, device=dev))
            ranks.append(torch.arange(k, device=dev).repeat(k).expand(B, k * k))
            if d < self.max_depth:
                best = torch.sort(cum.reshape(B, k * k), dim=1, descending=True, stable=True).indices[:, :k]
                src = best // k  # which frontier slot each new frontier node came from
                front_feat = feat.gather(1, src[:, :, None].expand(-1, -1, feat.shape[-1]))
                forest_parents = torch.cat([forest_parents, n_prev + src], 1)
                frontier = n_cand + best
            n_cand += k * k
        return self._rerank(drafter.root_tokens, torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1),
                            torch.cat(depths, 1), torch.cat(ranks, 1))

    def _rerank(self, root, toks, scores, parents, depths, ranks) -> DraftTree:
        B, dev = toks.shape[0], toks.device
        keep = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : self.total_tokens - 1]
        keep = keep.sort(dim=1).values  # drafting order is topological
        pick = lambda t: t.gather(1, keep)  # noqa: E731
        # Map a candidate's parent id to its position in the kept tree (+1 for the root; -1 -> root 0).
        pos = torch.full((B, toks.shape[1] + 1), -1, dtype=torch.long, device=dev)
        pos[:, 0] = 0
        pos.scatter_(1, keep + 1, torch.arange(1, keep.shape[1] + 1, device=dev).expand(B, -1))
        new_par = pos.gather(1, pick(parents) + 1)
        if bool((new_par < 0).any()):
            raise RuntimeError("dynamic tree rerank produced a disconnected tree (a kept node's parent was dropped)")
        z = lambda dtype: torch.zeros(B, 1, dtype=dtype, device=dev)  # noqa: E731
        return DraftTree(
            parents=torch.cat([z(torch.long) - 1, new_par], 1),
            depth=torch.cat([z(torch.long), pick(depths)], 1),
            rank=torch.cat([z(torch.long), pick(ranks)], 1),
            tokens=torch.cat([root[:, None], pick(toks)], 1),
            scores=torch.cat([z(scores.dtype), pick(scores)], 1),
        )
