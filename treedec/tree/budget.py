"""An online, hardware-aware tree budget: each step's (T, depth) maximises expected tokens per second.

Sequoia's objective, ``(1 + E[accepted | T, depth]) / step_time(rows, T, depth)``, solved online:

* **Acceptance**: the dynamic policy hands over, each step, the expected accepted length of the
  best T-node subtree of its drafted candidates for every (depth limit, T) arm (sorted calibrated
  path acceptances, prefix sums; computed on the device). It reaches the host one step late, with
  no extra synchronisation (:meth:`BudgetController.offer`), and is smoothed by an EMA: per context.
* **Step time**: wall-clock between successive ``draft()`` calls (each step ends with one host read,
  so that interval is a whole step), a per-arm EMA keyed by (rows, T, depth), relative to a shared
  machine pace that the arm played every step keeps current (:attr:`StepTimeModel.pace`: a shared CPU
  drifts by 15 % between minutes, and arms explored at different minutes must be compared at today's);
  arms never measured are predicted by a least-squares fit over :data:`FEATURES` (non-negative slopes)
  of the measured ones, and an arm measured once by at most that fit (a first step pays one-time work).
* **Correction**: the drafts each step really accepted rescale the chosen arm's estimate (per arm,
  shrunk towards its pool family's ratio, and that towards the batch-wide one): calibration fitted
  on other text is off by 2-8x, differently for chains and bushy trees. An arm played often is then
  judged by its own accepted record, the rescaled estimate counting as two steps
  (:meth:`BudgetController.accepted`). Chains, the worst estimated, are also recorded on every step
  from the rows' top-1 runs (:meth:`BudgetController.observe_chains`): what each would have accepted.
  A tree's own record is kept as a ratio to what its depth's chain would have accepted on the same
  steps, times that chain's record now (:attr:`BudgetController.paired`): trees played on easy text
  otherwise carried that text's record into hard text. Records and continuation rates are also kept per
  row bucket, and a batch of B rows is judged by its bucket's (:meth:`BudgetController._local`): rows
  accept more late in their generation, and a static batch's start must not be judged by its tail.
* **Hold**: the arm played keeps its place while within ``hold_margin`` of the leader's rate.
* **Exploration**: the first steps at a new row bucket (the nearest power of two) probe far-apart arms
  (cheapest first; a middle-sized tree only in the first bucket); then every ``explore_every`` steps (times
  ``rows // explore_rows`` at a wide batch, where a detour costs the most: a 16-node tree's step is twice the
  3-deep chain's at 16 rows, and exploring at the batch-1 pace cost 3-15 % there, below vanilla in 3 of 4 runs) a
  neighbour of the best arm (one bucket up/down in T or depth) or the runner-up is tried: never one that
  could not beat the best even accepting every draft, and once an arm has a record of its own, only if it
  is expected to reach ``explore_floor`` of the best arm's rate. So a machine that gets busier or text that
  gets easier moves the choice, without costly detours at large batches.

T is restricted to a few buckets (and a chain per depth) so ``compile=True`` builds few graphs.
The clock is injectable (tests drive it with a synthetic step-time model).
"""
from __future__ import annotations

import functools
import math
import time
from typing import Callable, Sequence

import numpy as np

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 64)  # 1: the root alone (plain decoding); 2, 4: a chain or a twig
FEATURES = ("1", "rows", "T", "rows*T", "depth", "rows*inputs")  # the step-time fit's columns
# The first model (fullest first) whose slopes come out >= 0 wins. While one row count only has been
# measured, its rows terms are not identifiable and the launch-bound model (1, T, depth) comes first:
# a new row count is first predicted as costly as the known one, scaled by its own first measurement
# (StepTimeModel._scale), and the rows terms enter once two row counts are measured. (Assuming
# compute-bound instead shrinks trees at batch 4 on a CPU where they still pay 1.5x.)
_SUBSETS = ([0, 1, 2, 3, 4, 5], [0, 1, 3, 4, 5], [0, 1, 2, 3, 4], [0, 3, 4, 5], [0, 1, 3, 5], [0, 1, 3, 4],
            [0, 2, 4], [0, 3, 5], [0, 3, 4], [0, 1, 3], [0, 2], [0, 3], [0, 4], [0])


@functools.lru_cache(maxsize=256)  # (asked for every arm at each scoring)
def row_bucket(rows: int) -> int:
    """The power of two nearest ``rows`` (in log scale): row counts that share the first steps' probes and
    the acceptance records (see BudgetController._local).

    Rows leave a batch one by one as they finish; probing every count anew would spend a large part of
    a batch's steps on probes, while the step-time fit, shared by all row counts, predicts the others.
    """
    return 1 << max(0, round(math.log2(max(rows, 1))))


def covered_plays(run: int, d: int, stretch: float) -> float:
    """Plays of a d-deep chain that one row's step, whose top-1 run accepted ``run`` drafts, stands for: one if the run
    stopped within d drafts, else 1 + ``stretch`` · ((run + 1) / (d + 1) - 1), the share ``stretch`` of the extra steps
    the d-deep chain would take over that text (see :meth:`BudgetController.observe_chains`)."""
    return 1.0 + stretch * ((run + 1) / (d + 1) - 1.0) if run >= d else 1.0


def _host_values(curve) -> np.ndarray:
    """The offered estimates as a numpy view: a host tensor (the policy's pinned buffer, already synchronised by
    the step's one host read) or any array. Never ``Tensor.item``: no device read is involved, and none is counted."""
    return curve.numpy() if hasattr(curve, "numpy") else np.asarray(curve)


class StepTimeModel:
    """Step seconds as f(rows, T, depth): per-arm EMA, one linear fit over every row count for the rest.

    The fit ``a + b*rows + c*T + e*rows*T + f*depth + g*rows*inputs`` (non-negative slopes) is shared by all row
    counts, so a batch size never seen (or one that a finished row just produced) is predicted
    from the others, and a machine that gets compute-bound in ``rows*T`` is recognised as such.
    ``inputs[(T, depth)]`` is the draft-head inputs per row an arm's draft passes hold (a chain: its depth,
    the default; a top_k pool: k per depth): the draft's share of the cost grows with it once rows make
    the head compute-bound (a 2-wide pool at batch 16 drafts ~1.7x as slowly as a chain of its depth).
    """

    def __init__(self, alpha: float = 0.25, refit_every: int = 8, inputs: dict[tuple[int, int], int] | None = None):
        self.alpha, self.refit_every = alpha, refit_every
        self.inputs = dict(inputs or {})
        self.ema: dict[tuple[int, int, int], float] = {}  # per arm, in units of the machine's pace (see observe)
        # The machine's pace: every prediction is an EMA or fit times this. A shared CPU drifts by 15 % between
        # minutes while an arm explored once a minute keeps the time it had then, so per-arm EMAs alone compared
        # arms measured at different paces (at batch 1 the 5-deep chain ended predicted slower than the 7-deep).
        self.pace = 1.0
        # An established arm's surprise moves the pace by this share (of its log), then its own time by ``alpha`` of
        # what is left: a lasting change ends ~60 % in the pace, ~40 % in the arm (a machine that gets slower per
        # node, not uniformly, must still show the played arm as dearer than the ones explored before).
        self.pace_alpha = 0.25
        self.established = 8  # steps after which an arm's surprise is taken as (partly) the machine's
        self._count: dict[tuple[int, int, int], int] = {}
        self._coef: np.ndarray | None = None
        self._ratio: dict[int, float] = {}  # rows -> median measured / fitted time of its arms (since the fit)
        self._fresh = 0  # observations since the fit (a fit per step would cost ~0.1 ms)
        self._pred: dict[tuple[int, int, int], float] = {}  # fitted predictions since the fit (per step: ~30 arms)

    def observe(self, rows: int, T: int, depth: int, seconds: float) -> None:
        """One step's seconds; a step more than twice the arm's prediction counts as twice it (a preempted step on a
        shared machine would otherwise ban its arm for many steps; a real slowdown still shows in a few), and
        an arm's second step replaces its first when faster (the first pays one-time work: index plans).

        Times are kept relative to :attr:`pace`. An established arm (the one played most, every step) that runs
        slower or faster than predicted moves the pace (most of it), so every arm's prediction follows the machine;
        an arm explored now and then is measured against the pace of the moment: so arms are compared nearly as if
        interleaved, whenever each was last played."""
        key = (rows, T, depth)
        old = self.ema.get(key)
        n = self._count[key] = self._count.get(key, 0) + 1
        t = seconds / self.pace
        if old is None or (n == 2 and t < old):
            self.ema[key] = t
        else:
            t = min(t, 2 * old)
            if n > self.established:
                self.pace *= (t / old) ** self.pace_alpha
                t = min(seconds / self.pace, 2 * old)
            self.ema[key] = old + self.alpha * (t - old)
        self._fresh += 1
        if old is None or self._fresh >= self.refit_every:  # a new arm changes the fit most: refit at once
            self._coef = None

    def features(self, rows: int, T: int, depth: int) -> list[float]:
        return [1.0, rows, T, rows * T, depth, rows * self.inputs.get((T, depth), depth)]

    def coef(self) -> np.ndarray | None:
        """The fit's coefficients in :data:`FEATURES` order (None before any measurement)."""
        if self._coef is None and self.ema:
            # An arm's first step pays one-time work (index plans, oneDNN primitives for new shapes: up to 3x a
            # step), so arms measured once stay out of the fit while at least three arms have two steps.
            settled = {k: t for k, t in self.ema.items() if self._count.get(k, 0) >= 2}
            data = settled if len(settled) >= 3 else self.ema
            X = np.array([self.features(*k) for k in data])
            y = np.array(list(data.values()))
            coef = np.zeros(len(FEATURES))
            coef[0] = y.mean()
            for cols in _SUBSETS:
                if np.linalg.matrix_rank(X[:, cols]) < len(cols):
                    continue
                c = np.linalg.lstsq(X[:, cols], y, rcond=None)[0]
                if (c[1:] >= -1e-9 * y.max()).all():  # an exact zero may come out as -1e-18
                    coef = np.zeros(len(FEATURES))
                    coef[cols] = np.maximum(c, [-np.inf] + [0.0] * (len(cols) - 1))
                    break
            self._coef, self._fresh, self._ratio, self._pred = coef, 0, {}, {}
        return self._coef

    def _scale(self, rows: int, c: np.ndarray) -> float:
        """How much slower this row count ran than the shared fit says (its measured arms' median ratio), so an
        arm never measured at ``rows`` is compared fairly with the measured ones (1.0 when none is)."""
        if rows not in self._ratio:
            r = [t / f for k, t in self.ema.items() if k[0] == rows and (f := float(c @ self.features(*k))) > 0]
            self._ratio[rows] = float(np.median(r)) if r else 1.0
        return self._ratio[rows]

    def predict(self, rows: int, T: int, depth: int) -> float | None:
        """Predicted seconds of a step at the current :attr:`pace` (None before any measurement)."""
        key = (rows, T, depth)
        t = self.ema.get(key)
        if t is not None and self._count.get(key, 0) >= 2:
            return t * self.pace
        c = self.coef()
        if c is None:
            return None if t is None else t * self.pace
        if key not in self._pred:
            self._pred[key] = max(float(c @ np.array(self.features(rows, T, depth))) * self._scale(rows, c), 1e-9)
        # measured once: that step may have paid one-time work, so the fit (of the settled arms) may say less
        return self.pace * (self._pred[key] if t is None else min(t, self._pred[key]))


class BudgetController:
    """Chooses a (T, depth) arm per step among ``arms``; fed by the policy's draft() calls."""

    def __init__(self, arms: Sequence[tuple[int, int]], explore_every: int = 8,
                 clock: Callable[[], float] | None = None, alpha: float = 0.1, probe: bool = True,
                 inputs: dict[tuple[int, int], int] | None = None, family: dict[tuple[int, int], int] | None = None,
                 narrow: Sequence[tuple[int, int]] = ()):
        """``inputs``: draft-head inputs per row of each arm (see :class:`StepTimeModel`; default: its depth).
        ``family``: a key per arm (its pool's top_k); an arm never played borrows its family's correction.
        ``narrow``: arms scored, explored and played only at batches of at most :attr:`narrow_rows` rows (chains deeper
        than the pools: at batch 1 a 9-deep chain beat the 7-deep one by 3-7 % on a CPU; at batch 16, with ~30 steps a
        batch, exploring them cost 10 % and they never paid)."""
        if not arms:
            raise ValueError("the auto budget needs at least one (tree size, depth) arm")
        self.arms = sorted(set((int(T), int(d)) for T, d in arms), key=lambda a: (a[1], a[0]))
        self.explore_every, self.alpha = explore_every, alpha
        self.clock = clock or time.perf_counter
        self.times = StepTimeModel(inputs=inputs)
        self.gain: dict[tuple[int, int], float] = {}  # E[accepted] per (T, depth), see _absorb
        self.narrow, self.narrow_rows = {(int(T), int(d)) for T, d in narrow}, 2
        self.base = min((a for a in self.arms if a[0] > 1), default=None)  # drafted whenever anything is
        # The first steps at a new row bucket probe far-apart arms, cheapest first, so the step-time fit tells the
        # slopes in T and in depth apart at once (neighbour exploration alone walks one bucket per round): the root
        # alone, the smallest tree, the smallest and (first bucket only) a middle-sized tree at the deepest depth
        # (geometric middle: its pool estimates the arms around it). Not the largest: at batch 16 on a CPU one
        # such step costs ~20 vanilla steps, and even the middle one ~5, so later buckets skip it.
        wide = [a for a in self.arms if a not in self.narrow] or self.arms
        deep = [a for a in wide if a[1] == wide[-1][1]]
        mid = min(deep, key=lambda a: (abs(math.log(a[0] / math.sqrt(deep[0][0] * deep[-1][0]))), a[0]))
        self.probes = [a for a in dict.fromkeys([self.arms[0], self.base, deep[0], mid]) if a is not None] if probe else []
        self._played: dict[int, int] = {}  # row bucket (row_bucket) -> steps chosen there
        self._probes: dict[int, list[tuple[int, int]]] = {}  # row bucket -> the probes it takes
        self.explore_floor = 0.8  # once known, explore only arms expected to reach this share of the best arm's tokens/s
        self.explore_rows = 4  # from 2x this many rows, exploring every explore_every * (rows // this) steps
        self.explore_known = 4.0  # an arm is known after this many (decayed) plays of its own
        self.hold_margin = 0.03  # the arm played keeps its place unless the leader is expected this much faster
        self._held: dict[int, tuple[int, int]] = {}  # row bucket -> the arm held there
        # The arms are scored every this many steps only; in between the held arm plays. Scoring ~30 arms is ~0.23 ms
        # of Python a step (cProfile, batch 4), ~2 % of a step; an in-loop A/B could not tell 1 from 4 apart (batch 4:
        # 1.291x against 1.288x, per-pass spread 1.13-1.42x), so this only saves the CPU time.
        self.rescore_every = 4
        self.estimate_every = 4  # a chain arm (the cheapest to draft, where scoring costs most) offers estimates
        #                          every this many steps only (see wants_estimates)
        self.decay = 0.9
        self._base_ema: float | None = None
        self._ratio: dict[tuple[int, int], tuple[float, float]] = {}
        self._stand_in: dict[tuple[int, int], tuple[float, float]] = {}  # ratios measured on another pool
        self.steps = 0
        self.last: tuple[int, int] | None = None  # the arm of the step now running
        self.history: list[tuple[int, int]] = []  # every arm chosen (bench / tests read it)
        self._t0: float | None = None
        self._rows = 1
        self._owner = None
        self._pending = None  # (curve, its arms): last step's expected-acceptance estimates
        self._seen = [0.0, 0.0]  # decayed sums of (accepted, estimated) drafts of the arms chosen
        self._seen_arm: dict[tuple[int, int], tuple[float, float, float]] = {}  # the same per arm, and its plays
        # The same records per row bucket (see _local): row bucket -> arm -> decayed (accepted, plays)
        self._seen_at: dict[int, dict[tuple[int, int], tuple[float, float]]] = {}
        self.local_prior = 2.0  # plays' worth of an arm's batch-wide record in its record at a row bucket
        self.prior = 1.0  # plays' worth of the batch-wide correction in each arm's own (shrinkage)
        self.prior_plays = 2.0  # plays' worth of the (rescaled) estimate against an arm's own accepted record
        self.family = dict(family or {})
        self._chains = [a for a in self.arms if self.family.get(a) == 1 and a[0] == a[1] + 1]  # pool width 1, T = d + 1
        self._top1: dict[int, tuple[float, float]] = {}  # depth -> decayed (continued, tried) of the top-1 chain
        self.stretch = 0.5  # how far a shallower chain's record counts the steps it would take over long runs (0: one)
        self.continuation_known = 8.0  # (decayed) tries after which a depth's continuation rate estimates chains
        self._top1_at: dict[int, dict[int, tuple[float, float]]] = {}  # the same per row bucket (see _local)
        self.local_tries = 8.0  # tries' worth of a depth's batch-wide continuation rate in its rate at a row bucket
        # row bucket (None: batch-wide) -> (deepest depth known, d -> _chain_estimate(d)), since the last counts
        self._chain_memo: dict = {}
        self._version = 0  # moves whenever records, estimates or continuation counts do (key of _chain_accepted's memo)
        self._chain_acc: tuple[tuple[int, int | None], dict] = ((-1, None), {})
        self.family_prior = 4.0  # plays' worth of the batch-wide correction in each family's factor
        self._families: dict | None = {}  # family -> its factor (None: stale, see _family_factor)
        # A tree's own accepted record is confounded by the text it was played on: the budget turns to bushy trees
        # on easy text and to chains on hard, so bushy trees' records looked ~16 % better than they were at batch 1
        # (chains ~7 % worse), and the budget played them 10 % below the chain. Each step that plays a tree also
        # tells what the chain of its depth would have accepted (the top-1 runs), so a tree is judged by its
        # accepted drafts per chain draft on the same steps, times the chain's record now (``paired``).
        self.paired = True
        self._paired: dict[tuple[int, int], tuple[float, float]] = {}  # arm -> decayed (its accepted, its chain's)
        self._last_accepted: float | None = None

    def start(self, owner, rows: int) -> tuple[int, int]:
        """Called at the start of each draft(): close the previous step's clock, pick this step's arm.

        ``owner`` identifies one generation (the drafter): a new one restarts the clock, so the
        prefill is never counted as a step.
        """
        now = self.clock()
        if owner is self._owner:
            self._close_step(now)
        self._owner, self._rows = owner, rows
        self._absorb()
        self.steps += 1
        self.last = self.choose(rows)
        self.history.append(self.last)
        # The step's clock starts after the choice: scoring every arm (every rescore_every steps, and on every
        # exploring step) is the budget's cost, not the arm's. Charged to the arm, it made every explored arm look
        # ~0.3 ms (3 % at batch 4) slower than the arm held, which pays it one step in four.
        self._t0 = self.clock()
        return self.last

    def pause(self) -> None:
        """A step that the policy does not draft begins (prompt lookup verifying its copy alone): the step that
        just ended is measured here, and the next :meth:`start` measures nothing (the interval holds another step)."""
        self._close_step(self.clock())
        self._t0 = None

    def _close_step(self, now: float) -> None:
        """The step that began at the last :meth:`start` ended at ``now``: its seconds go to the step-time model."""
        if self._t0 is not None and self.last is not None:
            self.times.observe(self._rows, *self.last, now - self._t0)

    def offer(self, curve, arms: Sequence[tuple[int, int]], exact: Sequence[bool] | None = None) -> None:
        """This step's E[accepted] of each arm in ``arms`` (a 1-d array, NaN: not drafted this step).

        ``exact[i]`` False: arm i plays another pool (top_k) than the one drafted this step, so its value is
        only a stand-in (used until the arm's own pool has been drafted once). ``curve`` may be a host-pinned
        tensor being filled asynchronously: it is read at the next :meth:`start`, after the step's own host
        read has synchronised the device.
        """
        self._pending = (curve, arms, exact)

    def wants_estimates(self) -> bool:
        """Whether this step should :meth:`offer` its estimates, for a policy whose scoring is a large share of
        its draft (a chain: 73 of its 307 draft ops, ~0.3 ms at batch 1): every :attr:`estimate_every` steps, and while
        the chosen arm has no estimate yet. Steps in between are judged against the arm's smoothed estimate."""
        # (off the exploring steps' phase, steps % explore_every == 0: an explored arm's few steps would otherwise all
        #  pay the scoring, ~0.3 ms at batch 1, that the held arm pays one step in estimate_every)
        every = max(self.estimate_every, 1)
        return self.steps % every == every // 2 or self.last not in self.gain

    def observe_accepted(self, accepted: float, decay: float = 0.95) -> None:
        """The drafts the step just accepted per row, against what the chosen arm's estimate said.

        Calibration is fitted on other text than the one being decoded, so its E[accepted] can be off by
        a factor (the bundled head's is ~0.65x on third-party code); :attr:`correction`, the decayed ratio
        of accepted to estimated, rescales every arm's estimate. The factor also differs between arms (a
        chain and a bushy tree of the same calibrated value do not accept alike), so an arm played often
        is rescaled by its own ratio (:meth:`correction_of`). Called after the step's host read.
        """
        self._last_accepted = None if self.last is None or self.last[0] == 1 else accepted
        if self.last is None or self.last[0] == 1:
            return
        if self._pending is None:  # a step that offered no estimates (an unscored chain): its smoothed estimate
            est = self.gain.get(self.last, math.nan)
        else:
            curve, arms, _ = self._pending
            est = float(_host_values(curve)[list(arms).index(self.last)])
        if math.isfinite(est):
            self._seen = [decay * self._seen[0] + accepted, decay * self._seen[1] + est]
            self._record(self.last, accepted, est, decay)

    def _record(self, arm: tuple[int, int], accepted: float, est: float, decay: float, plays: float = 1.0) -> None:
        """``plays`` (decayed) plays of ``arm`` (one step; more for a step that stands for more, see
        :meth:`observe_chains`): ``accepted`` drafts per row a play against its estimate ``est``."""
        acc0, est0, n0 = self._seen_arm.get(arm, (0.0, 0.0, 0.0))
        self._seen_arm[arm] = (decay * acc0 + plays * accepted, decay * est0 + plays * est, decay * n0 + plays)
        local = self._seen_at.setdefault(row_bucket(self._rows), {})
        acc1, n1 = local.get(arm, (0.0, 0.0))
        local[arm] = (decay * acc1 + plays * accepted, decay * n1 + plays)
        self._families = None  # the family factors are recomputed when next asked for
        self._version += 1

    def observe_chains(self, runs: Sequence[int], spans: Sequence[int] | None = None, decay: float = 0.95) -> None:
        """What every chain arm would have accepted this step: ``runs`` are the live rows' top-1 runs (accepted drafts
        before the first that was not its parent's top-1 child); a chain of depth d accepts min(run, d). Recorded as
        a play of each chain arm no deeper than the step's tree (deeper ones would be censored), except the arm
        played (:meth:`observe_accepted` has it). Chains are the arms the calibration misjudges most (a 5-deep
        chain's estimate is ~half what it accepts on the bundled pair) and, once one looks poor, the last that
        exploration tries: this way they are measured on the text at hand without being played.

        ``spans``: how deep each row's tree held its top-1 chain. A bushy tree keeps its best T-1 nodes, which often
        stop the top-1 chain short of the tree's depth; a run that reaches the span is censored there, and counting
        it as the whole chain's record made a 7-deep chain look ~20 % worse than it is while bushy trees were played
        (so they kept being played). Such a row is credited the span plus the expected further run, from the top-1
        continuation rates measured at each depth (:meth:`continuation`).

        A row whose run r got through all d drafts of a shallower chain counts 1 + :attr:`stretch` * ((r + 1) / (d + 1)
        - 1) plays of it, not one: the d-deep chain would have taken (r + 1) / (d + 1) steps over the text this step
        covered where runs are long, so counting one made every shallower chain look worse than it is played (the
        9-deep chain 4.4 % under its own τ on a 10-deep chain's steps at batch 1, the 4-deep one 4.1 % on a 7-deep
        chain's at batch 16). The weights of text made of long stretches (``stretch`` 1) overshoot as much the other
        way, since the next step then starts afresh, from the target's own features; halfway, on the bundled pair, the
        records of 11 chains at batch 1, 4 and 16 came within 0.9 % of their own τ on average, 3.3 % at most (one step
        a row: 2.5 % under on average, 4.4 % at most; docs/benchmarks.md)."""
        if not runs or self.last is None or self.last[0] == 1:
            return
        if spans is not None:
            self._count_continuations(runs, spans)
        played = self._last_accepted
        for arm in self._chains:
            T, d = arm
            if d > self.last[1] or arm == self.last:
                continue
            if spans is None:
                got = [min(r, d) for r in runs]
            else:
                got = [min(r, d) if r < L or d <= L else L + self._further(L, d) for r, L in zip(runs, spans)]
            if d == self.last[1] and played is not None:  # the played tree against its depth's chain, same step
                a, c = self._paired.get(self.last, (0.0, 0.0))
                self._paired[self.last] = (decay * a + played, decay * c + sum(got) / len(runs))
            est = self.gain.get(arm, math.nan)
            if math.isfinite(est):
                w = [covered_plays(r, d, self.stretch) for r in runs]
                self._record(arm, sum(x * y for x, y in zip(w, got)) / sum(w), est, decay, sum(w) / len(runs))

    def _count_continuations(self, runs: Sequence[int], spans: Sequence[int], decay: float = 0.98) -> None:
        """Per depth j, decayed (continued, tried) counts of the top-1 chain: a row tried depth j when its run reached
        j - 1 and its tree held the top-1 draft at depth j, and continued when the run went on through it."""
        deepest = max(spans, default=0)
        for j in range(1, deepest + 1):
            hit = sum(1 for r, L in zip(runs, spans) if j <= L and r >= j)
            tried = sum(1 for r, L in zip(runs, spans) if j <= L and r >= j - 1)
            for table in (self._top1, self._top1_at.setdefault(row_bucket(self._rows), {})):
                h, t = table.get(j, (0.0, 0.0))
                table[j] = (decay * h + hit, decay * t + tried)
        self._chain_memo = {}
        self._version += 1

    def _chain_estimate(self, d: int, rows: int | None = None) -> float | None:
        """E[accepted drafts] of a d-deep chain from the top-1 continuation rates, sum over j <= d of P(run >= j); depths
        past the deepest tried :attr:`continuation_known` times take that depth's rate (None before any is).

        A chain's calibrated estimate multiplies per-edge acceptances that are correlated along the path (~5-8x low
        for a 7-deep chain on the bundled pair), and only chains no deeper than the step's tree are observed: the
        chains deeper than any played looked poor and were never tried (at batch 1 the budget held the 7-deep chain
        of its pool, 1.84x vanilla, where a 9-deep one ran 1.98x). ``rows``: the rates at its row bucket
        (:meth:`_local`)."""
        bucket = None if rows is None else row_bucket(rows)
        if bucket not in self._chain_memo:  # (asked for every chain arm at each scoring: once per step's counts)
            deepest = 0
            while self._top1.get(deepest + 1, (0.0, 0.0))[1] >= self.continuation_known:
                deepest += 1
            self._chain_memo[bucket] = (deepest, {})
        deepest, memo = self._chain_memo[bucket]
        if not deepest:
            return None
        if d not in memo:
            memo[d] = self._run_sum(0, d, lambda j: self.continuation(min(j, deepest), rows))
        return memo[d]

    def continuation(self, j: int, rows: int | None = None) -> float:
        """P(the top-1 chain's draft at depth j is accepted | those before it were), from the counts (0.5 prior);
        ``rows``: at its row bucket, shrunk towards the batch-wide rate by :attr:`local_tries` tries."""
        h, t = self._top1.get(j, (0.0, 0.0))
        rate = (h + 0.5) / (t + 1.0)
        if rows is None:
            return rate
        h, t = self._top1_at.get(row_bucket(rows), {}).get(j, (0.0, 0.0))
        return (h + 0.5 + self.local_tries * rate) / (t + 1.0 + self.local_tries)  # = rate when one bucket saw all

    def _further(self, L: int, d: int) -> float:
        """Expected accepted top-1 drafts at depths L+1..d given the run reached depth L."""
        return self._run_sum(L, d, self.continuation)

    @staticmethod
    def _run_sum(L: int, d: int, rate: Callable[[int], float]) -> float:
        """Sum over j in L+1..d of P(a top-1 run that reached depth L goes on through depth j), from per-depth
        continuation ``rate``s."""
        out, p = 0.0, 1.0
        for j in range(L + 1, d + 1):
            p *= rate(j)
            out += p
        return out

    @property
    def correction(self) -> float:
        """Accepted ÷ estimated drafts of the recent steps, in [1/4, 8] (1 before any step)."""
        acc, est = self._seen
        return 1.0 if est <= 0 else min(8.0, max(0.25, acc / est))

    def correction_of(self, arm: tuple[int, int]) -> float:
        """The arm's own accepted ÷ estimated, shrunk towards its family's factor by :attr:`prior` plays (an arm
        never played gets that factor), in [1/4, 16]. (A deep chain's calibrated estimate multiplies
        per-edge acceptances that are correlated along the path: on the bundled head and third-party code a
        7-deep chain's is ~5-8x low, a bushy tree's ~2x.)"""
        acc, est, n = self._seen_arm.get(arm, (0.0, 0.0, 0.0))
        prior = self._family_factor.get(self.family.get(arm), self.correction)
        if est <= 0:
            return prior
        w = self.prior * est / n  # the prior's weight in estimated drafts: `prior` plays of this arm
        return min(16.0, max(0.25, (acc + w * prior) / (est + w)))

    @property
    def _family_factor(self) -> dict:
        """Each family's accepted ÷ estimated over its played arms (pooled sums, shrunk towards :attr:`correction`
        by :attr:`family_prior` plays), in [1/4, 16]: the factor of its arms never played. Families are the
        arms' pool widths (:attr:`family`): a chain never played at batch 16 is judged like the chains that
        were (calibration is ~3x further off for chains than for 2-wide pools)."""
        if self._families is not None:
            return self._families
        sums: dict = {}
        for arm, (acc, est, n) in self._seen_arm.items():
            f = self.family.get(arm)
            if f is not None and est > 0:
                a, e, m = sums.get(f, (0.0, 0.0, 0.0))
                sums[f] = (a + acc, e + est, m + n)
        # shrunk towards the batch-wide factor by `family_prior` plays: one unlucky probe must not sink a family
        c, w = self.correction, self.family_prior
        self._families = {f: min(16.0, max(0.25, (a + w * c * e / m) / (e + w * e / m)))
                          for f, (a, e, m) in sums.items()}
        return self._families

    def _absorb(self) -> None:
        if self._pending is None:
            return
        curve, arms, exact = self._pending
        self._pending = None
        vals = dict(zip(arms, _host_values(curve).tolist()))
        base = vals.get(self.base, math.nan)
        if not math.isfinite(base):
            return
        # Deep arms are estimated only on the steps that drafted deep, so a plain EMA per arm would compare
        # stale values with fresh ones. Instead every arm keeps its decayed ratio of sums to the base arm (the
        # smallest tree, estimated on every drafted step), and its gain is that ratio times the base's EMA.
        # An arm estimated from another pool than its own keeps that ratio apart, until its own pool is drafted.
        self._base_ema = base if self._base_ema is None else self._base_ema + self.alpha * (base - self._base_ema)
        for i, (arm, v) in enumerate(vals.items()):
            if math.isfinite(v):
                table = self._ratio if exact is None or exact[i] or arm == self.base else self._stand_in
                num, den = table.get(arm, (0.0, 0.0))
                table[arm] = (self.decay * num + v, self.decay * den + base)
        self.gain = {a: self._base_ema * (n / d if d > 0 else 1.0)
                     for a, (n, d) in {**self._stand_in, **self._ratio}.items()}
        self._version += 1

    def accepted(self, arm: tuple[int, int], rows: int | None = None) -> float | None:
        """E[accepted drafts per row] of an arm: the calibrated estimate rescaled by :meth:`correction_of`, blended
        with what the arm's own recent steps accepted (:attr:`prior_plays` pseudo-steps of the estimate). The
        rescaled estimate follows the context (it is recomputed every step) but carries the calibration's bias;
        the arm's own record has none, so the arms played most are judged by what they did. ``rows``: at a batch
        of that many rows, the record taken at its row bucket (:meth:`_local`); None: the batch-wide record."""
        if arm in self._chains:
            return self._chain_accepted(arm[1], rows)
        return self._blended(arm, rows)

    def _chain_accepted(self, d: int, rows: int | None = None) -> float | None:
        """:meth:`accepted` of the d-deep chain: its own blend (:meth:`_blended`), but never less than the chain one
        shallower plus what the top-1 continuation rates say one more depth adds (and that alone for a chain never
        drafted). A chain deeper than the one played is recorded only on its own few plays, on other text than the
        shallower chains' records (taken on every step): at batch 1 a 9-deep chain played on a hard stretch kept a
        record below the 8-deep one's, which a deeper chain can never have on the same text, and was never played
        again (auto 1.96x against 2.13x for the 9-deep chain held)."""
        key, memo = self._chain_acc
        if key != (self._version, bucket := None if rows is None else row_bucket(rows)):
            memo = {}
            self._chain_acc = ((self._version, bucket), memo)
        if d <= 0:
            return 0.0  # the root alone accepts no draft
        if d not in memo:
            own = self._blended((d + 1, d), rows) if (d + 1, d) in self.gain else None
            prev = self._chain_accepted(d - 1, rows) if (d, d - 1) in self._chains else None
            est, est_prev = self._chain_estimate(d, rows), self._chain_estimate(d - 1, rows)
            if prev is not None and est is not None and est_prev is not None:
                floor = prev + est - est_prev
                own = floor if own is None else max(own, floor)
            memo[d] = own
        return memo[d]

    def _blended(self, arm: tuple[int, int], rows: int | None = None) -> float | None:
        """The calibrated (or, for a chain, the top-1 runs') estimate blended with the arm's own accepted record."""
        g = self.gain.get(arm)
        if g is None:
            return None
        # rescaled, an estimate may pass what the arm can hold (a factor fitted on chains applied to a bushy tree):
        # never more drafts than its depth or its nodes
        run = self._chain_estimate(arm[1], rows) if arm in self._chains else None  # a chain: from the top-1 runs
        g = run if run is not None else min(g * self.correction_of(arm), float(min(arm[1], arm[0] - 1)))
        acc, _, n = self._seen_arm.get(arm, (0.0, 0.0, 0.0))
        chain = (arm[1] + 1, arm[1])
        a, c = self._paired.get(arm, (0.0, 0.0))
        paired = self.paired and c > 0 and n > 0 and chain != arm and chain in self._chains
        now = self.accepted(chain, rows) if paired else None
        if now is not None:  # its own record, as a ratio to its depth's chain on the same steps, times that chain's now
            acc = n * (a / c) * now
        elif rows is not None and n > 0:
            acc = n * self._local(arm, rows, acc / n)
        return (acc + self.prior_plays * g) / (n + self.prior_plays)

    def _local(self, arm: tuple[int, int], rows: int, mean: float) -> float:
        """The arm's accepted drafts per row as recorded at ``rows``' row bucket, shrunk towards its batch-wide ``mean``
        by :attr:`local_prior` plays. Rows accept more as their generation goes on (one static batch of 16 rows, a
        7-deep chain: 3.3-4.0 drafts a row in the first six steps, 4.5-5.4 later, up to 7 in the last few, with few
        rows left), so records carried from one batch's end to the next batch's start overrated every chain, deep
        ones most, and at 16 rows the budget played the 7-deep chain where the 4-deep one was 7 % faster. In a
        static batch the rows left tell where in its generation it is; a continuous batch keeps one bucket."""
        acc, n = self._seen_at.get(row_bucket(rows), {}).get(arm, (0.0, 0.0))
        return (acc + self.local_prior * mean) / (n + self.local_prior)

    def rate(self, rows: int, T: int, depth: int) -> float | None:
        """Expected tokens per second of an arm over the whole batch, sum over rows of (1 + E[accepted]) / step
        time (None while its acceptance or time is unknown). The root alone (T=1) accepts nothing by definition."""
        return self._per_second(rows, T, depth, 0.0 if T == 1 else self.accepted((T, depth), rows))

    def rate_bound(self, rows: int, T: int, depth: int) -> float | None:
        """The most tokens per second an arm can make: its :meth:`rate` were every row to accept ``depth`` drafts."""
        return self._per_second(rows, T, depth, float(min(depth, T - 1)))

    def _per_second(self, rows: int, T: int, depth: int, accepted: float | None) -> float | None:
        t = self.times.predict(rows, T, depth)
        return None if accepted is None or t is None else rows * (1.0 + accepted) / max(t, 1e-9)

    def _rates(self, rows: int) -> dict[tuple[int, int], float]:
        """Each arm with a known :meth:`rate`, most expected tokens/s first (one scoring pass a step)."""
        scored = [(r, a) for a in self.arms if self._allowed(a, rows) and (r := self.rate(rows, *a)) is not None]
        return {a: r for r, a in sorted(scored, key=lambda x: -x[0])}

    def _allowed(self, arm: tuple[int, int], rows: int) -> bool:
        """Whether ``arm`` may be played at ``rows`` rows (:attr:`narrow` arms only at up to :attr:`narrow_rows`)."""
        return rows <= self.narrow_rows or arm not in self.narrow

    def ranked(self, rows: int) -> list[tuple[int, int]]:
        """The arms with a known rate, most expected tokens/s first."""
        return list(self._rates(rows))

    def best(self, rows: int) -> tuple[int, int]:
        """The arm with the most expected tokens/s; the largest (deepest, widest) arm until data arrive."""
        ranked = self.ranked(rows)
        return ranked[0] if ranked else max((a for a in self.arms if self._allowed(a, rows)), key=lambda a: (a[1], a[0]))

    def neighbours(self, arm: tuple[int, int]) -> list[tuple[int, int]]:
        """The next smaller and larger T (at the nearest depth it has) and the next shallower and deeper depth."""
        T, d = arm
        sizes = sorted({t for t, _ in self.arms})
        i = sizes.index(T)
        out = []
        for s in (-1, 1):
            if 0 <= i + s < len(sizes):
                depths = [dd for t, dd in self.arms if t == sizes[i + s]]
                out.append((sizes[i + s], min(depths, key=lambda x: (abs(x - d), x))))
        depths = sorted(dd for t, dd in self.arms if t == T)
        j = depths.index(d)
        return out + [(T, depths[j + s]) for s in (-1, 1) if 0 <= j + s < len(depths)]

    def choose(self, rows: int) -> tuple[int, int]:
        """The best arm, or every ``explore_every`` steps (more at wide batches: :attr:`explore_rows`) one of its
        neighbours or the runner-up, in turn (so plain decoding, once chosen, still tries a small tree now and then
        and comes back when trees pay again); the
        :attr:`probes` first at each new row bucket. The arm last held keeps its place while it is expected
        within :attr:`hold_margin` of the best; arms are rescored every :attr:`rescore_every` steps only."""
        bucket = row_bucket(rows)
        if bucket not in self._played:  # the first bucket takes every probe; later ones not the middle-sized tree
            self._played[bucket], self._probes[bucket] = 0, self.probes[: 3 if self._played else None]
        n = self._played[bucket] = self._played[bucket] + 1
        probes = self._probes[bucket]
        if n <= 2 * len(probes):  # each probe twice: its first step pays one-time work (see StepTimeModel.observe)
            return probes[(n - 1) // 2]
        every = self.explore_every * max(1, rows // self.explore_rows)
        explore = bool(every) and self.steps % every == 0
        held = self._held.get(bucket)
        if held is not None and not explore and self.steps % max(self.rescore_every, 1):
            return held  # between rescorings (see rescore_every)
        rates = self._rates(rows)
        ranked = list(rates)
        best = ranked[0] if ranked else self.best(rows)
        if held in ranked[1:] and rates[held] >= (1 - self.hold_margin) * rates[best]:
            best = held  # within the margin of the leader: keep it (between near-equal arms the estimates are noise:
            #              at batch 1 the budget drifted among them to bigger trees, ~4 % below the chain)
        self._held[bucket] = best
        if explore:
            nbrs = self.neighbours(best)
            # and the runner-up outside them: a jump to another region (a chain, another pool) that the
            # one-bucket walk would reach only after many rounds
            nbrs += [a for a in ranked[1:] if a not in nbrs][:1]
            nbrs = [a for a in nbrs if self._worth_a_try(rows, a, best)]
            if nbrs:
                return nbrs[(self.steps // every) % len(nbrs)]
        return best

    def _worth_a_try(self, rows: int, arm: tuple[int, int], best: tuple[int, int]) -> bool:
        """Whether exploring ``arm`` may pay. Never if it would be slower than the best arm even were every draft
        accepted (:meth:`rate_bound`): at batch 16 on a CPU a 40-node tree's step costs more than any acceptance
        can repay, and its step time is all that playing it would teach. Otherwise, while it has fewer than
        :attr:`explore_known` plays of its own (its estimate may be biased low, and only playing it tells), or if
        it is expected within :attr:`explore_floor` of the best arm's tokens/s. (At batch 16 a deep neighbour runs
        ~0.6x the best arm's rate at twice its step time: trying it every 8 steps for good cost ~5 %.)"""
        if not self._allowed(arm, rows):
            return False
        r, rb, bound = self.rate(rows, *arm), self.rate(rows, *best), self.rate_bound(rows, *arm)
        if bound is not None and rb is not None and bound < rb:
            return False
        if self._seen_arm.get(arm, (0.0, 0.0, 0.0))[2] < self.explore_known:
            return True
        return r is None or rb is None or r >= self.explore_floor * rb
