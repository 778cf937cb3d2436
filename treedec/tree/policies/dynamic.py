"""EAGLE-2 dynamic tree: expand by estimated acceptance, then rerank to a node budget.

Per depth, the ``top_k`` drafted nodes with the highest path score are expanded, each proposing
its ``top_k`` most likely children. After ``depth`` levels every drafted node competes on its
score and the best ``total_tokens - 1`` are kept. A node's score is a sum over its path of one
non-positive term per edge: the draft's log-probability (EAGLE-2), or with a ``calibration``
(tree/calibration.py) the log of the edge's calibrated acceptance, so the score estimates
log P(the path is accepted). A child therefore never scores above its parent, and ties go to the
earlier (shallower) node, so the kept set is a connected tree; kept nodes stay in drafting order,
which is topological. Under sampling the draft's log-probs are taken at the sampling temperature
(a child is accepted with the target's probability of it at that temperature).

``total_tokens="auto"`` picks each step's T (from a few buckets up to ``max_total_tokens``) and
depth to maximise expected tokens per second (tree/budget.py): the expected accepted length of
the best T-node subtree is the prefix sum of the sorted path acceptances, computed here for
every arm at once, and the step time is measured between successive ``draft()`` calls.
All per-step bookkeeping is batched tensor work on the device; nothing is read back.
"""
from __future__ import annotations

import logging

import torch

from treedec.decoding.sampling import SamplingParams
from treedec.tree import calibration as calib
from treedec.tree.budget import BUCKETS, BudgetController
from treedec.tree.policies.base import ForestAncestry, TreePolicy, ancestry
from treedec.tree.tree import Tree, TreeError

log = logging.getLogger(__name__)


def n_drafted(top_k: int, depth: int) -> int:
    """Candidates a dynamic tree of ``top_k`` and ``depth`` drafts (root excluded)."""
    return top_k + (depth - 1) * top_k * top_k


class DynamicPolicy(TreePolicy):
    def __init__(self, total_tokens: int | str = 60, depth: int = 6, top_k: int = 10, calibration=None,
                 draft_path: str | None = None, max_total_tokens: int = 64, min_depth: int | None = None,
                 explore_every: int = 8, clock=None):
        """``calibration``: a calibration file, ``auto`` (the one next to ``draft_path``'s head, if any) or
        None (raw draft probabilities). ``total_tokens="auto"``: online budget in [8, ``max_total_tokens``]
        and depth in [``min_depth`` (None: depth - 2), ``depth``]; ``clock`` replaces ``time.perf_counter``."""
        if top_k < 1 or depth < 1:
            raise TreeError(f"dynamic tree needs top_k >= 1 and depth >= 1, got top_k={top_k}, depth={depth}")
        most = n_drafted(top_k, depth) + 1
        self.auto = str(total_tokens) == "auto"
        if self.auto:
            lo = max(1, depth - 2) if min_depth is None else int(min_depth)
            if not 1 <= lo <= depth:
                raise TreeError(f"tree.min_depth={min_depth} must be in [1, depth={depth}]")
            cap = min(int(max_total_tokens), most)
            sizes = [T for T in BUCKETS if T <= cap] or [cap]
            arms = [(T, d) for d in range(lo, depth + 1) for T in sizes if T <= n_drafted(top_k, d) + 1]
            if cap < 2 or not arms:
                raise TreeError(f"tree.total_tokens=auto needs max_total_tokens >= 2 (got {max_total_tokens}) and "
                                f"top_k/depth drafting at least 7 nodes")
            self.budget = BudgetController(arms, explore_every=explore_every, clock=clock)
            self.total_tokens = max(T for T, _ in arms)
        else:
            if isinstance(total_tokens, bool) or not isinstance(total_tokens, int):
                raise TreeError(f"total_tokens must be an int or 'auto', got {total_tokens!r}")
            if not 2 <= total_tokens <= most:
                raise TreeError(
                    f"total_tokens={total_tokens} must be in [2, {most}]: top_k={top_k} and depth={depth} "
                    f"draft only {most - 1} nodes (raise depth/top_k or lower total_tokens)")
            self.budget, self.total_tokens = None, total_tokens
        self.max_depth, self.top_k = depth, top_k
        self.calibration = calib.resolve(calibration, draft_path)
        self._mode_checked = self.calibration is None
        self.max_size = self.total_tokens
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
            if self.budget is not None:  # the host buffer the arms' estimates are copied into
                self._curve = torch.empty(len(self.budget.arms), pin_memory=dev.type == "cuda")
                self._arm_plan: dict = {}
            self._const_key = key
        return self._const

    def _check_mode(self, params: SamplingParams | None) -> None:
        """Warn once when the calibration was measured under another acceptance rule than the one decoding uses."""
        self._mode_checked = True
        rule = (self.calibration.meta.get("mode") or {}).get("rule")
        now = "greedy" if params is None or params.greedy else "sampling"
        if rule is not None and rule != now:
            log.warning("tree.calibration was measured under %s acceptance but decoding is %s: the tree may be "
                        "mis-sized (still lossless); recalibrate with the same sampling settings", rule, now)

    def _edge(self, logq: torch.Tensor, depth: int) -> torch.Tensor:
        """Score term of edges into ``depth``: log calibrated acceptance, or the raw draft log-prob."""
        return logq if self.calibration is None else self.calibration.log_accept(logq, depth)

    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Tree:
        B, k, dev = drafter.batch, self.top_k, drafter.device
        c = self._constants(B, dev)
        T, D = self.budget.start(drafter, B) if self.budget is not None else (self.total_tokens, self.max_depth)
        temp = 1.0 if params is None or params.greedy else float(params.temperature)
        if not self._mode_checked:
            self._check_mode(params)
        n_all = n_drafted(k, D)
        # Every drafted node (candidate): token, cumulative draft log-prob, path score, parent candidate (-1 = root).
        toks = torch.empty(B, n_all, dtype=torch.long, device=dev)
        logq = torch.empty(B, n_all, device=dev)
        score = torch.empty(B, n_all, device=dev)
        parents = torch.empty(B, n_all, dtype=torch.long, device=dev)
        logq[:, :k], toks[:, :k] = drafter.root_topk(k, temp)
        score[:, :k] = self._edge(logq[:, :k], 1)
        parents[:, :k] = -1
        frontier = c["first"]  # candidate ids of nodes to expand next
        front_feat = drafter.root_feat[:, None].expand(-1, k, -1)  # the feature each frontier node reads
        forest = ForestAncestry(B, max(self.max_inputs, 1), dev)
        parent_inputs = None  # drafter-input ids of the frontier's parents (None: children of the root)
        n_cand = k
        for d in range(2, D + 1):
            n_prev = forest.n
            anc_rows = forest.add(parent_inputs, k)
            feat, logits = drafter.expand(toks.gather(1, frontier), front_feat, depth=d - 1,
                                          anc_rows=anc_rows, n_prev=n_prev)
            child_logq, child_tok = drafter.topk(logits, k, temp)  # [B, k, k]
            new = slice(n_cand, n_cand + k * k)
            toks[:, new] = child_tok.reshape(B, k * k)
            logq[:, new] = (logq.gather(1, frontier)[:, :, None] + child_logq).reshape(B, k * k)
            cum = (score.gather(1, frontier)[:, :, None] + self._edge(child_logq, d)).reshape(B, k * k)
            score[:, new] = cum
            parents[:, new] = frontier[:, :, None].expand(B, k, k).reshape(B, k * k)
            if d < D:
                best = torch.sort(cum, dim=1, descending=True, stable=True).indices[:, :k]
                src = best // k  # which frontier slot each new frontier node came from
                front_feat = feat.gather(1, src[:, :, None].expand(-1, -1, feat.shape[-1]))
                parent_inputs = n_prev + src
                frontier = n_cand + best
            n_cand += k * k
        order = torch.sort(score, dim=1, descending=True, stable=True)
        if self.budget is not None:
            self._offer(c["depth"][:, :n_all], score, D)
        return self._rerank(drafter.root_tokens, toks, logq, parents, order.indices[:, : T - 1], D)

    def _offer(self, depths: torch.Tensor, score: torch.Tensor, D: int) -> None:
        """E[accepted] of the best T-subtree for every arm drafted this step, copied to the host asynchronously.

        A node is accepted with probability exp(score) (calibrated), E[accepted] is the sum over kept
        nodes, and the best T-subtree holds the T-1 highest scores, so prefix sums of the sorted
        probabilities give every T at once; a depth limit masks deeper nodes out first (all limits in
        one sort). Arms deeper than D get NaN (not measured this step).
        """
        arms = self.budget.arms
        if D not in self._arm_plan:  # host ints -> index tensors, once per drafted depth
            dev = score.device
            limits = sorted({d for _, d in arms if d <= D})
            self._arm_plan[D] = (torch.tensor(limits, device=dev)[:, None, None],
                                 torch.tensor([limits.index(d) if d <= D else 0 for _, d in arms], device=dev),
                                 torch.tensor([T - 2 if d <= D else 0 for T, d in arms], device=dev),
                                 torch.tensor([d <= D for _, d in arms], device=dev))
        lims, row, col, ok = self._arm_plan[D]
        masked = torch.where(depths[None] <= lims, score[None], -torch.inf)  # [limits, B, candidates]
        table = masked.sort(-1, descending=True).values.exp().cumsum(-1).mean(1)  # [limits, candidates]
        self._curve.copy_(torch.where(ok, table[row, col], torch.nan), non_blocking=True)
        self.budget.offer(self._curve, arms)

    def _rerank(self, root, toks, logq, parents, keep, depth: int) -> Tree:
        B, dev = toks.shape[0], toks.device
        c = self._constants(B, dev)
        keep = keep.sort(dim=1).values  # drafting order is topological
        pick = lambda t: t.gather(1, keep)  # noqa: E731
        # Map a candidate's parent id to its position in the kept tree (+1 for the root; -1 -> root 0).
        pos = torch.full((B, toks.shape[1] + 1), -1, dtype=torch.long, device=dev)
        pos[:, 0] = 0
        pos.scatter_(1, keep + 1, c["slots"][:, : keep.shape[1]])
        new_par = pos.gather(1, pick(parents) + 1)  # connected by construction: never -1 (tests check it)
        z = lambda dtype: torch.zeros(B, 1, dtype=dtype, device=dev)  # noqa: E731
        par = torch.cat([z(torch.long) - 1, new_par], 1)
        n = toks.shape[1]
        return Tree(
            parents=par,
            depth=torch.cat([z(torch.long), pick(c["depth"][:, :n])], 1),
            rank=torch.cat([z(torch.long), pick(c["rank"][:, :n])], 1),
            tokens=torch.cat([root[:, None], pick(toks)], 1),
            scores=torch.cat([z(logq.dtype), pick(logq)], 1),
            anc=ancestry(par, depth),
        )
