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
every arm at once, and the step time is measured between successive ``draft()`` calls. The arms
include T=1 (the root alone: a plain decoding step, nothing drafted), T=2, 4 (a chain or a twig) and
a chain at every depth tried (T = depth + 1), so when the target gets compute-bound in rows*T (large
batches) the budget shrinks, down to plain decoding, inside the same loop. ``depth``/``top_k`` are
then the largest pool: each arm drafts the narrowest top_k whose pool holds its T-1 nodes
(``pool_slack``), so a small tree does not pay for a wide pool; a top_k 1 arm is a chain and drafts
through :class:`ChainPolicy`.

``node_share < 1`` gives each row its own budget: of the B*(T-1) candidate slots of a step only
the ``node_share`` best by calibrated path acceptance *across the batch* are kept (each row keeps a
prefix of its own ranking, so its tree stays connected and topological); a row's other slots are
padding nodes (``Tree.pad``), which see only themselves and are never accepted. The batch is still
verified at width T (B*T tokens), the bucket the step-time model chose, so padding never adds a
graph or a host read; on dense verification a padding slot costs as much as a real one.
All per-step bookkeeping is batched tensor work on the device; nothing is read back.
"""
from __future__ import annotations

import logging

import torch

from treedec.decoding.sampling import SamplingParams
from treedec.tree import calibration as calib
from treedec.tree.budget import BUCKETS, BudgetController
from treedec.tree.policies.base import ForestAncestry, TreePolicy, ancestry
from treedec.tree.policies.static import ChainPolicy
from treedec.tree.tree import Tree, TreeError

log = logging.getLogger(__name__)


def n_drafted(top_k: int, depth: int) -> int:
    """Candidates a dynamic tree of ``top_k`` and ``depth`` drafts (root excluded)."""
    return top_k + (depth - 1) * top_k * top_k


class DynamicPolicy(TreePolicy):
    def __init__(self, total_tokens: int | str = 60, depth: int = 6, top_k: int = 10, calibration=None,
                 draft_path: str | None = None, max_total_tokens: int = 64, min_depth: int | None = None,
                 explore_every: int = 8, clock=None, node_share: float = 1.0, pool_slack: float = 1.0,
                 chain_depth: int | None = None):
        """``calibration``: a calibration file, ``auto`` (the one next to ``draft_path``'s head, if any) or
        None (raw draft probabilities). ``total_tokens="auto"``: online budget in [1, ``max_total_tokens``]
        (1: plain decoding) and depth in [``min_depth`` (None: depth - 2), ``depth``]; ``clock`` replaces
        ``time.perf_counter``. Each auto arm drafts its own pool: the narrowest top_k (<= ``top_k``) whose
        candidates at that depth number at least ``pool_slack`` * (T-1) (a wider pool ranks better but drafts
        slower; a large slack drafts ``top_k`` always). ``node_share`` in (0, 1]: the share of the batch's
        B*(T-1) candidate slots kept, best calibrated acceptances first across rows (per-row budgets; the rest
        is padding). ``chain_depth`` (auto only): the deepest chain arm (None: ``depth``); chains draft one node per
        depth, so they may go deeper than the bushy pools (on a CPU a 9-deep chain beats the 7-deep one at batch 1)."""
        if top_k < 1 or depth < 1:
            raise TreeError(f"dynamic tree needs top_k >= 1 and depth >= 1, got top_k={top_k}, depth={depth}")
        most = n_drafted(top_k, depth) + 1
        self.auto = str(total_tokens) == "auto"
        if self.auto:
            lo = max(1, depth - 2) if min_depth is None else int(min_depth)
            if not 1 <= lo <= depth:
                raise TreeError(f"tree.min_depth={min_depth} must be in [1, depth={depth}]")
            chain_depth = depth if chain_depth is None else int(chain_depth)
            if chain_depth < depth:
                raise TreeError(f"tree.chain_depth={chain_depth} must be >= depth={depth} (null: depth)")
            cap = min(int(max_total_tokens), most)
            sizes = [T for T in BUCKETS if 2 <= T <= cap] or [cap]
            if not float(pool_slack) >= 1:
                raise TreeError(f"tree.pool_slack={pool_slack} must be >= 1 (1: a pool just holds the T-1 nodes kept)")
            # A T-node tree is at most T-1 deep: the small buckets draft only that deep. (1, 0): the root alone.
            arms = {(T, min(d, T - 1)) for d in range(lo, depth + 1) for T in sizes
                    if T <= n_drafted(top_k, min(d, T - 1)) + 1}
            # and a chain at every depth up to chain_depth (T = depth + 1, between the buckets; min_depth bounds the
            # bushy arms only): on a CPU a plain chain is often the fastest tree (its verify holds fewest tokens), the
            # buckets hold few of them, and which depth pays moves with the batch (at 16 rows the 4-deep chain ran
            # 1.44x vanilla, the 7-deep 1.32x; at one row the 9-deep was best). A chain shallower than the step's
            # tree is observed on every step (its top-1 run), so the shallow ones cost no exploration to judge.
            arms |= {(d + 1, d) for d in range(1, chain_depth + 1) if d + 1 <= cap}
            if cap < 2 or not arms:
                raise TreeError(f"tree.total_tokens=auto needs max_total_tokens >= 2 (got {max_total_tokens}) and "
                                f"top_k/depth drafting at least 7 nodes")
            self.arm_top_k = {(T, d): next((w for w in range(1, top_k) if n_drafted(w, d) >= pool_slack * (T - 1)),
                                           top_k) for T, d in arms}
            arms = [(1, 0), *arms]
            inputs = {(T, d): 1 + k * (d - 1) for (T, d), k in self.arm_top_k.items()}  # the root, then k per depth
            self.budget = BudgetController(arms, explore_every=explore_every, clock=clock, inputs=inputs,
                                           family=self.arm_top_k, narrow=[a for a in arms if a[1] > depth])
            self.total_tokens = max(T for T, _ in arms)
        else:
            if chain_depth is not None:
                raise TreeError("tree.chain_depth is for total_tokens=auto (a fixed tree drafts `depth` levels)")
            if isinstance(total_tokens, bool) or not isinstance(total_tokens, int):
                raise TreeError(f"total_tokens must be an int or 'auto', got {total_tokens!r}")
            if not 2 <= total_tokens <= most:
                raise TreeError(
                    f"total_tokens={total_tokens} must be in [2, {most}]: top_k={top_k} and depth={depth} "
                    f"draft only {most - 1} nodes (raise depth/top_k or lower total_tokens)")
            self.budget, self.total_tokens = None, total_tokens
        if not 0 < float(node_share) <= 1:
            raise TreeError(f"tree.node_share={node_share} must be in (0, 1] (1: every row keeps T-1 nodes)")
        self.node_share = float(node_share)
        self.max_depth, self.top_k = max(depth, chain_depth if self.auto else depth), top_k
        self.calibration = calib.resolve(calibration, draft_path)
        self._mode_checked = self.calibration is None
        self.max_size = self.total_tokens
        self.max_inputs = max(top_k * (depth - 1), self.max_depth)
        self.max_rank = top_k - 1
        # (depth, scored) -> the chain drafted for a top_k 1 arm, planned here so that no step pays it (its plan
        # reads the host); unscored: for the steps that offer no estimates
        self._chains: dict[tuple[int, bool], ChainPolicy] = {}
        for (T, d), k in getattr(self, "arm_top_k", {}).items():
            if k == 1 and T == d + 1:
                for scored in (True, False):
                    self._chain(d, scored)

    def _constants(self, B: int, dev, k: int) -> dict:
        """Index tensors every step needs, made once per (batch, device, top_k): depth and rank of each candidate."""
        key = (B, str(dev))
        if getattr(self, "_const_key", None) != key:
            self._const, self._const_key = {}, key
            if self.budget is not None:  # the host buffer the arms' estimates are copied into
                self._curve = torch.empty(len(self.budget.arms), pin_memory=dev.type == "cuda")
                self._arm_plan: dict = {}
                self._arm_rows: dict = {}
            self._depth_ids = torch.arange(1, self.max_depth + 1, device=dev)
        if k not in self._const:
            D, T = self.max_depth, self.total_tokens
            depth = [1] * k + [d for d in range(2, D + 1) for _ in range(k * k)]
            rank = list(range(k)) + list(range(k)) * (k * (D - 1))
            # a candidate's column among the per-depth parent ids [root, depth 1's k nodes, each depth's k expanded]
            parent_col = [0] * k + [1 + (d - 2) * k + j // k for d in range(2, D + 1) for j in range(k * k)]
            t = torch.tensor([depth, rank, parent_col], device=dev)
            pos = torch.full((1, len(depth) + 1), -1, dtype=torch.long, device=dev)
            pos[:, 0] = 0
            self._const[k] = dict(depth=t[0].expand(B, -1), rank=t[1].expand(B, -1), parent_col=t[2],
                                  first1=torch.arange(1, k + 1, device=dev).expand(B, k),
                                  rows=torch.arange(B, device=dev)[:, None],
                                  slots=torch.arange(1, T, device=dev).expand(B, -1),
                                  pos=pos.expand(B, -1),  # candidate id + 1 -> its slot in the kept tree (-1: not kept)
                                  zero=torch.zeros(B, 1, dtype=torch.long, device=dev),
                                  zero_f=torch.zeros(B, 1, device=dev),
                                  zero_b=torch.zeros(B, 1, dtype=torch.bool, device=dev),
                                  neg1=torch.full((B, 1), -1, dtype=torch.long, device=dev))
        return self._const[k]

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
        B, dev = drafter.batch, drafter.device
        T, D = self.budget.start(drafter, B) if self.budget is not None else (self.total_tokens, self.max_depth)
        if T == 1:  # the budget found that no tree pays: a plain decoding step, nothing drafted
            return Tree.root_only(drafter.root_tokens)
        k = self.top_k if self.budget is None else self.arm_top_k[T, D]  # the arm's own pool
        c = self._constants(B, dev, k)
        if k == 1 and T == D + 1 and self.node_share >= 1:  # a chain of all D drafted nodes: nothing to rerank
            return self._draft_chain(drafter, D)
        temp = 1.0 if params is None or params.greedy else float(params.temperature)
        if not self._mode_checked:
            self._check_mode(params)
        raw = self.calibration is None  # then a node's score is its cumulative draft log-prob: one tensor for both
        # Per depth: the candidates' tokens, cumulative draft log-probs and path scores [B, m] (m = k, then k*k), and
        # the candidate ids (+1; 0 is the root) of the nodes expanded there, the parents of the next depth's
        # candidates. Concatenated once at the end: no writes into preallocated buffers, no gathers over them.
        lq, tok = drafter.root_topk(k, temp)
        sc = lq if raw else self._edge(lq, 1)
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
            sc = lq if raw else (front_sc[:, :, None] + self._edge(child_lq, d)).view(B, k * k)
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
        toks, score = torch.cat(toks, 1), torch.cat(scs, 1)
        logq = score if raw else torch.cat(lqs, 1)
        parents1 = torch.cat(fronts, 1)[:, c["parent_col"][:n_cand]]  # each candidate's parent id + 1 (0: the root)
        order = torch.sort(score, dim=1, descending=True, stable=True)
        if self.budget is not None:
            self._offer(c["depth"][:, :n_cand], score, D, k)
        pad = None if self.node_share >= 1 else self.row_pad(order.values[:, : T - 1])
        return self._rerank(c, drafter.root_tokens, toks, logq, parents1, order.indices[:, : T - 1], D, pad)

    def _draft_chain(self, drafter, D: int) -> Tree:
        """An auto arm of top_k 1 (a chain): the static chain's lean draft (~10% faster at batch 1 than the
        generic path: no sorts, no reranking), its draft log-probs calibrated for the arms' estimates.
        (The chain's log-probs are at temperature 1: under sampling only the estimate differs.)"""
        if self.budget is not None and not self.budget.wants_estimates():  # no scores, no estimates: the plain chain
            return self._chain(D, False).draft(drafter)
        tree = self._chain(D, True).draft(drafter)
        if self.budget is None:
            return tree
        cum = tree.scores[:, 1:]  # [B, D] cumulative draft log-probs along the chain
        depths = self._depth_ids[:D]
        edge = cum - torch.nn.functional.pad(cum[:, :-1], (1, 0))
        score = edge.cumsum(-1) if self.calibration is None else self.calibration.log_accept(edge, depths).cumsum(-1)
        self._offer(depths.expand(cum.shape[0], -1), score, D, 1)
        return tree

    def _chain(self, depth: int, scored: bool) -> ChainPolicy:
        if (depth, scored) not in self._chains:
            self._chains[depth, scored] = ChainPolicy(depth, scores=scored)
        return self._chains[depth, scored]

    @property
    def wants_top_run(self) -> bool:
        return self.budget is not None

    def interrupt(self) -> None:
        if self.budget is not None:
            self.budget.pause()

    def observe(self, info) -> None:
        """Feed the auto budget the accepted drafts per live row, so it corrects its calibrated estimates, and what
        each chain arm would have accepted (the rows' top-1 runs), so the chains are judged on every step."""
        if self.budget is not None:
            n = [k - 1 for k, a in zip(info.n_accept, info.active) if a]
            if n:
                self.budget.observe_accepted(sum(n) / len(n))
            if info.top_run is not None:
                live = [b for b, a in enumerate(info.active) if a]
                self.budget.observe_chains([info.top_run[b] for b in live],
                                           None if info.top_span is None else [info.top_span[b] for b in live])

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

    def _offer(self, depths: torch.Tensor, score: torch.Tensor, D: int, k: int) -> None:
        """E[accepted] of the best T-subtree for every arm drafted this step, copied to the host asynchronously.

        A node is accepted with probability exp(score) (calibrated), E[accepted] is the sum over kept
        nodes, and the best T-subtree holds the T-1 highest scores, so prefix sums of the sorted
        probabilities give every T at once; a depth limit masks deeper nodes out first (all limits in
        one sort). Arms deeper than D get NaN (not measured this step); arms of another top_k than the
        pool's are estimated from this pool (a stand-in, see :meth:`BudgetController.offer`).
        """
        arms = self.budget.arms
        if (D, k) not in self._arm_plan:  # host ints -> index tensors, once per drafted (depth, top_k)
            dev, n = score.device, score.shape[1]
            limits = sorted({d for T, d in arms if 1 < T and d <= D})
            drafted = [1 < T and d <= D for T, d in arms]  # T=1 (nothing drafted) and deeper arms: NaN
            self._arm_rows[D] = [limits.index(d) if ok else 0 for (_, d), ok in zip(arms, drafted)]
            self._arm_plan[D, k] = (torch.tensor(limits, device=dev)[:, None, None],
                                    torch.tensor(self._arm_rows[D], device=dev),
                                    torch.tensor([min(T - 2, n - 1) if ok else 0 for (T, _), ok in zip(arms, drafted)],
                                                 device=dev),
                                    torch.tensor(drafted, device=dev),
                                    [T > 1 and self.arm_top_k[T, d] == k for T, d in arms])
        lims, row, col, ok, exact = self._arm_plan[D, k]
        masked = torch.where(depths[None] <= lims, score[None], -torch.inf)  # [limits, B, candidates]
        probs = masked.sort(-1, descending=True).values.exp()
        if self.node_share >= 1:
            vals = probs.cumsum(-1).mean(1)[row, col]  # [limits, candidates] -> per arm
        else:  # per-row budgets: the kept() best of the rows' top T-1, for each width T, per row
            B = probs.shape[1]
            flat = {T: probs[:, :, : T - 1].flatten(1) for T in {T for T, _ in arms if T > 1}}
            per_T = {T: f.topk(min(self.kept(B, T), f.shape[1]), -1).values.sum(-1) / B for T, f in flat.items()}
            vals = torch.stack([per_T[T][r] if T > 1 else probs.new_zeros(())
                                for (T, _), r in zip(arms, self._arm_rows[D])])
        self._curve.copy_(torch.where(ok, vals, torch.nan), non_blocking=True)
        self.budget.offer(self._curve, arms, exact)

    def _rerank(self, c: dict, root, toks, logq, parents1, keep, depth: int, pad: torch.Tensor | None = None) -> Tree:
        """The kept candidates ``keep`` [B, T-1] (best first) as a [B, T] tree; ``parents1``: each candidate's parent
        id + 1 (0: the root); ``pad`` [B, T-1]: slots to pad."""
        B, dev = toks.shape[0], toks.device
        n = toks.shape[1]
        if pad is not None:  # padding sorts after every real node: each row's real tree comes first
            keep = torch.where(pad, keep + n, keep)
        keep = keep.sort(dim=1).values  # drafting order is topological
        is_pad = None
        if pad is not None:
            is_pad, keep = keep >= n, keep % n
        pick = lambda t: t.gather(1, keep)  # noqa: E731
        # Map a candidate's parent id + 1 to its slot in the kept tree (the root: 0).
        pos = c["pos"][:, : n + 1].scatter(1, keep + 1, c["slots"][:, : keep.shape[1]])
        new_par = pos.gather(1, pick(parents1))  # connected by construction: never -1 (tests check it)
        node_depth, rank = pick(c["depth"][:, :n]), pick(c["rank"][:, :n])
        if is_pad is not None:  # a padding node: a depth-1 leaf under the root (positions stay valid)
            new_par, node_depth, rank = (torch.where(is_pad, v, t) for v, t in ((0, new_par), (1, node_depth),
                                                                             (0, rank)))
        par = torch.cat([c["neg1"], new_par], 1)
        anc = ancestry(par, depth)
        pad_mask = None
        if is_pad is not None:  # it sees only itself (and the prefix): the root row is cut off
            pad_mask = torch.cat([c["zero_b"], is_pad], 1)
            anc = anc & ~(pad_mask[:, :, None] & ~torch.eye(anc.shape[-1], dtype=torch.bool, device=dev))
        return Tree(
            parents=par,
            depth=torch.cat([c["zero"], node_depth], 1),
            rank=torch.cat([c["zero"], rank], 1),
            tokens=torch.cat([root[:, None], pick(toks)], 1),
            scores=torch.cat([c["zero_f"], pick(logq)], 1),
            anc=anc,
            pad=pad_mask,
        )
