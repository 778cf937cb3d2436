"""``tree=auto``: each step, the tree shape with the most expected tokens per second on this machine.

The candidates are plain decoding (T = 1), a top-1 chain of every depth up to ``max_depth``, and EAGLE-2
trees (:class:`DynamicPolicy`'s pool of width ``top_k``) of every depth and a few node budgets T up to
``max_total_tokens``. Each step takes the one that maximises

    (1 + rho * expected accepted drafts) / predicted step seconds.

**Expected accepted drafts** come from the drafted trees' own calibrated scores. A node's score estimates
log P(its path is accepted), so a tree accepts sum(exp(score)) drafts on average, and the best T-node tree
of a pool holds its T-1 best scores: prefix sums of the sorted scores give every T at once, and a depth
limit masks deeper nodes out (a pool's first d levels are the pool of depth d). Two EMAs over steps keep
them: per depth d the chain's continuation c_d = P(depth d accepted | depth d-1), so a D-deep chain accepts
sum_j prod_{i<=j} c_i; and per tree candidate its gain over the chain of the same depth,
R = E[tree] / E[chain]. A chain step updates c up to its depth, a tree step R for every shape its pool
holds. A fresh policy drafts the deepest chain, then the deepest pool, once each: from then on every
candidate has an estimate and no step explores. ``rho`` (an EMA of observed / expected accepted drafts)
takes a calibration fitted on other text to the user's within a few dozen steps.

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
from treedec.tree.policies.base import TreePolicy
from treedec.tree.policies.dynamic import DynamicPolicy, n_drafted, whole
from treedec.tree.tree import Tree, TreeError

SIZES = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # node budgets a tree candidate may verify (few verify shapes)
ALPHA = 0.1  # weight of one step in the acceptance estimates and in rho (a time constant of ~10 steps)
PRIOR = 2.0  # rho starts at 1 with the weight of this many steps


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
        self.c = np.ones(self.max_depth)  # chain continuation per depth (index d-1); measured by the first step
        # each candidate's expected drafts at each depth, over the chain's there (a chain: 1 down to its depth)
        self.R = (np.arange(1, self.max_depth + 1)[None] <= self._depth[:, None]).astype(float)
        self._seen_c, self._seen_R = np.zeros(self.max_depth), np.zeros(len(shapes))  # measurements of each entry
        self.observed, self.promised = np.zeros(self.max_depth), np.zeros(self.max_depth)  # rho's decayed sums
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
    def rho(self) -> np.ndarray:
        """Per depth: rows observed reaching it over the calibrated scores' promise (1 until measured)."""
        return np.where(self.promised > 0, self.observed / np.maximum(self.promised, 1e-12), 1.0)

    def expected(self) -> np.ndarray:
        """Expected accepted drafts of every candidate: its chain's reach per depth, times its gain, times rho."""
        return self.R @ (self.rho * np.cumprod(self.c))

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
            self._pending = (i, _host(p.mean(0)), _host(p))
            return tree
        pool = self.trees.pool(drafter, params, D, k)
        limits = torch.arange(2, D + 1, device=pool.score.device)[:, None, None]
        probs = torch.where(pool.depth[None] <= limits, pool.score[None].exp(), 0.0)  # [depth limits, B, n]
        best = probs.sort(-1, descending=True)
        where = pool.depth.expand_as(probs).gather(-1, best.indices)[..., None]  # the sorted nodes' depths
        by_depth = torch.zeros(*probs.shape, D + 1, device=probs.device).scatter_(-1, where, best.values[..., None])
        mass = by_depth.mean(1).cumsum(1)[..., 1:]  # [limit, T - 1, depth]: the best T-1 nodes' drafts per depth
        self._pending = (i, _host(mass), _host(by_depth[-1, :, : T - 1, 1:].sum(1)))
        return self.trees.select(pool, T)

    def _log_accept(self, edge: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        return edge if self.calibration is None else self.calibration.log_accept(edge, depth)

    def observe(self, info) -> None:
        """Fold this step's drafted scores into the estimates, and how deep its rows accepted into ``rho``."""
        if self._pending is None:
            return
        i, drafted, per_row = self._pending
        self._pending = None
        drafted, per_row = drafted.numpy(), per_row.numpy()  # per_row [B, D]: the verified tree's drafts per depth
        k, D, _ = self.shapes[i]
        if k == 1:  # continuation per depth: P(depth d) / P(depth d - 1), a ratio of batch means
            reach = np.concatenate([[1.0], drafted])
            _average(self.c, self._seen_c, slice(0, D), np.minimum(reach[1:] / np.maximum(reach[:-1], 1e-12), 1.0))
        else:  # every tree shape this pool holds, per depth: its expected drafts over the chain's reach
            held = self._tree[self._depth[self._tree] <= D]
            t = np.array([self.shapes[j][2] for j in held])
            gain = np.zeros((len(held), self.max_depth))
            gain[:, :D] = drafted[self._depth[held] - 2, t - 2] / np.maximum(np.cumprod(self.c)[:D], 1e-12)
            _average(self.R, self._seen_R, held, gain)
        live = [b for b, a in enumerate(info.active) if a]
        if live:  # rows reaching each depth, observed and promised; the first sight of a depth is a prior of rho 1
            reached = (np.array([info.n_accept[b] - 1 for b in live])[:, None] >= np.arange(1, D + 1)).mean(0)
            promised = per_row[live].mean(0)
            new = self.promised[:D] == 0
            self.observed[:D][new] = self.promised[:D][new] = PRIOR * promised[new]
            self.observed[:D] = (1 - ALPHA) * self.observed[:D] + reached
            self.promised[:D] = (1 - ALPHA) * self.promised[:D] + promised

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
