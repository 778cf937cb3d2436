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

Drafting (:meth:`DynamicPolicy.pool`) and keeping (:meth:`DynamicPolicy.select`) are separate, so that
``tree=auto`` (policies/auto.py) can read every candidate's score and size the tree per step.

``node_share < 1`` gives each row its own budget: of the B*(T-1) candidate slots of a step only
the ``node_share`` best by calibrated path acceptance *across the batch* are kept (each row keeps a
prefix of its own ranking, so its tree stays connected and topological); a row's other slots are
padding nodes (``Tree.pad``), which see only themselves and are never accepted.
All per-step bookkeeping is batched tensor work on the device; nothing is read back.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from treedec.conf_defaults import shipped_defaults
from treedec.sampling import SamplingParams
from treedec.tree import calibration as calib
from treedec.tree.policies.base import ForestAncestry, TreePolicy, kept_tree, kept_tree_constants, whole
from treedec.tree.policies.chain import ChainPolicy
from treedec.tree.tree import Tree, TreeError

log = logging.getLogger(__name__)
_D = shipped_defaults("tree/dynamic")  # the defaults of tree=dynamic, written once there


def n_drafted(top_k: int, depth: int) -> int:
    """Candidates a dynamic tree of ``top_k`` and ``depth`` drafts (root excluded)."""
    return top_k + (depth - 1) * top_k * top_k


def narrowest_top_k(total_tokens: int, depth: int) -> int:
    """``top_k: auto``: the smallest width whose tree of ``depth`` levels drafts the ``total_tokens - 1`` nodes kept."""
    return next(k for k in range(1, total_tokens + 1) if n_drafted(k, depth) >= total_tokens - 1)


class Pool(NamedTuple):
    """Every candidate one step drafted ([B, n] each, in drafting order) before :meth:`DynamicPolicy.select`."""

    root: torch.Tensor  # [B] the root tokens
    tokens: torch.Tensor
    logq: torch.Tensor  # cumulative draft log-probs (Tree.scores)
    score: torch.Tensor  # path scores: log calibrated acceptance (or logq when uncalibrated)
    parents1: torch.Tensor  # each candidate's parent id + 1 (0: the root)
    depth: torch.Tensor  # [B, n] each candidate's depth
    rank: torch.Tensor  # [B, n] each candidate's sibling rank
    levels: int  # depths drafted
    consts: dict


class DynamicPolicy(TreePolicy):
    def __init__(self, total_tokens: int = _D["total_tokens"], depth: int = _D["depth"], top_k: int | str = _D["top_k"],
                 calibration=_D["calibration"], draft_path: str | None = _D["draft_path"],
                 node_share: float = _D["node_share"]):
        """``calibration``: a calibration file, ``auto`` (the one next to ``draft_path``'s head, if any) or None (raw
        draft probabilities). ``top_k="auto"``: the narrowest width that holds ``total_tokens`` at ``depth``, so any
        (total_tokens, depth) a tree of that depth can hold works (a sweep over shapes). ``node_share`` in (0, 1]: the
        share of the batch's B*(T-1) candidate slots kept, best calibrated acceptances first across rows (per-row
        budgets; the rest is padding)."""
        total_tokens, depth, top_k, node_share = self.check_sizes(total_tokens, depth, top_k, node_share)
        self.total_tokens, self.node_share = total_tokens, node_share
        self.max_depth, self.top_k = depth, top_k
        self.calibration = calib.resolve(calibration, draft_path)
        self._mode_checked = self.calibration is None
        self.max_size = self.total_tokens
        self.max_inputs = max(top_k * (depth - 1), depth)
        self.max_rank = top_k - 1
        self._chains: dict[tuple[int, bool], ChainPolicy] = {}  # (depth, scored) -> a top_k 1 tree's chain

    @staticmethod
    def check_sizes(total_tokens, depth, top_k, node_share) -> tuple[int, int, int, float]:
        """The checked ``(total_tokens, depth, top_k, node_share)``, ``top_k="auto"`` resolved; a TreeError naming
        the ``tree.*`` key otherwise. The one copy of this rule: the constructor runs it for a Python caller, and
        the config layer (treedec.config.checks) on a config's values before anything loads."""
        if str(total_tokens) == "auto":
            raise TreeError("tree.total_tokens=auto is now its own policy: pass tree=auto (EAGLE-2's dynamic tree "
                            "takes a whole-number total_tokens)")
        depth, total_tokens = whole(depth, "depth"), whole(total_tokens, "total_tokens", 2)
        if str(top_k) == "auto":
            top_k = narrowest_top_k(total_tokens, depth)
            if n_drafted(top_k, depth) < total_tokens - 1:  # (never: a wide enough tree holds any T)
                raise TreeError(f"tree.total_tokens={total_tokens} does not fit depth {depth}")
        top_k = whole(top_k, "top_k")
        most = n_drafted(top_k, depth) + 1
        if total_tokens > most:
            raise TreeError(
                f"total_tokens={total_tokens} must be in [2, {most}]: top_k={top_k} and depth={depth} "
                f"draft only {most - 1} nodes (raise depth/top_k, set tree.top_k=auto, or lower total_tokens)")
        if not 0 < float(node_share) <= 1:
            raise TreeError(f"tree.node_share={node_share} must be in (0, 1] (1: every row keeps T-1 nodes)")
        return total_tokens, depth, top_k, float(node_share)

    def _constants(self, B: int, dev, k: int) -> dict:
        """Index tensors every step needs, made once per (batch, device, top_k): depth and rank of each candidate."""
        key = (B, str(dev))
        if getattr(self, "_const_key", None) != key:
            self._const, self._const_key = {}, key
        if k not in self._const:
            D, T = self.max_depth, self.total_tokens
            depth = [1] * k + [d for d in range(2, D + 1) for _ in range(k * k)]
            rank = list(range(k)) + list(range(k)) * (k * (D - 1))
            # a candidate's column among the per-depth parent ids [root, depth 1's k nodes, each depth's k expanded]
            parent_col = [0] * k + [1 + (d - 2) * k + j // k for d in range(2, D + 1) for j in range(k * k)]
            t = torch.tensor([depth, rank, parent_col], device=dev)
            self._const[k] = dict(depth=t[0].expand(B, -1), rank=t[1].expand(B, -1), parent_col=t[2],
                                  first1=torch.arange(1, k + 1, device=dev).expand(B, k),
                                  rows=torch.arange(B, device=dev)[:, None],
                                  **kept_tree_constants(B, dev, len(depth), T))
        return self._const[k]

    def _check_mode(self, params: SamplingParams | None) -> None:
        """Warn once when the calibration was measured under another acceptance rule than the one decoding uses."""
        self._mode_checked = True
        rule = (self.calibration.meta.get("mode") or {}).get("rule")
        now = "greedy" if params is None or params.greedy else "sampling"
        if rule is not None and rule != now:
            log.warning("tree.calibration was measured under %s acceptance but decoding is %s: the tree may be "
                        "mis-sized (still lossless); recalibrate with the same sampling settings", rule, now)

    def edge_score(self, logq: torch.Tensor, depth: int | torch.Tensor) -> torch.Tensor:
        """Score term of edges into ``depth``: log calibrated acceptance, or the raw draft log-prob."""
        return logq if self.calibration is None else self.calibration.log_accept(logq, depth)

    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Tree:
        T, D, k = self.total_tokens, self.max_depth, self.top_k
        if k == 1 and self.node_share >= 1:  # a chain: its best T-1 nodes are its first T-1, nothing to rerank
            return self.chain(min(D, T - 1), scored=True).draft(drafter)
        return self.select(self.pool(drafter, params, D, k), T)

    def pool(self, drafter, params: SamplingParams | None, D: int, k: int) -> Pool:
        """Draft ``D`` levels of width ``k`` (<= the constructor's depth and top_k): every candidate and its score."""
        B, dev = drafter.batch, drafter.device
        c = self._constants(B, dev, k)
        temp = 1.0 if params is None or params.greedy else float(params.temperature)
        if not self._mode_checked:
            self._check_mode(params)
        raw = self.calibration is None  # then a node's score is its cumulative draft log-prob: one tensor for both
        # Per depth: the candidates' tokens, cumulative draft log-probs and path scores [B, m] (m = k, then k*k), and
        # the candidate ids (+1; 0 is the root) of the nodes expanded there, the parents of the next depth's
        # candidates. Concatenated once at the end: no writes into preallocated buffers, no gathers over them.
        lq, tok = drafter.root_topk(k, temp)
        sc = lq if raw else self.edge_score(lq, 1)
        toks, lqs, scs, fronts = [tok], [lq], [sc], [c["zero"], c["first1"]]  # (depth 1's parent: the root, 0)
        front_tok, front_lq, front_sc = tok, lq, sc
        front_feat = drafter.root_feat[:, None].expand(-1, k, -1)  # the feature each frontier node reads
        forest = ForestAncestry(B, max(self.max_inputs, 1), dev)
        parent_inputs = None  # drafter-input ids of the frontier's parents (None: children of the root)
        n_cand = k
        for d in range(2, D + 1):
            n_prev = forest.n
            anc_rows = forest.add(parent_inputs, k)
            feat, logits = drafter.expand(front_tok, front_feat, depth=d - 1, anc_rows=anc_rows, n_prev=n_prev)
            child_lq, child_tok = drafter.topk(logits, k, temp)  # [B, k, k]
            tok = child_tok.reshape(B, k * k)
            lq = (front_lq[:, :, None] + child_lq).view(B, k * k)
            sc = lq if raw else (front_sc[:, :, None] + self.edge_score(child_lq, d)).view(B, k * k)
            toks.append(tok), lqs.append(lq), scs.append(sc)
            if d < D:
                best = torch.sort(sc, dim=1, descending=True, stable=True).indices[:, :k]
                src = best // k  # which frontier slot each new frontier node came from
                front_feat = feat[c["rows"], src]  # indexing: 3x faster than gather over an expanded index
                parent_inputs = n_prev + src
                front_tok, front_lq = tok.gather(1, best), lq.gather(1, best)
                front_sc = front_lq if raw else sc.gather(1, best)
                fronts.append(best + (n_cand + 1))
            n_cand += k * k
        score = torch.cat(scs, 1)
        parents1 = torch.cat(fronts, 1)[:, c["parent_col"][:n_cand]]  # each candidate's parent id + 1 (0: the root)
        return Pool(drafter.root_tokens, torch.cat(toks, 1), score if raw else torch.cat(lqs, 1), score, parents1,
                    c["depth"][:, :n_cand], c["rank"][:, :n_cand], D, c)

    def select(self, pool: Pool, T: int) -> Tree:
        """Keep the ``T - 1`` best-scoring candidates of ``pool`` (per row; per batch with ``node_share < 1``)."""
        order = torch.sort(pool.score, dim=1, descending=True, stable=True)
        pad = None if self.node_share >= 1 else self.row_pad(order.values[:, : T - 1])
        return kept_tree(pool.consts, pool.root, pool.tokens, pool.logq, pool.parents1, pool.depth, pool.rank,
                         order.indices[:, : T - 1], pool.levels, pad)

    def chain(self, depth: int, scored: bool = False) -> ChainPolicy:
        """The lean top-1 chain of ``depth`` drafts (a top_k 1 tree), made once per (depth, scored)."""
        if (depth, scored) not in self._chains:
            self._chains[depth, scored] = ChainPolicy(depth, scores=scored)
        return self._chains[depth, scored]

    def kept(self, B: int, T: int) -> int:
        """Real (non-root) nodes kept over a batch of B rows at width T: the per-row budgets' global cap."""
        return max(1, round(self.node_share * B * (T - 1)))

    def row_pad(self, ranked: torch.Tensor) -> torch.Tensor:
        """Per-row budgets: ``ranked`` [B, T-1] each row's best scores (descending) -> padding mask [B, T-1].

        The :meth:`kept` best scores across the batch are kept; a row keeps a prefix of its own
        ranking (ties count by rank), so a kept node's parent, which ranks before it, is kept too.
        """
        B, n = ranked.shape
        top = ranked.flatten().topk(self.kept(B, n + 1)).indices
        counts = torch.zeros(B, dtype=torch.long, device=ranked.device).scatter_add_(0, top // n, torch.ones_like(top))
        return torch.arange(n, device=ranked.device)[None] >= counts[:, None]
