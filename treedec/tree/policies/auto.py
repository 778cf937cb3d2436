"""``tree=auto``: each step, the tree shape with the most expected tokens per second on this machine.

The candidates are plain decoding (T = 1), a top-1 chain of every depth up to ``max_depth``, and EAGLE-2
trees (:class:`DynamicPolicy`'s pool of width ``top_k``) of every depth and a few node budgets T up to
``max_total_tokens``; with a one-pass head, best-first trees (:class:`BestFirstPolicy`) instead, and no candidate
deeper than the head drafts. Each step takes the one that maximises

    (1 + expected accepted drafts) / predicted step seconds.

**Expected accepted drafts.** A chain of depth D accepts sum_{j<=D} prod_{i<=j} c_i, where c_d is the chance a
row accepts depth d given it accepted depth d-1. c_d is counted on chain steps (rows reaching d over rows
reaching d-1, over the last ~30 steps), with a prior of :data:`PRIOR` rows at the same count over all depths
(which fades only as chain steps come, with a prior at the continuation the chains' calibrated scores promise),
so a depth no step reaches any more, or a stretch of plain steps, falls back on what all depths showed, so a calibration fitted on other text (or on an older head) gives way to the user's text
within a few dozen steps. A tree holds its chain and siblings beside it. A node's calibrated score estimates
log P(its path is accepted), and at most one node per depth is on the accepted path, so a tree reaches depth d
with the sum of exp(score) over its nodes there; the best T-node tree of a pool holds its T-1 best scores
(prefix sums of the sorted scores, split by depth, give every T at once; a pool's first d levels are the pool
of depth d). What that sum adds to the chain's calibrated reach, S_d (an EMA over pool steps, per candidate),
is added to the chain's counted reach: the tree reaches d with min(1, reach_d + gamma * S_d), where gamma
(the siblings' accepted drafts over their promise, on tree steps; prior 1) corrects the calibration for
siblings. A fresh policy drafts the deepest chain, then the deepest pool: from then on every candidate has an
estimate, and no step explores.

**Step seconds** come from :class:`~treedec.tree.cost.StepCost`: measured once per machine, refined by
the measured time of every step; the decoder hands it over (:meth:`use_cost`).

The choice is made before drafting, from earlier steps' estimates, so a step reads nothing back from the
device beyond the decoder's one read: this step's scores are copied to the host without waiting and read
in :meth:`observe`, after that read.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from treedec.sampling import SamplingParams
from treedec.tree.policies.base import TreePolicy, whole
from treedec.tree.policies.best_first import BestFirstPolicy
from treedec.tree.policies.dynamic import DynamicPolicy, n_drafted
from treedec.tree.tree import Tree, TreeError

SIZES = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # node budgets a tree candidate may verify (few verify shapes)
ALPHA = 0.1  # weight of one step in the EMAs of the promise, the siblings' share and gamma (~10 steps)
PRIOR = 2.0  # rows of evidence the calibrated scores' promise weighs as, against the rows observed
COUNT_DECAY = 0.03  # the chain counts' per-step decay (they weigh the last ~30 steps: text changes as it goes)
MIN_ROWS = 4  # rows the deepest chain is counted on before the rule takes over (one step from 4 rows)


class AutoPolicy(TreePolicy):
    wants_cost = True
    reads = "either"

    def __init__(self, max_depth: int = 10, top_k: int = 4, max_total_tokens: int = 64, calibration="auto",
                 draft_path: str | None = None, cost_cache: str | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """``calibration``/``draft_path``: as :class:`DynamicPolicy`'s. ``cost_cache``: the folder of the step-cost
        profile (None: :func:`treedec.tree.cost.cache_dir`). ``top_k`` 1: chains and plain decoding only."""
        self._args = (whole(max_depth, "max_depth"), whole(top_k, "top_k"),
                      whole(max_total_tokens, "max_total_tokens", 2))
        self.cost_cache, self.clock = cost_cache, clock
        self.trees = DynamicPolicy(total_tokens=2, depth=self._args[0], top_k=self._args[1], calibration=calibration,
                                   draft_path=draft_path)
        self.calibration = self.trees.calibration
        self._setup(one_pass=False)

    def _setup(self, one_pass: bool, block_size: int = 0, vocab: int = 0) -> None:
        """The candidates and fresh estimates: EAGLE-2 pools of width ``top_k`` for an autoregressive head; for a
        one-pass head, chains and best-first trees (:class:`BestFirstPolicy`) up to its ``block_size``, of at most
        ``vocab`` + 1 nodes (a depth's ``vocab`` tokens all drafted)."""
        D, k, most = self._args
        if one_pass:  # best-first trees take any width; top_k 1 still means chains and plain steps only
            D, k = min(D, block_size), (min(most - 1, vocab) if k > 1 else 1)
        self.one_pass, self._mode = one_pass, (one_pass, block_size, vocab)
        shapes = [(1, 0, 1)] + [(1, d, d + 1) for d in range(1, D + 1) if d + 1 <= most]
        shapes += [(k, d, t) for d in range(2, D + 1) for t in SIZES
                   if k > 1 and d + 1 <= t <= min(most, k + 1 if one_pass else n_drafted(k, d) + 1)]
        T = max(t for _, _, t in shapes + [(1, 1, 2)])
        if one_pass and k > 1:  # one pool of the largest tree's T - 1 best serves every tree (observe() reads it)
            k = T - 1
            shapes = [(k if w > 1 else 1, d, t) for w, d, t in shapes]
        self.shapes, self.top_k = shapes, k
        if one_pass:  # raw marginals: a calibration describes an autoregressive head's node scores
            self.trees = DynamicPolicy(total_tokens=2, depth=max(D, 1), top_k=1, calibration=None)
            self.pools = BestFirstPolicy(total_tokens=T, depth=max(D, 1))
        else:
            self.trees = DynamicPolicy(total_tokens=T, depth=D, top_k=k, calibration=self.calibration)
            self.pools = self.trees
        self.max_depth, self.max_rank = max(d for _, d, _ in shapes), k - 1
        if self.max_depth < 1:
            raise TreeError(f"tree=auto needs max_total_tokens >= 2, got {most}")
        self.max_size = max(t for _, _, t in shapes)
        self.max_inputs = max(self.pools.max_inputs, self.max_depth)
        a = np.array(shapes)
        self._width, self._depth = a[:, 0], a[:, 1]
        self._tree = np.flatnonzero(self._width > 1)  # the tree candidates' indices
        self.promise = np.full(self.max_depth, 0.5)  # calibrated continuation per depth (index d-1)
        self.hits, self.trials = np.zeros(self.max_depth), np.zeros(self.max_depth)  # chain-step counts, per depth
        self.pooled_hits = self.pooled_trials = 0.0  # the same over all depths, fading only as chain steps come
        self.S = np.zeros((len(shapes), self.max_depth))  # each tree's calibrated reach beyond its chain's, per depth
        self._seen_promise, self._seen_S = np.zeros(self.max_depth), np.zeros(len(shapes))
        self.gamma_obs = self.gamma_exp = 1.0  # trees: decayed sums of the siblings' accepted and promised drafts
        deepest = max(range(len(shapes)), key=lambda i: (shapes[i][0] == 1, shapes[i][1]))
        widest = [min(self._tree, key=lambda i: (-shapes[i][1], shapes[i][2]))] if len(self._tree) else []
        self._plan = [deepest, *widest]  # the first steps: the deepest chain (until MIN_ROWS rows), the deepest pool
        for _, d, _ in shapes[1:]:  # every chain planned now (a plan reads the host): no step pays for one
            self.trees.chain(d, scored=True)
        self.cost = None
        self.history: list[tuple[int, int]] = []  # (T, depth) of every step, for reports
        self._pending = None  # this step's shape, rows and host copies of its estimates, read in observe()
        self._clock_at = None  # (rows, shape index, start) of the step now running

    def check_head(self, head) -> None:
        """Any head: a one-pass head's candidates are its chains and best-first trees, no deeper than it drafts."""
        one = bool(getattr(head, "one_pass", False))
        mode = (one, head.block_size, head.config.draft_vocab_size or head.config.vocab_size) if one else (False, 0, 0)
        if mode != self._mode:
            self._setup(*mode)

    # ----------------------------------------------------------------------------------------- cost
    def use_cost(self, make) -> None:
        """The decoder's step-cost model: ``make(policy)`` -> a :class:`~treedec.tree.cost.StepCost` of ``shapes``."""
        self.cost = make(self)

    def draft_shape(self, drafter, k: int, depth: int) -> None:
        """Draft one shape as a step would (the profile times this)."""
        if k == 1:
            self.trees.chain(depth, scored=True).draft(drafter)
        else:
            self.pools.select(self.pools.pool(drafter, None, depth, k), depth + 1)

    # ------------------------------------------------------------------------------------- the rule
    @property
    def continuation(self) -> np.ndarray:
        """c_d per depth: chain steps' counts, with a prior of :data:`PRIOR` rows at the continuation counted over
        every depth (itself with a prior of PRIOR rows at the calibrated promise): depths seen rarely lean on all."""
        pooled = (PRIOR * self.promise + self.pooled_hits) / (PRIOR + self.pooled_trials)
        return (PRIOR * pooled + self.hits) / (PRIOR + self.trials)

    @property
    def gamma(self) -> float:
        return self.gamma_obs / self.gamma_exp

    def reach(self) -> np.ndarray:
        """[candidate, depth]: the chance a row's accepted path reaches each depth."""
        chain = np.cumprod(self.continuation)[None] * (np.arange(1, self.max_depth + 1)[None] <= self._depth[:, None])
        return np.minimum(1.0, chain + self.gamma * self.S)

    def expected(self) -> np.ndarray:
        """Expected accepted drafts of every candidate."""
        return self.reach().sum(1)

    def choose(self, rows: int) -> int:
        """The candidate index with the most expected tokens per predicted second at ``rows`` rows."""
        seconds = self.cost.seconds(rows)
        if self._plan and self.shapes[self._plan[0]][0] == 1 and self.trials[0] >= MIN_ROWS - 0.5:
            self._plan.pop(0)  # the deepest chain has its rows
        if self._plan:
            return self._plan[0] if self.shapes[self._plan[0]][0] == 1 else self._plan.pop(0)  # (the pool: once)
        return int(np.argmax((1 + self.expected()) / seconds))

    # ------------------------------------------------------------------------------------- the step
    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Tree:
        if self.cost is None:
            raise TreeError("tree=auto needs a step-cost model: decode through SpeculativeDecoder (it hands one over)")
        B, now = drafter.batch, self.clock()
        if self._clock_at is not None:  # the step before this one ran from its draft until now
            self.cost.observe(self._clock_at[0], self._clock_at[1], now - self._clock_at[2])
        self.cost.profiled(B)  # the first sight of a row count measures its costs: in no step's time
        self.hits *= 1 - COUNT_DECAY  # every step, plain ones too: what depths the steps no longer reach fades
        self.trials *= 1 - COUNT_DECAY  # back to the count over all depths
        i = self.choose(B)
        self._clock_at = (B, i, self.clock())
        k, D, T = self.shapes[i]
        self.history.append((T, D))
        if D == 0:
            self._pending = None
            return Tree.root_only(drafter.root_tokens)
        if k == 1:
            tree = self.trees.chain(D, scored=True).draft(drafter)
            cum = tree.scores[:, 1:]  # [B, D] cumulative draft log-probs
            edge = cum - torch.nn.functional.pad(cum[:, :-1], (1, 0))
            p = self.trees.edge_score(edge, torch.arange(1, D + 1, device=edge.device)).cumsum(-1).exp()
            self._pending = (i, _host(p.mean(0)))  # [D] the calibrated reach of each depth
            return tree
        pool = self.pools.pool(drafter, params, D, k)
        limits = torch.arange(2, D + 1, device=pool.score.device)[:, None, None]
        probs = torch.where(pool.depth[None] <= limits, pool.score[None].exp(), 0.0)  # [depth limits, B, n]
        best = probs.sort(-1, descending=True)
        where = pool.depth.expand_as(probs).gather(-1, best.indices)[..., None]  # the sorted nodes' depths
        by_depth = torch.zeros(*probs.shape, D + 1, device=probs.device).scatter_(-1, where, best.values[..., None])
        self._pending = (i, _host(by_depth.mean(1).cumsum(1)[..., 1:]))  # [limit, T - 1, depth]: the best T - 1
        return self.pools.select(pool, T)

    def observe(self, info) -> None:
        """Fold this step's calibrated scores and what its rows accepted into the estimates."""
        if self._pending is None:
            return
        (i, drafted), self._pending = self._pending, None
        drafted, (k, D, _) = drafted.numpy(), self.shapes[i]
        live = [info.n_accept[b] - 1 for b, a in enumerate(info.active) if a]  # accepted drafts per live row
        promised = np.cumprod(self.promise)
        if k == 1:  # the continuation the scores promise, and the rows' own: reaching d over reaching d - 1
            reach = np.concatenate([[1.0], drafted])
            _average(self.promise, self._seen_promise, slice(0, D),
                     np.minimum(reach[1:] / np.maximum(reach[:-1], 1e-12), 1.0))
            acc = np.array(live)[:, None]
            depths = np.arange(1, D + 1)
            hits, trials = (acc >= depths).sum(0), (acc >= depths - 1).sum(0)
            self.hits[:D] += hits
            self.trials[:D] += trials
            self.pooled_hits = (1 - COUNT_DECAY) * self.pooled_hits + hits.sum()
            self.pooled_trials = (1 - COUNT_DECAY) * self.pooled_trials + trials.sum()
            return
        held = self._tree[self._depth[self._tree] <= D]  # every tree this pool holds: its reach beyond its chain's
        t = np.array([self.shapes[j][2] for j in held])
        beyond = np.zeros((len(held), self.max_depth))
        beyond[:, :D] = np.maximum(drafted[self._depth[held] - 2, t - 2] - promised[:D], 0.0)
        _average(self.S, self._seen_S, held, beyond)
        if live:  # the siblings' share: what the rows accepted beyond the chain's estimate, over what they promised
            chain = np.cumprod(self.continuation)[:D].sum()
            self.gamma_obs = (1 - ALPHA) * self.gamma_obs + max(float(np.mean(live)) - chain, 0.0)
            self.gamma_exp = (1 - ALPHA) * self.gamma_exp + float(self.S[i].sum())

    def begin(self, prompts, first) -> None:
        self._clock_at = self._pending = None  # a new generation: the time since the last step is no step

    def interrupt(self) -> None:
        self._clock_at = None


def _average(values: np.ndarray, seen: np.ndarray, at, new: np.ndarray) -> None:
    """EMA of ``new`` into ``values[at]``; an entry's first measurements replace its prior (a running mean)."""
    seen[at] += 1
    w = np.maximum(ALPHA, 1 / seen[at])
    values[at] += (w[:, None] if values.ndim > 1 else w) * (new - values[at])


def _host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's host copy, started without waiting (read after the step's one host read)."""
    return t.detach().to("cpu", non_blocking=True)
