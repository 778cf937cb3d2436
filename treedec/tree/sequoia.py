"""Sequoia-style optimal tree shapes from measured acceptance rates.

The acceptance model (Sequoia's "positional acceptance"): a drafted node's children are tried
in rank order; given that the parent was accepted and ranks ``0..r-1`` were rejected, the
rank-``r`` child is accepted with probability ``p[r]`` (``p[d][r]`` when the rates also depend
on the child's depth ``d``). That is exactly what :class:`~treedec.decoding.stats.DecodeStats`
measures as ``rank_hits[r] / rank_trials[r]``. So a child of rank ``r`` is accepted, given its
parent was, with probability

    q[r] = p[r] * prod_{j<r} (1 - p[j])          (siblings are mutually exclusive)

and the expected number of accepted draft tokens of a tree is the sum over its non-root nodes
of the product of ``q`` along the path to the node (:func:`expected_accepted`); τ is that + 1.

:func:`solve` is the dynamic program: for every node budget ``n`` (tree size T, root included)
and depth limit ``D`` it finds the tree maximising the expected accepted length. A node at
depth ``d`` with ``n`` nodes in its subtree shares ``n - 1`` nodes among children of ranks
``0, 1, ..., b-1`` (contiguous: a rank-``r`` child without the rank-``r-1`` one is not in the
model); the best split is a (max, +) knapsack over ranks::

    G[d][n]   = H[d][0][n - 1],          G[D][1] = 0,  G[D][n > 1] = -inf
    H[d][r][0] = 0
    H[d][r][m] = max_{1 <= k <= m}  q[d+1][r] * (1 + G[d+1][k]) + H[d][r+1][m - k]

:func:`choose` adds the hardware: with a measured verify latency ``t_verify(n)`` and a draft
step latency ``t_draft`` it picks the budget and depth maximising expected tokens per second,
``(E[accepted](n, D) + 1) / (depth · t_draft + t_verify(n) + t_overhead)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from treedec.conf_defaults import shipped_defaults
from treedec.tree.policies.static import StaticPolicy
from treedec.tree.tree import Tree, TreeError

_PROBE = shipped_defaults("calibrate", "probe")  # calibrate's probe (conf/calibrate.yaml), written once there

NEG = -np.inf


def acceptance_matrix(p, depth: int) -> np.ndarray:
    """``p`` as a [depth, K] float array: row ``d - 1`` holds the rates of children at depth ``d``.

    ``p`` may be one vector (the same rates at every depth) or per-depth rows; with fewer rows
    than ``depth`` the last row is repeated (deeper levels reuse the deepest measured rates).
    """
    a = np.asarray(p, dtype=np.float64)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2 or a.shape[1] == 0 or a.shape[0] == 0:
        raise ValueError(f"acceptance rates must be a vector [K] or a matrix [depth, K], got shape {a.shape}")
    if not np.all(np.isfinite(a)) or a.min() < 0 or a.max() > 1:
        raise ValueError(f"acceptance rates must lie in [0, 1], got {a.tolist()}")
    if a.shape[0] < depth:
        a = np.concatenate([a, np.repeat(a[-1:], depth - a.shape[0], axis=0)])
    return a[:depth]


def child_probs(p) -> np.ndarray:
    """``q[..., r] = p[..., r] * prod_{j<r} (1 - p[..., j])``: P(rank-r child accepted | parent accepted)."""
    p = np.asarray(p, dtype=np.float64)
    miss = np.cumprod(1.0 - p, axis=-1)
    before = np.concatenate([np.ones_like(p[..., :1]), miss[..., :-1]], axis=-1)
    return p * before


def expected_accepted(choices: Sequence[Sequence[int]] | Tree, p) -> float:
    """Expected accepted draft tokens of a tree (τ - 1) under acceptance rates ``p`` ([K] or [depth, K]).

    A node whose rank is beyond the measured ranks has acceptance 0.
    """
    tree = choices if isinstance(choices, Tree) else Tree.from_choices(choices)
    if len(tree) == 1:
        return 0.0
    q = child_probs(acceptance_matrix(p, tree.max_depth))
    parents, depth, rank = tree.parents.tolist(), tree.depth.tolist(), tree.rank.tolist()
    reach = [1.0] * len(tree)
    for i in range(1, len(tree)):
        r = rank[i]
        qi = q[depth[i] - 1, r] if r < q.shape[1] else 0.0
        reach[i] = reach[parents[i]] * qi
    return float(sum(reach[1:]))


@dataclass
class SequoiaTable:
    """The DP's answer for every budget ``n = 1..max_budget`` and depth limit ``D = 1..max_depth``.

    ``value[D, n]`` is the best expected accepted length (τ - 1) of a tree of exactly ``n`` nodes
    (root included) and depth at most ``D`` (-inf where no such tree exists).
    """

    p: np.ndarray  # [max_depth, K] acceptance rates used
    max_budget: int
    max_depth: int
    value: np.ndarray  # [max_depth + 1, max_budget + 1]
    _arg: dict = field(repr=False, default_factory=dict)  # D -> argmax splits [D+1, K, max_budget]

    @property
    def width(self) -> int:
        return self.p.shape[1]

    def tau(self, n: int, depth: int | None = None) -> float:
        return float(self.value[depth or self.max_depth, n]) + 1.0

    def choices(self, n: int, depth: int | None = None) -> list[list[int]]:
        """The optimal tree of ``n`` nodes (root included) and depth <= ``depth`` as EAGLE/Medusa paths."""
        D = self.max_depth if depth is None else int(depth)
        if not 1 <= D <= self.max_depth:
            raise ValueError(f"depth must be in 1..{self.max_depth}, got {D}")
        if not 1 <= n <= self.max_budget:
            raise ValueError(f"budget must be in 1..{self.max_budget}, got {n}")
        if not np.isfinite(self.value[D, n]):
            raise ValueError(f"no tree of {n} nodes fits depth {D} and width {self.width}")
        arg = self._arg[D]
        out: list[list[int]] = []

        def build(prefix: list[int], d: int, size: int) -> None:
            m, r = size - 1, 0
            while m > 0:
                k = int(arg[d, r, m])
                path = prefix + [r]
                out.append(path)
                build(path, d + 1, k)
                m -= k
                r += 1

        build([], 0, n)
        return sorted(out, key=lambda c: (len(c), c))

    def depth_of(self, n: int, depth: int | None = None) -> int:
        """The actual depth of the optimal tree (it may be shallower than the limit)."""
        return max((len(c) for c in self.choices(n, depth)), default=0)


def solve(p, max_budget: int, max_depth: int, max_width: int | None = None) -> SequoiaTable:
    """Optimal trees for every budget ``1..max_budget`` (nodes incl. the root) and depth limit ``1..max_depth``.

    ``p``: acceptance rates by sibling rank, one vector [K] or per depth [depth, K] (row d-1 = children
    at depth d). ``max_width`` caps the children per node (default: K, the measured ranks).
    """
    if max_budget < 1 or max_depth < 1:
        raise ValueError(f"max_budget and max_depth must be >= 1, got {max_budget}, {max_depth}")
    P = acceptance_matrix(p, max_depth)
    K = P.shape[1] if max_width is None else min(int(max_width), P.shape[1])
    if K < 1:
        raise ValueError(f"max_width must be >= 1, got {max_width}")
    P = P[:, :K]
    q = child_probs(P)  # [max_depth, K]
    N = max_budget
    value = np.full((max_depth + 1, N + 1), NEG)
    value[:, 1] = 0.0
    args = {}
    # m - k for every (m, k): the Toeplitz index of the (max, +) convolution, valid where k <= m.
    m_idx, k_idx = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")  # m, k in 0..N-1
    valid = (k_idx >= 1) & (k_idx <= m_idx)
    rest = np.where(valid, m_idx - k_idx, 0)
    for D in range(1, max_depth + 1):
        G = np.full((D + 1, N + 1), NEG)  # G[d][n], node at depth d, subtree of n nodes
        G[:, 1] = 0.0
        arg = np.zeros((D + 1, K, N), dtype=np.int32)  # arg[d, r, m] = size of the rank-r child
        for d in range(D - 1, -1, -1):
            qd = q[d]  # children of a depth-d node are at depth d + 1: row d
            H = np.full(N, NEG)  # H_{r+1}[m]; beyond the last rank only m = 0 is possible
            H[0] = 0.0
            for r in range(K - 1, -1, -1):
                g = G[d + 1, :N]
                a = np.where(np.isfinite(g), qd[r] * (1.0 + np.where(np.isfinite(g), g, 0.0)), NEG)
                a[0] = NEG  # a[k]: value of a rank-r child whose subtree has k nodes
                cand = np.where(valid, a[k_idx] + H[rest], NEG)  # [m, k]
                best = (N - 1) - cand[:, ::-1].argmax(axis=1)  # ties: the bigger subtree to the lower rank
                Hn = cand[np.arange(N), best]
                Hn[0] = 0.0
                arg[d, r] = best
                H = Hn
            G[d, 1:] = H[: N]
        value[D] = G[0]
        args[D] = arg
    return SequoiaTable(p=P, max_budget=N, max_depth=max_depth, value=value, _arg=args)


@dataclass
class Choice:
    """The hardware-aware pick: budget ``n`` (T incl. root), depth limit, and its estimates."""

    n: int
    depth: int  # actual depth of the tree
    depth_limit: int
    expected_tau: float
    step_s: float
    tokens_per_s: float
    choices: list[list[int]]


def monotone(times: Mapping[int, float]) -> dict[int, float]:
    """The closest non-decreasing fit (pool adjacent violators) of noisy ``t(n)``: verifying more
    nodes never takes less time, so a dip is measurement noise."""
    xs = sorted(times)
    blocks: list[list[float]] = []  # [sum, count]
    for x in xs:
        blocks.append([times[x], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s_, c = blocks.pop()
            blocks[-1][0] += s_
            blocks[-1][1] += c
    out, i = {}, 0
    for total, count in blocks:
        for _ in range(int(count)):
            out[xs[i]] = total / count
            i += 1
    return out


def interpolate(times: Mapping[int, float], n: int) -> float:
    """Piecewise-linear ``t(n)`` through measured points (flat beyond the ends)."""
    xs = sorted(times)
    if not xs:
        raise ValueError("no timings to interpolate")
    return float(np.interp(n, xs, [times[x] for x in xs]))


def step_cost(table: SequoiaTable, n: int, depth_limit: int, t_verify: Mapping[int, float], t_draft: float,
              t_overhead: float = 0.0) -> float:
    return table.depth_of(n, depth_limit) * t_draft + interpolate(t_verify, n) + t_overhead


def choose(table: SequoiaTable, t_verify: Mapping[int, float] | None = None, t_draft: float = 0.0,
           t_overhead: float = 0.0, budgets: Sequence[int] | None = None,
           depths: Sequence[int] | None = None) -> Choice:
    """The (budget, depth) with the most expected tokens per second.

    ``cost(n, D) = depth(tree) · t_draft + t_verify(n) + t_overhead`` with ``t_verify`` interpolated
    between measured budgets. Without ``t_verify`` the largest budget at the deepest limit wins
    (expected τ never decreases with more nodes). Ties go to the smaller tree.
    """
    budgets = list(budgets) if budgets is not None else list(range(2, table.max_budget + 1))
    depths = list(depths) if depths is not None else list(range(1, table.max_depth + 1))
    if not budgets or not depths:
        raise ValueError("choose() needs at least one budget and one depth")
    best: Choice | None = None
    best_score = -np.inf
    for n in sorted(budgets):
        for D in sorted(depths):
            if not np.isfinite(table.value[D, n]):
                continue
            tau = table.tau(n, D)
            if t_verify:
                cost = step_cost(table, n, D, t_verify, t_draft, t_overhead)
                score = tau / cost
            else:
                cost, score = float("nan"), tau
            if best is None or score > best_score * (1 + 1e-9):
                best_score = score
                best = Choice(n, table.depth_of(n, D), D, tau, cost, score if t_verify else float("nan"),
                              table.choices(n, D))
    if best is None:
        raise TreeError("no feasible tree for the given budgets and depths")
    return best


def comb_choices(top_k: int, depth: int) -> list[list[int]]:
    """A calibration probe: a rank-0 spine of ``depth`` nodes, each spine node with ``top_k`` children,
    and every off-spine child continued by a rank-0 chain to full depth.

    Every depth then sees trials of every rank < ``top_k`` (whenever the spine is accepted that far)
    and rank-0 trials off the spine, with ``depth + (top_k - 1) · depth (depth + 1) / 2`` draft nodes
    instead of the ``top_k ** depth`` of a full tree.
    """
    if top_k < 1 or depth < 1:
        raise TreeError(f"probe needs top_k >= 1 and depth >= 1, got top_k={top_k}, depth={depth}")
    out = []
    for d in range(1, depth + 1):  # branch point at depth d (spine above it)
        for r in range(top_k):
            for tail in range(depth - d + 1):
                if r == 0 and tail > 0:
                    continue  # the spine itself is listed once (r = 0, tail = 0 at each depth)
                out.append([0] * (d - 1) + [r] + [0] * tail)
    return sorted(out, key=lambda c: (len(c), c))


class AcceptanceCounts:
    """Hits and trials by (child depth, sibling rank), the joint form of DecodeStats' depth/rank counters.

    Fed with :class:`~treedec.decoding.verify.Verdict` ``tried_ranks`` entries ``(depth, n_tried, hit)``:
    at a node whose children sit at ``depth``, ranks ``0..n_tried-1`` were tried and ``hit`` (or -1)
    was accepted.
    """

    def __init__(self):
        self.hits: dict[tuple[int, int], int] = {}
        self.trials: dict[tuple[int, int], int] = {}
        self.steps = 0
        self.accepted = 0  # accepted draft tokens over all steps

    def add(self, tried_ranks: Sequence[tuple[int, int, int]]) -> None:
        self.steps += 1
        for depth, n_tried, hit in tried_ranks:
            for r in range(n_tried):
                self.trials[depth, r] = self.trials.get((depth, r), 0) + 1
            if hit >= 0:
                self.hits[depth, hit] = self.hits.get((depth, hit), 0) + 1
                self.accepted += 1

    @property
    def depth(self) -> int:
        return max((d for d, _ in self.trials), default=0)

    @property
    def width(self) -> int:
        return max((r for _, r in self.trials), default=-1) + 1

    def matrix(self, counts: dict) -> np.ndarray:
        out = np.zeros((self.depth, self.width), dtype=np.int64)
        for (d, r), c in counts.items():
            out[d - 1, r] = c
        return out

    def pooled(self) -> np.ndarray:
        """Rates by rank over all depths (DecodeStats' ``accept_by_rank``); 0 where never tried."""
        h, t = self.matrix(self.hits).sum(0), self.matrix(self.trials).sum(0)
        return np.divide(h, t, out=np.zeros(len(t)), where=t > 0)

    def rates(self, per_depth: bool = True, prior_strength: float = 10.0) -> np.ndarray:
        """Acceptance rates [depth, K] (or [1, K] pooled). Per-depth cells are shrunk toward the pooled
        rate of their rank with ``prior_strength`` pseudo-trials, so sparse cells stay sane."""
        if not self.trials:
            raise ValueError("no acceptance trials recorded: the probe never verified a node with children")
        pooled = self.pooled()
        if not per_depth:
            return pooled[None]
        h, t = self.matrix(self.hits), self.matrix(self.trials)
        return (h + prior_strength * pooled[None]) / np.maximum(t + prior_strength, 1e-12)

    def as_dict(self) -> dict:
        h, t = self.matrix(self.hits), self.matrix(self.trials)
        by_depth_h, by_depth_t = h.sum(1), t.sum(1)  # not DecodeStats' depth rates: those count steps
        return {
            "steps": self.steps,
            "tau": (self.accepted + self.steps) / self.steps if self.steps else 0.0,
            "hits": h.tolist(), "trials": t.tolist(),
            "by_rank": self.pooled().tolist(),
            "by_depth_rank": np.divide(h, t, out=np.zeros(h.shape), where=t > 0).tolist(),
            "hits_by_depth": by_depth_h.tolist(), "trials_by_depth": by_depth_t.tolist(),
        }


def comb_probe(top_k: int = _PROBE["top_k"], depth: int = _PROBE["depth"]):
    """The calibration probe policy: a static tree of :func:`comb_choices` (``conf/calibrate.yaml: probe``)."""
    return StaticPolicy(choices=comb_choices(top_k, depth), scores=True)  # calibration reads Tree.scores
