"""Best-first trees from a one-pass head's per-position marginals (DDTree, arXiv 2604.12989).

A one-pass head gives, in one forward, the distribution q_d of the token at each depth d = 1..D below the root,
whatever the drafts above it. A node is a path of ranks (r_1, ..., r_d): the r_i-th most likely token of q_i at
depth i. Its score is sum_i log q_i(r_i), the log-probability of the path under the product of marginals, so a child
never scores above its parent and the r-th sibling never above the (r-1)-th. The tree of ``total_tokens`` nodes is
then simply the T - 1 best-scoring paths of depth <= D: that set is closed under parents, and a heap growing the tree
best-first (DDTree's) pops exactly it.

On the device, with no host reads, this is one top-k per depth: the best T - 1 nodes at depth d can only be children
of the best T - 1 at depth d - 1, each taking one of the T - 1 best tokens of q_d; the best T - 1 of those k·k
candidates are depth d's, and the best T - 1 over all depths are the tree (ties go to the shallower, earlier node,
so a kept node's parent is kept). Nodes stay in drafting order, which is topological.

A marginal is not an acceptance rate: a one-pass head's deeper marginals are underconfident (it cannot know which
drafts above it will be kept), so raw scores spend the budget on width. With a ``calibration`` (``python -m
treedec.calibrate`` on the head, the same per-depth maps ``tree=dynamic`` reads) each term is the measured acceptance
of a depth-d token of that marginal probability instead, a monotone map per depth, so each depth's order and a
child's score below its parent's are kept and the paths are ranked by real acceptance.

Lossless for greedy and sampling decoding alike: a node's children are distinct tokens chosen deterministically from
the marginals, so verification's sample-then-walk rule applies unchanged (docs/design.md §5).
"""
from __future__ import annotations

import torch

from treedec.conf_defaults import shipped_defaults
from treedec.sampling import SamplingParams
from treedec.tree import calibration as calib
from treedec.tree.policies.base import TreePolicy, kept_tree, kept_tree_constants, whole
from treedec.tree.policies.dynamic import Pool
from treedec.tree.tree import Tree, TreeError

_D = shipped_defaults("tree/best_first")  # the defaults of tree=best_first, written once there


class BestFirstPolicy(TreePolicy):
    """``total_tokens`` nodes (root included) of the best paths under ``depth`` from one pass of a parallel head."""

    reads = "marginals"

    def __init__(self, total_tokens: int = _D["total_tokens"], depth: int = _D["depth"],
                 calibration=_D["calibration"], draft_path: str | None = _D["draft_path"]):
        """``calibration``: a calibration file, ``auto`` (the one next to ``draft_path``'s head, if any) or None (the
        raw marginals, DDTree's)."""
        self.calibration = calib.resolve(calibration, draft_path)
        self.total_tokens = whole(total_tokens, "total_tokens", 2)
        self.max_depth = whole(depth, "depth")
        self.max_size = self.total_tokens
        self.k = self.total_tokens - 1  # tokens of each marginal a node may take: the T - 1 best
        self.max_rank = self.k - 1
        self.max_inputs = self.max_depth - 1  # draft-cache slots past the prefix a step writes: the mask positions
        self._const: tuple = ()

    def validate(self, vocab_size: int) -> None:
        if self.k > vocab_size:
            raise TreeError(f"tree.total_tokens={self.total_tokens} takes the {self.k} best tokens of each depth's "
                            f"marginal, but the draft vocabulary has {vocab_size}: set tree.total_tokens <= "
                            f"{vocab_size + 1}")

    def _constants(self, B: int, dev) -> dict:
        key = (B, str(dev))
        if not self._const or self._const[0] != key:
            k, D = self.k, self.max_depth
            c = kept_tree_constants(B, dev, k * D, self.total_tokens)
            c["first1"] = torch.arange(1, k + 1, device=dev).expand(B, k)
            c["rank1"] = torch.arange(k, device=dev).expand(B, k)
            c["depth1"] = torch.arange(1, D + 1, device=dev)[None, :, None]  # [1, D, 1] each marginal's depth
            self._const = (key, c)
        return self._const[1]

    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Tree:
        return self.select(self.pool(drafter, params, self.max_depth, self.k), self.total_tokens)

    def pool(self, drafter, params: SamplingParams | None, D: int, k: int) -> Pool:
        """Every candidate of depth <= ``D`` (<= the constructor's) that can be among the best ``k + 1``-node tree's:
        each depth's ``k`` best rank paths, in drafting order (``k`` <= the constructor's T - 1)."""
        B, dev = drafter.batch, drafter.device
        c = self._constants(B, dev)
        temp = 1.0 if params is None or params.greedy else float(params.temperature)
        lq, tok = drafter.topk(drafter.marginals(D), k, temp)  # [B, D, k] each depth's k best, descending
        cal = self.calibration
        sc = lq if cal is None else cal.log_accept(lq, c["depth1"][:, :D])  # (monotone: each depth's order kept)
        first1 = c["first1"][:, :k]
        scores, toks, ranks, parents1 = [sc[:, 0]], [tok[:, 0]], [c["rank1"][:, :k]], [c["zero"].expand(B, k)]
        logqs = [lq[:, 0]]
        front_score, front_id1, front_logq = sc[:, 0], first1, lq[:, 0]  # depth d's best k: scores, ids + 1
        for d in range(1, D):
            cand = (front_score[:, :, None] + sc[:, d, None, :]).view(B, k * k)
            best = cand.topk(k, dim=1, sorted=True)
            slot, rank = best.indices // k, best.indices % k
            scores.append(best.values)
            toks.append(tok[:, d].gather(1, rank))
            ranks.append(rank)
            parents1.append(front_id1.gather(1, slot))
            if cal is not None:  # the raw cumulative log-marginals beside the calibrated scores (Tree.scores)
                front_logq = front_logq.gather(1, slot) + lq[:, d].gather(1, rank)
                logqs.append(front_logq)
            front_score, front_id1 = best.values, first1 + d * k
        score = torch.cat(scores, 1)
        depth = torch.arange(1, D + 1, device=dev).repeat_interleave(k).expand(B, -1)
        return Pool(drafter.root_tokens, torch.cat(toks, 1), score if cal is None else torch.cat(logqs, 1), score,
                    torch.cat(parents1, 1), depth, torch.cat(ranks, 1), D, c)

    def select(self, pool: Pool, T: int) -> Tree:
        """The ``T``-node tree of ``pool``'s best paths (ties: the earlier, shallower candidate)."""
        keep = torch.sort(pool.score, dim=1, descending=True, stable=True).indices[:, : T - 1]
        return kept_tree(pool.consts, pool.root, pool.tokens, pool.logq, pool.parents1, pool.depth, pool.rank, keep,
                         pool.levels)
