"""``tree=auto``: each step, the tree shape with the most expected tokens per second on this machine.

The candidates are plain decoding (T = 1), a top-1 chain of every depth up to ``max_depth``, and EAGLE-2
trees (:class:`DynamicPolicy`'s pool of width ``top_k``) of every depth and a few node budgets T up to
``max_total_tokens``. Each step takes the one that maximises

    (1 + expected accepted drafts) / predicted step seconds.

**Expected accepted drafts.** A chain of depth D accepts sum_{j<=D} prod_{i<=j} c_i, where c_d is the chance a
row accepts depth d given it accepted depth d-1. c_d is counted on chain steps (rows reaching d over rows
reaching d-1, over the last ~30 steps), with a prior of :data:`PRIOR` rows at the continuation the drafted chains' calibrated
scores promise, so a calibration fitted on other text (or on an older head) gives way to the user's text
within a few dozen steps. A tree's estimate is its chain's times its gain G: a node's calibrated score
estimates log P(its path is accepted), so a tree accepts sum(exp(score)) drafts, and the best T-node tree of
a pool holds its T-1 best scores (prefix sums of the sorted scores give every T at once; a pool's first d
levels are the pool of depth d). G is that over the same sum for the chain of the tree's depth, kept per
candidate as an EMA over pool steps, times one correction gamma (rows' accepted drafts over the estimate, on
tree steps, decayed, prior 1). A fresh policy drafts the deepest chain, then the deepest pool: from then on
every candidate has an estimate, and no step explores.

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
from treedec.tree.policies.dynamic import DynamicPolicy, n_drafted
from treedec.tree.tree import Tree, TreeError

SIZES = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # node budgets a tree candidate may verify (few verify shapes)
ALPHA = 0.1  # weight of one step in the decayed estimates (a time constant of ~10 steps)
PRIOR = 2.0  # rows of evidence the calibrated scores' promise weighs as, against the rows observed
COUNT_DECAY = 0.03  # the chain counts' per-step decay (they weigh the last ~30 steps: text changes as it goes)


class AutoPolicy(TreePolicy):
    wants_cost = True

    def __init__(self, max_depth: int = 10, top_k: int = 4, max_total_tokens: int = 64, calibration="auto",
                 draft_path: str | None = None, cost_cache: str | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """``calibration``/``draft_path``: as :class:`DynamicPolicy`'s. ``cost_cache``: the folder of the step-cost
        profile (None: :func:`treedec.tree.cost.cache_dir`). ``top_k`` 1: chains and plain decoding only."""
        D, k = whole(max_depth, "max_depth"), whole(top_k, "top_k")
        most = whole(max_total_tokens, "max_total_tokens", 2)
        shapes = [(1, 0, 1)] + [(1, d, d + 1) for d in range(1, D + 1) if d + 1 <= most]
        shapes += [(k, d, t) for d in range(2, D + 1) for t in SIZES
                   if k > 1 and d + 1 <= t <= min(most, n_drafted(k, d) + 1)]
        self.shapes, self.top_k, self.cost_cache, self.clock = shapes, k, cost_cache, clock
        self.trees = DynamicPolicy(total_tokens=max(t for _, _, t in shapes + [(1, 1, 2)]), depth=D, top_k=k,
                                   calibration=calibration, draft_path=draft_path)
        self.calibration = self.trees.calibration
        self.max_depth, self.max_rank = max(d for _, d, _ in shapes), k - 1
        if self.max_depth < 1:
            raise TreeError(f"tree=auto needs max_total_tokens >= 2, got {max_total_tokens}")
        self.max_size = max(t for _, _, t in shapes)
        self.max_inputs = max(self.trees.max_inputs, self.max_depth)
        a = np.array(shapes)
        self._width, self._depth = a[:, 0], a[:, 1]
        self._tree = np.flatnonzero(self._width > 1)  # the tree candidates' indices (their R entries)
        self.promise = np.full(self.max_depth, 0.5)  # calibrated continuation per depth (index d-1)
        self.hits, self.trials = np.zeros(self.max_depth), np.zeros(self.max_depth)  # decayed chain-step counts
        self.G = np.ones(len(shapes))  # each candidate's calibrated gain over the chain of its depth (chains: 1)
        self._seen_promise, self._seen_G = np.zeros(self.max_depth), np.zeros(len(shapes))
        self.gamma_obs = self.gamma_exp = PRIOR  # trees: decayed sums of accepted and estimated drafts (gamma 1)
        deepest = max(range(len(shapes)), key=lambda i: (shapes[i][0] == 1, shapes[i][1]))
        widest = [min(self._tree, key=lambda i: (-shapes[i][1], shapes[i][2]))] if len(self._tree) else []
        self._plan = [deepest, *widest]  # the first steps: the deepest chain, then the deepest pool
        for _, d, _ in shapes[1:]:  # every chain planned now (a plan reads the host): no step pays for one
            self.trees.chain(d, scored=True)
        self.cost = None
        self.history: list[tuple[int, int]] = []  # (T, depth) of every step, for reports
        self._pending = None  # this step's shape, rows and host copies of its estimates, read in observe()
        self._clock_at = None  # (rows, shape index, start) of the step now running

    # ----------------------------------------------------------------------------------------- cost
    def use_cost(self, make) -> None:
        """The decoder's step-cost model: ``make(policy)`` -> a :class:`~treedec.tree.cost.StepCost` of ``shapes``."""
        self.cost = make(self)

    def draft_shape(self, drafter, k: int, depth: int) -> None:
        """Draft one shape as a step would (the profile times this)."""
        if k == 1:
            self.trees.chain(depth, scored=True).draft(drafter)
        else:
            self.trees.select(self.trees.pool(drafter, None, depth, k), depth + 1)

    # ------------------------------------------------------------------------------------- the rule
    @property
    def continuation(self) -> np.ndarray:
        """c_d per depth: chain steps' counts with a prior of :data:`PRIOR` rows at the calibrated promise."""
        return (PRIOR * self.promise + self.hits) / (PRIOR + self.trials)

    @property
    def gamma(self) -> float:
        return self.gamma_obs / self.gamma_exp

    def expected(self) -> np.ndarray:
        """Expected accepted drafts of every candidate."""
        chain = np.concatenate([[0.0], np.cumsum(np.cumprod(self.continuation))])[self._depth]
        return chain * np.where(self._width > 1, self.G * self.gamma, 1.0)

    def choose(self, rows: int) -> int:
        """The candidate index with the most expected tokens per predicted second at ``rows`` rows."""
        seconds = self.cost.seconds(rows)
        if self._plan:
            return self._plan.pop(0)
        return int(np.argmax((1 + self.expected()) / seconds))

    # ------------------------------------------------------------------------------------- the step
    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Tree:
        if self.cost is None:
            raise TreeError("tree=auto needs a step-cost model: decode through SpeculativeDecoder (it hands one over)")
        B, now = drafter.batch, self.clock()
        if self._clock_at is not None:  # the step before this one ran from its draft until now
            self.cost.observe(self._clock_at[0], self._clock_at[1], now - self._clock_at[2])
        self.cost.profiled(B)  # the first sight of a row count measures its costs: in no step's time
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
            p = self._log_accept(edge, torch.arange(1, D + 1, device=edge.device)).cumsum(-1).exp()
            self._pending = (i, _host(p.mean(0)))  # [D] the calibrated reach of each depth
            return tree
        pool = self.trees.pool(drafter, params, D, k)
        limits = torch.arange(2, D + 1, device=pool.score.device)[:, None, None]
        probs = torch.where(pool.depth[None] <= limits, pool.score[None].exp(), 0.0)  # [depth limits, B, n]
        curve = probs.sort(-1, descending=True).values.cumsum(-1).mean(1)  # [limit, T - 1]: best T-1 nodes' drafts
        self._pending = (i, _host(curve))
        return self.trees.select(pool, T)

    def _log_accept(self, edge: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        return edge if self.calibration is None else self.calibration.log_accept(edge, depth)

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
            for counts, new in ((self.hits, (acc >= depths).sum(0)), (self.trials, (acc >= depths - 1).sum(0))):
                counts[:D] = (1 - COUNT_DECAY) * counts[:D] + new
            return
        held = self._tree[self._depth[self._tree] <= D]  # every tree this pool holds: its gain over its chain
        t = np.array([self.shapes[j][2] for j in held])
        chain = np.cumsum(promised)[self._depth[held] - 1]
        _average(self.G, self._seen_G, held, drafted[self._depth[held] - 2, t - 2] / np.maximum(chain, 1e-12))
        if live:
            self.gamma_obs = (1 - ALPHA) * self.gamma_obs + float(np.mean(live))
            self.gamma_exp = (1 - ALPHA) * self.gamma_exp + float(self.expected()[i] / self.gamma)

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
