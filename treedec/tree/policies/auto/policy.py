"""``tree=auto``: each step, the plain step, chain or tree with the most expected tokens per second here.

Candidates: the plain step, the top-1 chain of every depth, and trees of every depth at T = powers of two up to
``max_total_tokens`` (EAGLE-2 pools of width ``top_k``; with a one-pass head, best-first trees). A step plays the
argmax of (1 + E[accepted drafts]) / predicted seconds. E is a sum over the tree's nodes of P(path accepted), in two
channels: the top-1 path's, counted from how far rows followed it, and the other nodes', their (calibrated) scores
times what rows accepted off the path over what those scores promised (decayed over ~1/DECAY steps). What each
shape promises is averaged over the steps that drafted it (a pool holds every smaller or shallower tree); each kind
(chains, trees) is probed on a gap that doubles up to MAX_GAP steps. Seconds: :class:`~.cost.StepCost`. Choices use
earlier steps' estimates, and this step's scores are copied to the host without waiting, so a step adds no device
read. docs/design.md §9.
"""
from __future__ import annotations

import numpy as np
import torch

from treedec.conf_defaults import shipped_defaults
from treedec.sampling import SamplingParams
from treedec.tree import calibration as calib
from treedec.tree.policies.auto.cost import DECAY, StepCost
from treedec.tree.policies.auto.profile import measure, profile_key
from treedec.tree.policies.base import TreePolicy, whole
from treedec.tree.policies.best_first import BestFirstPolicy
from treedec.tree.policies.chain import ChainPolicy
from treedec.tree.policies.dynamic import DynamicPolicy, n_drafted
from treedec.tree.tree import Tree, TreeError

_D = shipped_defaults("tree/auto")  # the defaults of tree=auto, written once there

MAX_GAP = 128  # most steps a losing group of shapes (chains, trees) waits before it is played again


class AutoPolicy(TreePolicy):
    reads = "either"

    def __init__(self, max_depth: int = _D["max_depth"], top_k: int = _D["top_k"],
                 max_total_tokens: int = _D["max_total_tokens"], draft_path: str | None = _D["draft_path"],
                 calibration="auto", cost_cache: str | None = None):
        """``top_k`` 1: chains and plain steps only. ``calibration``: as :class:`DynamicPolicy`'s (``auto``: the
        head's ``calibration.yaml`` beside ``draft_path``). ``cost_cache``: the profile's folder (None: $TREEDEC_CACHE,
        else ~/.cache/treedec)."""
        self._args = (whole(max_depth, "max_depth"), whole(top_k, "top_k"),
                      whole(max_total_tokens, "max_total_tokens", 2))
        self.calibration = calib.resolve(calibration, draft_path)
        self.cost_cache, self.history = cost_cache, []
        self._setup(False)

    def _setup(self, one_pass: bool, block_size: int = 0, vocab: int = 0) -> None:
        """The candidates of a head kind, and fresh estimates."""
        D, k, most = self._args
        if one_pass:  # one pool of the largest tree's T - 1 best per depth holds every best-first tree
            D, k = min(D, block_size), (min(most - 1, vocab) if k > 1 else 1)
        sizes = sorted({2 ** j for j in range(2, most.bit_length())} | {most})
        shapes = [(1, 0, 1)] + [(1, d, d + 1) for d in range(1, D + 1) if d + 1 <= most]
        shapes += [(k, d, t) for d in range(2, D + 1) for t in sizes
                   if k > 1 and d + 1 < t <= min(most, k + 1 if one_pass else n_drafted(k, d) + 1)]
        if one_pass and k > 1:  # the pool's width: the largest tree's T - 1 best of each depth
            shapes = [(w if w == 1 else max(t for w2, _, t in shapes if w2 > 1) - 1, d, t) for w, d, t in shapes]
        self.shapes, self.one_pass, self._mode = shapes, one_pass, (one_pass, block_size, vocab)
        a = np.array(shapes)
        self._k, self._d, self._t = a[:, 0], a[:, 1], a[:, 2]
        self.max_depth, self.max_size = int(self._d.max()), int(self._t.max())
        if self.max_depth < 1:
            raise TreeError(f"tree=auto needs max_total_tokens >= 2, got {most}")
        self.groups = [g for g in (np.flatnonzero(self._k == 1)[1:], np.flatnonzero(self._k > 1)) if len(g)]
        wide = max(self._k)
        if one_pass:
            self.pools = BestFirstPolicy(total_tokens=max(self.max_size, 2), depth=self.max_depth,
                                         calibration=self.calibration)
        else:
            self.pools = DynamicPolicy(total_tokens=self.max_size, depth=self.max_depth, top_k=wide,
                                       calibration=self.calibration)
        self.top_k, self.max_rank = wide, wide - 1
        self.max_inputs = max(self.pools.max_inputs, self.max_depth)
        self._chains = {d: ChainPolicy(d) for d in range(1, self.max_depth + 1)}  # unscored: the path is counted
        # per shape and depth: its nodes' scores off the top-1 path, and whether it holds the path's node there
        # (means over rows; `_known`: drafted at least once); per depth, decayed over the steps that drafted it:
        # rows that reached it along the top-1 path and rows that reached its parent so (the path's counts),
        # rows that reached it off the path, the other nodes' promise to them, and the rows they promised anything
        self.reach, self._known = np.zeros((len(shapes), 2, self.max_depth)), self._d == 0
        self.reach[:, 1] = (self._k == 1)[:, None] & (np.arange(self.max_depth) < self._d[:, None])  # a chain holds it
        self._seen = np.zeros(len(shapes))
        self._path_hits, self._path_trials, self._hits, self._promise, self._rows = np.zeros((5, self.max_depth))
        # probe gaps: a fresh policy plays the deepest chain at once, and first drafts a tree 1/DECAY steps in (a short
        # request never pays for the largest tree; a long one finds trees within a few dozen steps)
        self._since, self._gap = [0] * len(self.groups), [1, round(1 / DECAY)][:len(self.groups)]
        self._best = -1  # the winning group (-1: the plain step)
        self.cost, self._cost_key, self._step, self._pending = None, None, None, None

    def check_head(self, head) -> None:
        """Any head: a one-pass head's candidates are its chains and best-first trees, no deeper than it drafts."""
        one = bool(getattr(head, "one_pass", False))
        mode = (one, head.block_size, head.config.draft_vocab_size or head.config.vocab_size) if one else (False, 0, 0)
        if mode != self._mode:
            self._setup(*mode)

    # ----------------------------------------------------------------------------------------- cost
    def prepare(self, target, head, rows: int, context: int, new_drafter, compiled: bool = False) -> None:
        """Profile this machine's step costs at ``rows`` rows unless a kept table already has them."""
        key = profile_key(target, head, compiled)
        if self.cost is None or (self._cost_key is not None and self._cost_key != key):
            self.cost, self._cost_key = StepCost(
                self.shapes, key, lambda b, have: measure(target, head, self, b, have, context, new_drafter),
                self.cost_cache), key
        self.cost.prepare(rows)

    def draft_shape(self, drafter, k: int, depth: int) -> None:
        """Draft one shape as a step would (the profile times this)."""
        if k == 1:
            self._chains[depth].draft(drafter)
        else:
            self.pools.select(self.pools.pool(drafter, None, depth, k), int(self._t[self._d == depth].max()))

    # ------------------------------------------------------------------------------------- the rule
    def corrections(self) -> tuple[np.ndarray, np.ndarray]:
        """Per depth: the chance a row reaches it along the top-1 path, and the other nodes' correction.

        The top-1 path is counted: each depth's continuation is rows that reached it over rows that reached its
        parent, with a prior of one row at the shallower depth's (depth 1: at 1), so a depth
        no step reaches follows the deepest one that is (a top-1 draft is accepted, by argmax agreement, 2 to 40
        times more often than its score says, deeper more so: no correction of the score extrapolates that). The
        other nodes' is what the rows accepted off the path over what their scores promised, a ratio per row with a
        prior of one row at the shallower depth's (depth 1: at 1), so a promise of any scale converges alike."""
        path, rho, cont, reach, prior = [], [], 1.0, 1.0, 1.0
        sums = zip(*(x.tolist() for x in (self._path_hits, self._path_trials, self._hits, self._promise, self._rows)))
        for hits, trials, off, promise, rows in sums:  # (floats: ten numpy scalars a step cost more than the rule)
            cont = (hits + cont) / (trials + 1)
            reach *= cont
            prior = (rows * (off / promise if promise > 0 else prior) + prior) / (rows + 1)
            path.append(reach)
            rho.append(prior)
        return np.array(path), np.array(rho)

    def expected(self) -> np.ndarray:
        """E[accepted drafts] of every candidate (nan: never drafted)."""
        path, rho = self.corrections()
        reach = np.minimum(1.0, path * self.reach[:, 1] + rho * self.reach[:, 0])
        e = np.minimum.accumulate(reach, axis=1).sum(1)  # a path reaches depth d only through d - 1
        return np.where(self._known, e, np.nan)

    def choose(self, rows: int) -> int:
        """The shape to play at ``rows`` rows: the best by expected tokens per second, or a due kind's probe (the
        winning kind's too: its deeper shapes' estimates are refreshed only by playing them)."""
        value = (1 + self.expected()) / self.cost.seconds(rows)
        best = int(np.nanargmax(value))
        group = next((g for g, idx in enumerate(self.groups) if best in idx), -1)
        if group != self._best:  # the winning kind changed (plain, chain, tree): look around again soon
            self._gap = [min(g, round(1 / DECAY)) for g in self._gap]
        self._best = group
        for g, idx in enumerate(self.groups):
            self._since[g] += 1
            if self._since[g] >= self._gap[g]:
                self._since[g], self._gap[g] = 0, min(2 * self._gap[g], MAX_GAP)
                probe = self._probe(idx, value)
                if probe != best:
                    return probe
        return best

    def _probe(self, idx: np.ndarray, value: np.ndarray) -> int:
        """The group's best shape, two levels deeper (what it drafts covers every shallower one); never drafted: its
        deepest and largest."""
        known = idx[~np.isnan(value[idx])]
        if not len(known):
            return int(idx[np.lexsort((self._t[idx], self._d[idx]))[-1]])
        top = known[np.argmax(value[known])]
        depth = min(self._d[top] + 2, self._d[idx].max())
        at = idx[self._d[idx] == depth]
        return int(at[np.argmin(np.abs(self._t[at] - self._t[top]))])

    # ------------------------------------------------------------------------------------- the step
    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Tree:
        if self.cost is None:
            raise TreeError("tree=auto needs this machine's step costs: decode through SpeculativeDecoder (it calls "
                            "prepare before decoding)")
        i = self.choose(drafter.batch)
        k, D, T = (int(x) for x in self.shapes[i])
        self.history.append((T, D))
        self._step, self._pending = (drafter.batch, i), None
        if D == 0:
            return Tree.root_only(drafter.root_tokens)
        if k == 1:
            tree = self._chains[D].draft(drafter, params)
            self._pending = None, _host(tree.tokens[:, 1:])
            return tree
        pool = self.pools.pool(drafter, params, D, k)
        top1 = pool.rank == 0  # on the top-1 path: rank 0, and so is every ancestor (one level a pass)
        for _ in range(D - 1):
            top1 = (pool.rank == 0) & torch.cat([torch.ones_like(top1[:, :1]), top1], 1).gather(1, pool.parents1)
        limits = torch.arange(2, D + 1, device=pool.score.device)[:, None, None]
        probs = torch.where(pool.depth[None] <= limits, pool.score[None].exp(), 0.0)  # [depth limit, B, n]
        best = probs.sort(-1, descending=True)
        on = top1.expand_as(probs).gather(-1, best.indices)  # the sorted nodes: on the path?
        slot = (2 * pool.depth.expand_as(probs).gather(-1, best.indices) + on.long())[..., None]  # depth, then channel
        # channel 0: the other nodes' scores; channel 1: the path's node is held (a kept node, score > 0)
        value = torch.where(on, (best.values > 0).float(), best.values)[..., None]
        by_depth = torch.zeros(*probs.shape, 2 * D + 2, device=probs.device).scatter_(-1, slot, value)
        path = torch.full((top1.shape[0], D + 1), -1, device=top1.device)  # the top-1 path's tokens (-1: not drafted)
        path.scatter_(1, torch.where(top1, pool.depth, 0), pool.tokens)
        # [limit, T - 1, channel, depth]: the best T - 1 nodes' scores off the path, and the path held
        self._pending = (_host(by_depth.mean(1).cumsum(1).unflatten(-1, (D + 1, 2)).transpose(-1, -2)[..., 1:]),
                         _host(path[:, 1:]))
        return self.pools.select(pool, T)

    def observe(self, info) -> None:
        """Fold the step's time, its scores' promise and what its rows accepted into the estimates."""
        if self._step is None:
            return
        (rows, i), self._step = self._step, None
        if info.seconds is not None:
            self.cost.observe(rows, i, info.seconds)
        if self._pending is None:
            return
        (drafted, path), self._pending = self._pending, None
        path = np.asarray(path)
        D, n = int(self._d[i]), self.max_depth
        if self._k[i] == 1:  # a chain's nodes are all on the path: its shape's channels are fixed (set up front)
            self._known[self._k == 1] = True
            played = self.reach[i]
        else:  # every tree of this width up to D
            held = np.flatnonzero((self._k == self._k[i]) & (self._d <= D) & (self._d >= 2))
            new = np.pad(np.asarray(drafted)[self._d[held] - 2, self._t[held] - 2], ((0, 0), (0, 0), (0, n - D)))
            self._seen[held] += 1
            w = np.maximum(DECAY, 1 / self._seen[held])[:, None, None]  # a shape's first steps replace, then an EMA
            self.reach[held] += np.where(self._known[held, None, None], w, 1.0) * (new - self.reach[held])
            self._known[held] = True
            played = new[np.flatnonzero(held == i)[0]]
        live = [b for b, on in enumerate(info.active) if on]
        if live:  # rows that reached each depth along the top-1 path, and otherwise
            depths = np.arange(1, n + 1)
            acc = [info.n_accept[b] - 1 for b in live]
            along = np.array([next((j for j, (x, y) in enumerate(zip(info.tokens[b][:a], path[b])) if x != y),
                                   min(a, len(path[b]))) for b, a in zip(live, acc)])[:, None]  # shared prefix
            top, got = along >= depths, np.array(acc)[:, None] >= depths
            held, others = played[1] > 0, played[0] > 0  # the depths this step drafted, on and off the path
            for sums, on in ((self._path_hits, held), (self._path_trials, held), (self._hits, others),
                             (self._promise, others), (self._rows, others)):
                sums[on] *= 1 - DECAY  # (the others keep: a depth's counts are over the steps that drafted it)
            self._path_hits += held * top.sum(0)
            self._path_trials += held * (along >= depths - 1).sum(0)
            self._hits += others * (got & ~top).sum(0)
            self._promise += len(live) * played[0]
            self._rows += len(live) * others


def _host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's host copy, started without waiting (read after the step's one host read)."""
    return t.detach().to("cpu", non_blocking=True)
