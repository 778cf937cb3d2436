"""The online tree budget: step-time model, bounds, and a reaction to a synthetic slowdown (injected clock)."""
from __future__ import annotations

import math

import pytest
import torch

from treedec.tree import TreeError
from treedec.tree.budget import BudgetController, StepTimeModel, row_bucket
from treedec.tree.policies import DynamicPolicy

from tests.decoding.test_policies import primed_drafter
from tests.helpers import greedy_reference, make_pair


def test_step_time_model_fits_unmeasured_sizes_with_non_negative_slopes():
    m = StepTimeModel()
    assert m.predict(1, 16, 5) is None
    for T in (8, 32):
        m.observe(1, T, 5, 0.01 + 0.001 * T)
    assert m.predict(1, 64, 5) == pytest.approx(0.01 + 0.064)  # the linear fit a + b*T
    m2 = StepTimeModel()
    for T, t in ((8, 0.05), (32, 0.02)):  # noise that makes big trees look cheaper: no negative slope
        m2.observe(1, T, 5, t)
    assert m2.predict(1, 64, 5) >= min(0.05, 0.02)


def test_step_time_model_predicts_a_new_row_count_from_the_others():
    cost = lambda r, T, d: 0.004 + 0.0002 * r * T + 0.001 * d + 0.0003 * r * d  # noqa: E731  (compute-bound in rows)
    m = StepTimeModel()
    for r, T, d in ((1, 8, 3), (1, 32, 3), (1, 16, 5), (4, 8, 4), (4, 64, 5), (2, 16, 6)):
        m.observe(r, T, d, cost(r, T, d))
    for r, T, d in ((16, 24, 4), (2, 1, 0), (64, 8, 3)):  # row counts never measured
        assert m.predict(r, T, d) == pytest.approx(cost(r, T, d), rel=1e-6)
    one = StepTimeModel()  # batch 1 alone: its rows terms are unknown, so 16 rows are first predicted alike
    for T in (8, 32):
        one.observe(1, T, 4, 0.01 + 0.001 * T)
    before = one.predict(16, 8, 4)
    assert before == pytest.approx(one.predict(1, 8, 4))
    for _ in range(8):  # 16 rows run 3x slower than the batch-1 fit says: its other arms are scaled alike
        one.observe(16, 32, 4, 3 * (0.01 + 0.001 * 32))
    assert one.predict(16, 8, 4) > 1.5 * before and one.predict(4, 8, 4) < one.predict(16, 8, 4)


def test_an_arm_measured_at_another_pace_follows_the_machine():
    """The machine slows down 1.5x after arm (8, 7) was last measured: the established arm's steps move the shared
    pace, so (8, 7)'s prediction follows the machine most of the way (to within ~20 % of its time at today's pace).
    Per-arm times alone kept its old time (a third off) and ranked it far cheaper than the arm played."""

    def run(pace_alpha: float) -> tuple[float, float]:
        m = StepTimeModel()
        m.pace_alpha = pace_alpha
        for t in [0.011] * 3:
            m.observe(1, 8, 7, t)
        for t in [0.010] * 40 + [0.015] * 40:  # every step of the held arm now takes 1.5x as long
            m.observe(1, 6, 5, t)
        assert m.predict(1, 6, 5) == pytest.approx(0.015, rel=0.02)
        return m.predict(1, 8, 7), m.pace

    (paced, pace), (stale, _) = run(0.25), run(0.0)
    assert stale == pytest.approx(0.011) and pace > 1.2
    assert paced == pytest.approx(0.0165, rel=0.2) and abs(paced - 0.0165) < 0.5 * abs(stale - 0.0165)


@pytest.mark.parametrize("paired", [True, False])
def test_a_tree_is_judged_against_its_depths_chain_on_the_same_steps(paired):
    """A bushy tree played on easy text accepts 4 drafts a step where its depth's chain would have accepted 3.5; then
    the text gets hard and the chain plays, accepting 1.5. The tree's own record still says 4 (it was not played
    since), which would make it look 2.5x the chain; judged as 4/3.5 of the chain's record now it is ~2 drafts."""
    tree, chain = (16, 5), (6, 5)
    ctl = BudgetController([(1, 0), chain, tree], family={chain: 1, tree: 2}, probe=False)
    ctl.paired = paired
    ctl.gain = {chain: 2.0, tree: 2.5}
    for _ in range(30):  # easy text, the tree plays: top-1 runs 3 and 4 (the chain's 3.5)
        ctl.last = tree
        ctl.observe_accepted(4.0)
        ctl.observe_chains([3, 4], [5, 5])
    for _ in range(60):  # hard text, the chain plays
        ctl.last = chain
        ctl.observe_accepted(1.5)
        ctl.observe_chains([1, 2], [5, 5])
    assert ctl.accepted(chain) < 1.8
    if paired:
        # ~4/3.5 of the chain's, plus the estimate's small prior weight (prior_plays): far from the stale 4
        assert 4 / 3.5 * ctl.accepted(chain) <= ctl.accepted(tree) < 2.2
    else:  # the stale record: what the budget did before
        assert ctl.accepted(tree) > 3.5


class FakeClock:
    """Step seconds from a synthetic model of the arm the controller chose for the step that just ended."""

    def __init__(self, cost, rows: bool = False):
        """``rows``: ``cost(rows, T, depth)`` instead of ``cost(T, depth)``."""
        self.now, self.cost, self.ctl, self.rows = 0.0, cost, None, rows

    def __call__(self) -> float:
        if self.ctl is not None and self.ctl.last is not None:
            args = (self.ctl._rows, *self.ctl.last) if self.rows else self.ctl.last
            self.now += self.cost(*args)
        return self.now


def drive(ctl: BudgetController, clock: FakeClock, steps: int, gain, rows: int = 1) -> list:
    owner = object()
    for _ in range(steps):
        T, d = ctl.start(owner, rows)
        ctl.offer([gain(a, b) if b <= d else float("nan") for a, b in ctl.arms], ctl.arms)
    return ctl.history[-steps:]


def test_auto_budget_moves_to_smaller_trees_when_the_machine_gets_slower_per_node():
    gain = lambda T, d: min(d, 4.0) * (1 - 0.9 ** (T / 4))  # noqa: E731  (saturating in T and depth)
    cheap = lambda T, d: 0.010 + 0.00002 * T + 0.001 * d  # noqa: E731  (nodes nearly free: a big tree pays)
    clock = FakeClock(cheap)
    ctl = BudgetController([(T, d) for d in (3, 4, 5) for T in (8, 16, 24, 32, 40, 48, 64)], clock=clock)
    clock.ctl = ctl
    early = drive(ctl, clock, 120, gain)
    big = max(set(early[-40:]), key=early[-40:].count)
    assert big[0] >= 48
    clock.cost = lambda T, d: 0.010 + 0.002 * T + 0.001 * d  # noqa: E731  (the machine got busy: nodes cost)
    late = drive(ctl, clock, 200, gain)
    small = max(set(late[-40:]), key=late[-40:].count)
    assert small[0] <= 24  # adapted, without being told
    assert all((T, d) in ctl.arms for T, d in early + late)  # always within bounds


def mode(arms: list) -> tuple[int, int]:
    return max(set(arms), key=arms.count)


def test_auto_budget_shrinks_its_trees_as_the_target_gets_compute_bound_in_rows_times_T():
    gain = lambda T, d: min(d, 4.0) * (1 - 0.85 ** (T / 2))  # noqa: E731
    clock = FakeClock(lambda r, T, d: 0.004 + 0.00005 * r * T + 0.0005 * d, rows=True)
    arms = [(1, 0), (2, 1), (4, 3)] + [(T, d) for d in (3, 4, 5) for T in (8, 16, 24, 32, 40, 48, 64)]
    ctl = BudgetController(arms, clock=clock)
    clock.ctl = ctl
    chosen = {rows: mode(drive(ctl, clock, 160, gain, rows)[-40:]) for rows in (1, 4, 16, 64)}
    assert chosen[1][0] >= 24 and chosen[4][0] >= 8  # small batches: wide trees pay
    assert chosen[1][0] > chosen[4][0] > chosen[16][0] > 1  # the wider the batch, the smaller the tree
    assert chosen[64] == (1, 0)  # and at 64 rows no tree pays: plain decoding
    back = mode(drive(ctl, clock, 160, gain, 1)[-40:])  # exploration leaves plain decoding when trees pay again
    assert back[0] >= 24


@pytest.mark.parametrize("seed", range(3))
def test_auto_policy_stays_within_bounds_and_is_lossless(seed):
    from treedec.decoding.speculative import SpeculativeDecoder

    target, draft = make_pair(seed + 30)
    pol = DynamicPolicy("auto", depth=5, top_k=4, max_total_tokens=40, explore_every=2)
    assert pol.max_size == 40 and pol.max_depth == 5
    assert (1, 0) in pol.budget.arms and (2, 1) in pol.budget.arms and (4, 3) in pol.budget.arms
    prompt = list(range(3, 12 + seed))
    out = SpeculativeDecoder(target, draft, pol).generate(prompt, 100)
    assert out.tokens[0] == greedy_reference(target, prompt, 100)
    # the buckets, and a chain at every depth (1-5: T = 2 ... 6; min_depth bounds the bushy arms only)
    assert {(T, d) for T, d in pol.budget.arms if T not in (1, 2, 4, 8, 16, 24, 32, 40)} == {(3, 2), (5, 4), (6, 5)}
    assert {(d + 1, d) for d in range(1, 6)} <= set(pol.budget.arms)
    assert {T for T, _ in pol.budget.history} <= {1, 2, 3, 4, 5, 6, 8, 16, 24, 32, 40} and len(set(pol.budget.history)) > 1
    assert {d for T, d in pol.budget.history if T >= 8} <= {3, 4, 5}
    d = primed_drafter(seed)
    with torch.inference_mode():
        tree = pol.draft(d)
    assert tree.size == pol.budget.last[0] and int(tree.depth.max()) <= max(pol.budget.last[1], 0)


def test_auto_policy_picks_plain_decoding_when_no_tree_pays_and_stays_lossless():
    from treedec.decoding.speculative import SpeculativeDecoder

    target, draft = make_pair(33)
    clock = FakeClock(lambda T, d: 0.001 * T ** 2)  # every node is dear: the root alone is fastest
    pol = DynamicPolicy("auto", depth=4, top_k=4, explore_every=4, clock=clock)
    clock.ctl = pol.budget
    prompt = list(range(5, 15))
    out = SpeculativeDecoder(target, draft, pol).generate(prompt, 150)
    assert out.tokens[0] == greedy_reference(target, prompt, 150)
    late = pol.budget.history[-20:]
    assert mode(late) == (1, 0) and late.count((1, 0)) >= 15  # plain decoding, a neighbour tried now and then
    assert out.stats.as_dict()["mean_tree_size"] < 4


def test_auto_policy_keeps_trees_when_nodes_are_nearly_free():
    """Nodes nearly free: any acceptance pays, so on the policy's real arm set (the root alone, chains, pools of
    each width; estimates offered every step, unscored chain steps judged by their smoothed estimate) the budget
    ends on a big tree. (A random draft head accepts nothing, and then plain decoding is right: see above.)"""
    clock = FakeClock(lambda T, d: 0.01 + 1e-5 * T)
    pol = DynamicPolicy("auto", depth=4, top_k=4, explore_every=4, clock=clock)
    ctl = clock.ctl = pol.budget
    gain = lambda T, d: 0.5 * min(d, 3) * (1 - 0.8 ** T)  # noqa: E731  (saturating in T and depth)
    owner = object()
    for _ in range(150):
        T, d = ctl.start(owner, 1)
        if T > 1 and (pol.arm_top_k[T, d] > 1 or ctl.wants_estimates()):
            ctl.offer([gain(a, b) if a > 1 and b <= d else math.nan for a, b in ctl.arms], ctl.arms)
        ctl.observe_accepted(gain(T, d) if T > 1 else 0.0)
    assert mode(ctl.history[-20:])[0] >= 8


def test_auto_budget_validation():
    with pytest.raises(TreeError, match="min_depth"):
        DynamicPolicy("auto", depth=4, top_k=4, min_depth=6)
    with pytest.raises(TreeError, match="total_tokens"):
        DynamicPolicy("many", depth=4, top_k=4)
    assert DynamicPolicy("auto", depth=3, top_k=2, max_total_tokens=64).max_size == 8  # 2 + 2*4 nodes drafted: 8 fits
    with pytest.raises(TreeError, match="node_share"):
        DynamicPolicy(16, depth=4, top_k=4, node_share=0)


def test_observed_acceptance_rescales_the_estimates_and_deep_arms_follow_the_base():
    """The calibrated E[accepted] is corrected by what the chosen arms really accepted, and an arm not
    drafted this step moves with the always-drafted smallest tree instead of keeping a stale value."""
    t = [0.0]
    b = BudgetController([(1, 0), (2, 1), (8, 3)], explore_every=0, clock=lambda: t[0], probe=False)
    owner = object()
    assert b.start(owner, 1) == (8, 3)  # no data yet (and no probes): the largest arm
    b.offer(torch.tensor([math.nan, 0.5, 1.0]), b.arms)
    b.observe_accepted(2.0)  # twice what the estimate (1.0) said
    assert b.correction == pytest.approx(2.0)
    t[0] += 0.01
    b.start(owner, 1)
    assert b.gain[(8, 3)] == pytest.approx(1.0)
    assert b.rate(1, 8, 3) == pytest.approx((1 + 2.0) / 0.01)
    b.offer(torch.tensor([math.nan, 0.25, math.nan]), b.arms)  # a shallow step: (8, 3) not drafted
    b.last = (2, 1)
    b.observe_accepted(0.25)
    t[0] += 0.01
    b.start(owner, 1)
    assert b.gain[(8, 3)] == pytest.approx((0.5 + b.alpha * (0.25 - 0.5)) * 2.0)  # base EMA x its ratio
    assert b.correction == pytest.approx((0.95 * 2.0 + 0.25) / (0.95 * 1.0 + 0.25))


def test_each_arm_drafts_the_narrowest_pool_that_holds_its_tree():
    """An auto arm drafts the top_k pool a fixed dynamic tree of that (T, depth, top_k) would: the same tree,
    node for node (a chain for T=8 at depth 7); a large pool_slack drafts the configured top_k always."""
    pol = DynamicPolicy("auto", depth=7, top_k=4, max_total_tokens=64)
    assert pol.arm_top_k[8, 7] == 1 and pol.arm_top_k[4, 3] == 1 and pol.arm_top_k[2, 1] == 1
    assert pol.arm_top_k[16, 5] == 2 and pol.arm_top_k[32, 7] == 3 and pol.arm_top_k[64, 7] == 4
    assert set(DynamicPolicy("auto", depth=7, top_k=4, pool_slack=1e9).arm_top_k.values()) == {4}
    for seed, (T, d) in enumerate([(8, 7), (16, 5), (24, 6), (64, 7)]):
        k = pol.arm_top_k[T, d]
        pol.budget.choose = lambda rows, arm=(T, d): arm
        drafter = primed_drafter(seed)
        with torch.inference_mode():
            got, want = pol.draft(drafter), DynamicPolicy(T, d, k).draft(drafter)
        for name in ("parents", "tokens", "depth", "rank"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (T, d, name)
        if k == 1:
            assert got.parents[0].tolist() == list(range(-1, T - 1))  # a chain
    with pytest.raises(TreeError, match="pool_slack"):
        DynamicPolicy("auto", depth=4, top_k=4, pool_slack=0.5)


def test_estimates_from_another_pool_are_stand_ins_until_the_arms_own_pool_is_drafted():
    t = [0.0]
    b = BudgetController([(1, 0), (2, 1), (8, 3), (16, 3)], explore_every=0, clock=lambda: t[0])
    owner = object()
    b.start(owner, 1)
    b.offer([math.nan, 0.5, 1.0, 2.0], b.arms, exact=[False, True, False, True])  # (8, 3) from (16, 3)'s pool
    t[0] += 0.01
    b.start(owner, 1)
    assert b.gain[8, 3] == pytest.approx(1.0) and (8, 3) not in b._ratio
    b.offer([math.nan, 0.5, 0.6, 0.9], b.arms, exact=[False, True, True, False])  # now its own pool
    t[0] += 0.01
    b.start(owner, 1)
    assert b.gain[8, 3] == pytest.approx(0.6)  # the stand-in no longer counts
    assert b.gain[16, 3] == pytest.approx(2.0)  # nor does a stand-in override an arm's own estimate


def test_probes_far_apart_arms_first_at_each_new_row_bucket():
    arms = [(1, 0), (2, 1), (4, 3)] + [(T, d) for d in (3, 4, 5) for T in (8, 16, 24, 32, 64)]
    b = BudgetController(arms, explore_every=0, clock=lambda: 0.0)
    assert b.probes == [(1, 0), (2, 1), (8, 5), (24, 5)]  # cheapest first; 24: the geometric middle of 8..64
    owner = object()
    twice = [a for a in b.probes for _ in range(2)]  # each twice: a first step pays one-time work
    assert [b.start(owner, 1) for _ in twice] == twice
    assert [b.start(owner, 16) for _ in range(6)] == twice[:6]  # a new batch size probes again, not the mid tree
    for rows in (16, 15, 13, 12):  # rows leaving the batch one by one stay in its bucket: no new probes
        assert b.start(owner, rows) == b.best(rows)
    assert sorted(b._played) == [1, 16]
    assert [row_bucket(r) for r in (1, 2, 3, 5, 6, 11, 12, 22, 23)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_a_preempted_step_counts_as_at_most_twice_its_arms_time():
    m = StepTimeModel(alpha=0.25)
    m.observe(1, 8, 3, 0.010)
    m.observe(1, 8, 3, 1.0)  # the process was descheduled once
    assert m.predict(1, 8, 3) == pytest.approx(0.010 + 0.25 * 0.010)
    for _ in range(12):  # a real, lasting 10x slowdown still shows within a dozen steps
        m.observe(1, 8, 3, 0.1)
    assert m.predict(1, 8, 3) > 0.08


def test_each_arm_is_corrected_by_its_own_acceptance_once_played():
    t = [0.0]
    b = BudgetController([(1, 0), (2, 1), (8, 3)], explore_every=0, clock=lambda: t[0])
    owner = object()
    for i in range(40):  # the chain (2, 1) accepts as estimated; the tree (8, 3) twice its estimate
        b.start(owner, 1)
        b.last = arm = [(2, 1), (8, 3)][i % 2]
        b.offer([math.nan, 0.5, 1.0], b.arms)
        b.observe_accepted(0.5 if arm == (2, 1) else 2.0)
        t[0] += 0.01
    assert b.correction_of((2, 1)) < 1.4 and b.correction_of((8, 3)) > 1.8  # shrunk a little towards 5/3
    assert b.correction_of((2, 1)) < b.correction < b.correction_of((8, 3))  # the batch-wide one lies between


@pytest.mark.parametrize("seed", range(2))
def test_a_chain_arm_drafts_the_static_chain_and_estimates_it_with_the_calibration(seed):
    from tests.tree.test_calibration import random_calibration

    cal = random_calibration(seed)
    pol = DynamicPolicy("auto", depth=7, top_k=4, calibration=cal)
    pol.budget.choose = lambda rows: (8, 7)
    drafter = primed_drafter(seed)
    with torch.inference_mode():
        tree = pol.draft(drafter)
    assert tree.parents[0].tolist() == list(range(-1, 7)) and tree.size == 8
    q = (tree.scores[:, 1:] - torch.nn.functional.pad(tree.scores[:, 1:-1], (1, 0))).exp()  # per-edge draft probs
    path = [[math.prod(cal(float(q[b, i]), i + 1) for i in range(j + 1)) for j in range(7)] for b in range(2)]
    want = sum(sum(p) for p in path) / 2  # E[accepted]: the chain's path acceptances, averaged over rows
    assert float(pol._curve[pol.budget.arms.index((8, 7))]) == pytest.approx(want, rel=1e-4)
    edge = torch.log(q)
    by_depth = torch.stack([cal.log_accept(edge[:, j], j + 1) for j in range(7)], 1)
    assert torch.allclose(cal.log_accept(edge, torch.arange(1, 8)), by_depth)  # tensor depths: one call


def test_an_arms_first_step_is_replaced_by_a_faster_second():
    m = StepTimeModel(alpha=0.25)
    m.observe(1, 8, 7, 0.030)  # built its index plans: one-time work
    m.observe(1, 8, 7, 0.010)
    assert m.predict(1, 8, 7) == pytest.approx(0.010)
    m.observe(1, 8, 7, 0.014)  # from the third on: the EMA
    assert m.predict(1, 8, 7) == pytest.approx(0.011)


def test_an_arm_measured_once_is_not_trusted_above_the_fit_of_settled_arms():
    """A first step pays one-time work (plans, oneDNN primitives for new shapes), so one inflated measurement
    must not bar an arm: while it has one step it is predicted by min(own, fit of arms with two steps)."""
    m = StepTimeModel()
    for T in (2, 8, 16, 32):  # settled arms: 1 ms + 0.1 ms per node
        for _ in range(2):
            m.observe(1, T, 4, 1e-3 + 1e-4 * T)
    m.observe(1, 4, 4, 9e-3)  # first step of a 4-node arm: 9 ms, 6x what it costs
    assert m.predict(1, 4, 4) == pytest.approx(1.4e-3, rel=0.05)
    assert m.coef()[0] == pytest.approx(1e-3, rel=0.05)  # the inflated step is out of the fit
    m.observe(1, 4, 4, 1.5e-3)  # its second step: now its own measurement counts
    assert m.predict(1, 4, 4) == pytest.approx(1.5e-3, rel=1e-6)


def test_an_arm_played_often_is_judged_by_what_it_accepted():
    """The rescaled calibrated estimate follows each step's curve (here it swings 1 <-> 3 while the text does
    not change); an arm's own record of 3 accepted per step does not, and dominates once it has a few steps."""
    t = [0.0]
    b = BudgetController([(1, 0), (2, 1), (8, 3)], explore_every=0, clock=lambda: t[0], probe=False)
    b.choose = lambda rows: (8, 3)
    owner, model = object(), []
    for step in range(30):
        t[0] += 0.01
        b.start(owner, 1)
        b.offer(torch.tensor([math.nan, 0.5, 1.0 if step % 2 else 3.0]), b.arms)
        b.observe_accepted(3.0)
        model.append((b.gain.get((8, 3), 0.0) * b.correction_of((8, 3)), b.accepted((8, 3))))
    est, blend = zip(*model[10:])
    assert max(abs(e - 3.0) for e in est) > 0.15  # the rescaled estimate alone keeps swinging
    assert max(abs(a - 3.0) for a in blend) < 0.5 * max(abs(e - 3.0) for e in est)
    assert b.accepted((2, 1)) == pytest.approx(b.gain[(2, 1)] * b.correction_of((2, 1)))  # never played: the estimate


def test_exploration_skips_neighbours_known_to_be_far_below_the_best():
    """Every explore_every steps a neighbour is tried; once it has a record of its own, only if it may reach
    explore_floor of the best arm's rate: at a large batch a deep neighbour that costs twice the step for little
    more acceptance is left alone after a few tries (a looser floor brings it back)."""
    gain = {(2, 1): 0.8, (4, 3): 2.0, (8, 7): 2.4}
    clock = FakeClock(lambda T, d: 0.010 + 0.004 * T)  # compute-bound: (8, 7) costs ~2x (4, 3) per step
    ctl = BudgetController([(1, 0), (2, 1), (4, 3), (8, 7)], explore_every=4, clock=clock)
    clock.ctl = ctl
    owner = object()

    def run(steps):
        for _ in range(steps):
            T, d = ctl.start(owner, 1)
            ctl.offer([gain.get(a, math.nan) if a[1] <= d else math.nan for a in ctl.arms], ctl.arms)
            ctl.observe_accepted(gain.get((T, d), 0.0))
        return ctl.history[-steps:]

    steps = run(200)
    assert mode(steps[20:]) == (4, 3)
    # (8, 7): (1 + 2.4) / 0.042 is 0.7x the best's (1 + 2.0) / 0.026, below the floor: a few plays, then no more
    assert 1 <= steps.count((8, 7)) <= ctl.explore_known + 2 and (8, 7) not in steps[100:]
    # (2, 1) could make at most 2 tokens / 0.018 s, below the best's 3 / 0.026 s: not worth even a look
    assert (2, 1) not in steps[100:]
    ctl.explore_floor = 0.5
    assert (8, 7) in run(40)


def test_a_wide_batch_explores_less_often():
    """Exploration comes every explore_every steps up to 2 * explore_rows - 1 rows, then every explore_every *
    (rows // explore_rows): at 16 rows a detour to a bigger tree costs twice a step of the best arm."""
    gain = {(2, 1): 0.9, (4, 3): 2.0, (6, 5): 2.4}

    def detours(rows: int) -> list[int]:
        clock = FakeClock(lambda T, d: 0.010 + 0.001 * T)
        ctl = BudgetController([(1, 0), (2, 1), (4, 3), (6, 5)], explore_every=4, clock=clock, probe=False)
        clock.ctl = ctl
        ctl.explore_floor, ctl.explore_known = 0.0, 1e9  # every neighbour stays worth a try: only the interval counts
        owner = object()
        for _ in range(400):
            T, d = ctl.start(owner, rows)
            ctl.offer([gain.get(a, math.nan) if a[1] <= d else math.nan for a in ctl.arms], ctl.arms)
            ctl.observe_accepted(gain.get((T, d), 0.0))
        best = mode(ctl.history[-100:])
        return [i + 1 for i, a in enumerate(ctl.history) if i >= 80 and a != best]  # steps count from 1

    by_rows = {rows: detours(rows) for rows in (1, 7, 8, 16)}
    for rows, every in ((1, 4), (7, 4), (8, 8), (16, 16)):
        assert by_rows[rows] and all(step % every == 0 for step in by_rows[rows]), rows
    assert len(by_rows[1]) == len(by_rows[7]) >= 1.5 * len(by_rows[8]) >= 2.25 * len(by_rows[16])


def test_exploration_never_plays_an_arm_that_cannot_win_even_accepting_every_draft():
    """A tree whose step costs more than its depth can repay (here (40, 5): at most 6 tokens in 0.2 s, against the
    chain's 3 in 0.02 s) is never explored once the step-time fit predicts it, even with no record of its own; a
    neighbour that could win is still tried."""
    gain = {(2, 1): 0.9, (4, 3): 2.0, (6, 5): 2.5, (40, 5): 4.9}
    clock = FakeClock(lambda T, d: 0.012 + 0.002 * d + 0.0045 * max(T - 6, 0))
    ctl = BudgetController([(1, 0), (2, 1), (4, 3), (6, 5), (16, 5), (40, 5)], explore_every=2, clock=clock,
                           probe=False)
    clock.ctl = ctl
    ctl.times.observe(1, 16, 5, 0.012 + 0.010 + 0.0045 * 10)  # (16, 5) measured once: the fit knows the T slope
    owner = object()
    for _ in range(300):
        T, d = ctl.start(owner, 1)
        ctl.offer([gain.get(a, math.nan) if a[1] <= d else math.nan for a in ctl.arms], ctl.arms)
        ctl.observe_accepted(gain.get((T, d), 0.0))
    steps = ctl.history
    assert ctl.rate_bound(1, 40, 5) < ctl.rate(1, 4, 3) < ctl.rate_bound(1, 6, 5)
    assert (40, 5) not in steps and (6, 5) in steps[20:]
    assert not ctl._worth_a_try(1, (40, 5), ctl.best(1)) and ctl._worth_a_try(1, (6, 5), (4, 3))


def test_a_chain_arm_scores_and_offers_every_estimate_every_steps_and_drafts_the_same_chain():
    """Scoring is ~30 % of a chain's draft ops, so a chain arm offers estimates every estimate_every steps only (and
    while it has none); the steps in between draft the very same chain unscored and are judged by the arm's
    smoothed estimate, so its accepted record keeps growing every step."""
    pol = DynamicPolicy("auto", depth=5, top_k=4)
    ctl = pol.budget
    ctl.choose = lambda rows: (6, 5)
    d = primed_drafter(3)
    scored, trees = [], []
    with torch.inference_mode():
        for _ in range(12):
            tree = pol.draft(d)
            scored.append(ctl._pending is not None)
            trees.append(tree.tokens)
            ctl.observe_accepted(2.0)
    # (in the phase opposite the exploring steps': an explored arm's steps must not all pay the scoring)
    assert scored == [True] + [s % ctl.estimate_every == ctl.estimate_every // 2 for s in range(2, 13)]
    assert all(torch.equal(t, trees[0]) for t in trees)  # same drafter state: the same chain, scored or not
    assert ctl._seen_arm[6, 5][2] == pytest.approx(sum(0.95 ** i for i in range(12)))  # every step recorded


def test_the_arm_held_keeps_its_place_unless_the_leader_is_clearly_faster():
    """Between arms expected within hold_margin of each other the estimates are noise: the budget keeps the arm it
    holds instead of flipping with them; a leader clearly ahead still takes over (per row bucket)."""
    ctl = BudgetController([(2, 1), (4, 3), (8, 7)], explore_every=0, probe=False)
    rates = {(2, 1): 1.0, (4, 3): 3.0, (8, 7): 2.0}
    ctl.rate = lambda rows, T, d: rates[T, d]  # the expected tokens/s the choice compares
    assert ctl.choose(1) == (4, 3)
    rates[8, 7] = 3.05  # 1.7 % ahead: within the margin, (4, 3) is held
    assert [ctl.choose(1) for _ in range(5)] == [(4, 3)] * 5
    assert ctl.choose(16) == (8, 7)  # another row bucket holds its own arm: there the leader is taken
    rates[8, 7] = 3.3  # 10 % ahead: it takes over, and is held in turn
    assert ctl.choose(1) == (8, 7)
    rates[4, 3] = 3.35
    assert ctl.choose(1) == (8, 7)
    ctl.hold_margin = 0.0
    assert ctl.choose(1) == (4, 3)


def test_step_time_model_charges_a_wide_pool_for_its_draft_inputs_at_batch():
    """The fit's draft term is rows * inputs (an arm's draft-head inputs per row), so a 2-wide pool at batch 16 is
    predicted dearer than a chain of the same depth, although neither was measured there."""
    inputs = {(6, 5): 5, (16, 5): 9, (8, 3): 5, (4, 3): 3}
    cost = lambda r, T, d: 0.003 + 0.00005 * r * T + 0.0004 * d + 0.00006 * r * inputs[T, d]  # noqa: E731
    m = StepTimeModel(inputs=inputs)
    for r, T, d in ((1, 6, 5), (1, 16, 5), (4, 8, 3), (4, 4, 3), (2, 16, 5), (8, 6, 5), (1, 4, 3)):
        m.observe(r, T, d, cost(r, T, d))
    for r, T, d in ((16, 6, 5), (16, 16, 5), (16, 8, 3)):
        assert m.predict(r, T, d) == pytest.approx(cost(r, T, d), rel=1e-6)
    plain = StepTimeModel()  # without the pools' widths the same data cannot be fitted exactly
    for r, T, d in ((1, 6, 5), (1, 16, 5), (4, 8, 3), (4, 4, 3), (2, 16, 5), (8, 6, 5), (1, 4, 3)):
        plain.observe(r, T, d, cost(r, T, d))
    assert plain.predict(16, 16, 5) != pytest.approx(cost(16, 16, 5), rel=1e-3)


def test_top_run_counts_the_leading_top1_drafts_of_each_accepted_path():
    from treedec.decoding.verify import Acceptance, top_run
    from treedec.tree.tree import Tree

    # root 0; 1 (rank 0) and 2 (rank 1) under it; 3 (rank 0) under 1; 4 (rank 0) under 3; 5 (rank 1) under 3
    tree = Tree.from_parents([-1, 0, 0, 1, 3, 3], rank=[0, 0, 1, 0, 0, 1])
    path = torch.tensor([[0, 1, 3, 4], [0, 2, 0, 0], [0, 1, 3, 0], [0, 1, 3, 5], [0, 0, 0, 0]])
    n = torch.tensor([4, 2, 2, 4, 0])  # accepted nodes, root included (0: a finished row)
    acc = Acceptance(path, n, n, path, torch.zeros(5, 6, dtype=torch.bool))
    assert top_run(tree, acc, n).tolist() == [3, 0, 1, 2, 0]


def test_every_step_records_what_each_chain_shorter_than_its_tree_would_have_accepted():
    arms = [(1, 0), (2, 1), (4, 3), (6, 5), (8, 7), (16, 5)]
    family = {(2, 1): 1, (4, 3): 1, (6, 5): 1, (8, 7): 1, (16, 5): 2}
    ctl = BudgetController(arms, explore_every=0, probe=False, family=family)
    ctl.gain = {a: 1.0 for a in arms[1:]}
    ctl.stretch = 0.0  # one play a step (the weighting of long runs: the test below)
    ctl.last = (16, 5)  # a 5-deep tree was played
    ctl.observe_chains([5, 2, 0])
    seen = ctl._seen_arm
    assert seen[2, 1][0] == pytest.approx(2 / 3) and seen[4, 3][0] == pytest.approx(5 / 3)
    assert seen[6, 5][0] == pytest.approx(7 / 3) and all(seen[a][2] == 1 for a in [(2, 1), (4, 3), (6, 5)])
    assert (8, 7) not in seen and (16, 5) not in seen  # deeper than the tree: censored; not a chain
    ctl.last = (6, 5)  # the chain played is recorded by observe_accepted, not twice
    ctl.observe_chains([1])
    assert seen[6, 5][2] == 1 and seen[4, 3][2] == pytest.approx(1.95)
    ctl.last = (1, 0)  # a plain step drafted nothing
    ctl.observe_chains([3])
    assert seen[4, 3][2] == pytest.approx(1.95)


@pytest.mark.parametrize("stretch", [0.0, 0.5, 1.0])
def test_a_shallower_chain_gets_the_steps_it_would_take_over_a_long_run(stretch):
    """Where a deeper chain's step ran through all d drafts of a shallower chain, the shallower one would have needed
    (r + 1) / (d + 1) steps over that text: counting one made it look worse than it is played (4 % at batch 1 and 16
    on the bundled pair). Such a row counts 1 + stretch * ((r + 1) / (d + 1) - 1) plays; shorter runs count one."""
    arms = [(1, 0), (2, 1), (4, 3), (10, 9)]
    ctl = BudgetController(arms, explore_every=0, probe=False, family={a: 1 for a in arms[1:]})
    ctl.gain = {a: 1.0 for a in arms[1:]}
    ctl.stretch, ctl.last = stretch, (10, 9)
    ctl.observe_chains([9, 1])  # row 0 ran through all 9 drafts (10 tokens), row 1 stopped after one
    acc, est, plays = ctl._seen_arm[4, 3]
    w0 = 1 + stretch * (10 / 4 - 1)  # the 3-deep chain: 2.5 steps over row 0's 10 tokens
    assert plays == pytest.approx((w0 + 1) / 2) and acc / plays == pytest.approx((3 * w0 + 1) / (w0 + 1))
    assert est / plays == pytest.approx(1.0)  # the estimate is weighted alike: the correction factor is unbiased
    if stretch == 1.0:  # the whole covered text: 10 + 2 tokens over 2.5 + 1 steps of the 3-deep chain
        assert 1 + acc / plays == pytest.approx(12 / 3.5)
    acc, _, plays = ctl._seen_arm[2, 1]  # the 1-deep chain: both rows got through it
    w = [1 + stretch * (10 / 2 - 1), 1 + stretch * (2 / 2 - 1)]
    assert plays == pytest.approx(sum(w) / 2) and acc / plays == pytest.approx(1.0)


def test_the_auto_policy_gets_each_rows_top_run_in_the_steps_one_read():
    from treedec.decoding.speculative import SpeculativeDecoder

    target, draft = make_pair(31)
    pol = DynamicPolicy("auto", depth=4, top_k=3, explore_every=2)
    seen = []
    prompts = [list(range(3, 12)), list(range(5, 9))]
    out = SpeculativeDecoder(target, draft, pol).generate(prompts, 100, hook=seen.append)
    for b, p in enumerate(prompts):
        assert out.tokens[b] == greedy_reference(target, p, 100)
    checked = 0
    for info in seen:
        if info.tree is None or info.tree.size == 1:
            continue
        assert info.top_run is not None
        rank = info.tree.rank.expand(len(prompts), -1) if info.tree.rank.dim() == 1 else info.tree.rank
        for b, n in enumerate(info.n_accept):
            ranks = rank[b, info.path[b, 1:n]].tolist()
            want = next((i for i, r in enumerate(ranks) if r != 0), len(ranks))
            assert info.top_run[b] == want
            assert want <= info.top_span[b] <= info.tree.depth.max()  # read in the same transfer; a run never passes it
            checked += 1
    assert checked > 10
    assert not DynamicPolicy(16, depth=4, top_k=3).wants_top_run  # fixed budgets do not ask for it


def test_an_arm_never_played_borrows_its_pool_familys_correction():
    """Chains accept ~2x what calibration says on the bundled pair, 2-wide pools ~1.2x: an unplayed chain takes the
    chains' factor (shrunk towards the batch-wide one by family_prior plays), not the pools'."""
    arms = [(1, 0), (2, 1), (4, 3), (6, 5), (16, 5), (24, 5)]
    family = {(2, 1): 1, (4, 3): 1, (6, 5): 1, (16, 5): 2, (24, 5): 2}
    ctl = BudgetController(arms, explore_every=0, probe=False, family=family)
    for arm, acc, est in [((4, 3), 2.0, 1.0), ((16, 5), 3.6, 3.0)] * 10:  # the chain 2x, the pool 1.2x its estimate
        ctl._pending, ctl.last = ([est if a == arm else math.nan for a in arms], arms, None), arm
        ctl.observe_accepted(acc)
    c = ctl.correction
    assert 1.2 < c < 2.0  # the batch-wide factor mixes both
    chain, pool = ctl.correction_of((6, 5)), ctl.correction_of((24, 5))  # never played
    assert c < chain < 2.0 and 1.2 < pool < c  # each near its own family, pulled a little towards the batch
    assert ctl.correction_of((6, 5)) == ctl._family_factor[1]
    lone = BudgetController(arms, explore_every=0, probe=False, family=family)
    for arm, acc, est in [((16, 5), 3.6, 3.0)] * 10 + [((2, 1), 0.0, 1.0)]:  # then one unlucky play of a chain
        lone._pending, lone.last = ([est if a == arm else math.nan for a in arms], arms, None), arm
        lone.observe_accepted(acc)
    assert lone._family_factor[1] > 0.7 * lone.correction > 0.5  # not sunk to the floor by one play


def test_a_rescaled_estimate_never_passes_what_the_arm_can_accept():
    """A correction learnt where calibration is far too low (chains accepting 4x their estimate) must not lift an
    unplayed arm's estimate above its depth and nodes: at batch 16 a 16-node, 6-deep tree estimated at 6.6 accepted
    drafts per row outranked the 7-deep chain it could not beat, and its 60 ms steps cost ~20 %."""
    arms = [(1, 0), (2, 1), (4, 3), (8, 7), (16, 6)]
    ctl = BudgetController(arms, explore_every=0, probe=False)
    for _ in range(20):  # the 7-deep chain accepts 4x what it was estimated at
        ctl._pending, ctl.last = ([math.nan, 0.5, 0.8, 1.0, 2.0], arms, None), (8, 7)
        ctl.observe_accepted(4.0)
        ctl._absorb()
    assert ctl.correction_of((16, 6)) > 3  # the batch-wide factor carried over to the unplayed tree
    assert ctl.accepted((16, 6)) == pytest.approx(6.0)  # capped at its depth (and at T - 1 = 15 nodes)
    assert ctl.accepted((4, 3)) <= 3.0 and ctl.accepted((2, 1)) <= 1.0
    assert ctl.accepted((8, 7)) == pytest.approx(4.0, rel=0.05)  # the arm played is judged by its record


def test_top_span_is_how_deep_each_tree_holds_its_top1_chain():
    from treedec.decoding.verify import top_span
    from treedec.tree.tree import Tree

    # root 0; 1 (rank 0) and 2 (rank 1) under it; 3 (rank 1) under 1; 4 (rank 0) under 2: the top-1 chain stops at 1
    bushy = Tree.from_parents([-1, 0, 0, 1, 2], rank=[0, 0, 1, 1, 0])
    chain = Tree.from_parents([-1, 0, 1, 2, 3])
    assert top_span(bushy.with_tokens(torch.zeros(2, 5, dtype=torch.long))).tolist() == [1, 1]
    assert top_span(chain.with_tokens(torch.zeros(1, 5, dtype=torch.long))).tolist() == [4]


def test_a_chain_record_from_a_tree_that_cut_the_top1_chain_short_is_not_censored_there():
    """A bushy 7-deep tree often holds the top-1 chain only a few levels deep; a run that reached that span says
    nothing about the levels below it. Crediting the span alone made the 7-deep chain look ~20 % worse while bushy
    trees were played: the span is extended by the measured top-1 continuation rates instead."""
    arms = [(1, 0), (2, 1), (4, 3), (8, 7), (24, 7)]
    family = {(2, 1): 1, (4, 3): 1, (8, 7): 1, (24, 7): 2}
    ctl = BudgetController(arms, explore_every=0, probe=False, family=family)
    ctl.gain = {a: 1.0 for a in arms[1:]}
    ctl.last = (24, 7)
    for _ in range(30):  # 7-deep chains played: of 10 rows one stops at depth 4, the others accept all 7
        ctl._count_continuations([7] * 9 + [3], [7] * 10)
    assert ctl.continuation(4) == pytest.approx(0.9, abs=0.03) and ctl.continuation(5) > 0.95
    ctl._seen_arm.clear()
    ctl.stretch = 0.0  # one play a row (the weighting of long runs is tested on its own)
    ctl.observe_chains([2, 2, 1], [2, 4, 4])  # row 0 reached its tree's span (2): censored; rows 1, 2 stopped short
    acc87 = ctl._seen_arm[8, 7][0]
    assert acc87 == pytest.approx((2 + ctl._further(2, 7) + 2 + 1) / 3)
    assert ctl._further(2, 7) > 3  # ~0.9 + 0.81 + ... : far more than the 0 the span alone credited
    assert ctl._seen_arm[2, 1][0] == pytest.approx(1.0)  # no deeper than the span: exact, min(run, d)
    assert ctl._seen_arm[4, 3][0] == pytest.approx((2 + ctl._further(2, 3) + 2 + 1) / 3)


def test_a_step_is_timed_from_after_the_choice_so_scoring_is_never_charged_to_an_arm():
    """Choosing scores every arm on some steps only (rescoring, exploring): that time is the budget's, so an
    explored arm, whose steps all pay it, must not look slower than the held one for it."""
    t = [0.0]
    b = BudgetController([(2, 1), (4, 3)], explore_every=2, clock=lambda: t[0])
    choose, costs = b.choose, {(2, 1): 0.006, (4, 3): 0.012}

    def slow_choice(rows):
        t[0] += 0.5  # a (grossly) slow scoring pass
        return choose(rows)

    b.choose = slow_choice
    owner = object()
    for _ in range(12):
        arm = b.start(owner, 1)
        b.offer(torch.tensor([0.5, 1.5]), b.arms)
        t[0] += costs[arm]
    assert set(b.history) == {(2, 1), (4, 3)}
    for arm, cost in costs.items():
        assert b.times.predict(1, *arm) == pytest.approx(cost)


def test_chains_deeper_than_the_pools_are_arms_of_narrow_batches_only():
    """``chain_depth``: chain arms past the bushy pools' depth, scored, explored and played at batches of at most
    narrow_rows rows; the probes never take them; a fixed tree refuses the option, and so does a shallower value."""
    pol = DynamicPolicy("auto", depth=4, top_k=3, chain_depth=7)
    ctl = pol.budget
    deep = {(d + 1, d) for d in (5, 6, 7)}
    assert deep <= set(ctl.arms) and ctl.narrow == deep
    assert all(pol.arm_top_k[a] == 1 for a in deep) and pol.max_depth == 7 and pol.max_inputs >= 7
    assert not deep & set(ctl.probes)
    ctl.rate = lambda rows, T, d: float(d)  # the deeper, the better
    assert ctl._rates(1) and max(ctl._rates(1), key=lambda a: a[1]) == (8, 7) == ctl.best(1)
    assert max(a[1] for a in ctl._rates(16)) == 4 and ctl.best(16)[1] == 4
    assert not ctl._worth_a_try(16, (8, 7), (5, 4))
    with pytest.raises(TreeError, match="chain_depth"):
        DynamicPolicy(16, depth=4, top_k=3, chain_depth=7)
    with pytest.raises(TreeError, match="chain_depth"):
        DynamicPolicy("auto", depth=4, top_k=3, chain_depth=3)
    assert not DynamicPolicy("auto", depth=4, top_k=3).budget.narrow


def test_chains_never_observed_are_estimated_from_the_top1_continuation_rates():
    """A chain deeper than any played is censored in the top-1 runs; its E[accepted] is the sum over depths of the
    product of the measured continuation rates, the deepest measured one standing for the depths past it."""
    ctl = BudgetController([(2, 1), (3, 2), (4, 3), (9, 8)], family={(2, 1): 1, (3, 2): 1, (4, 3): 1, (9, 8): 1})
    assert ctl._chain_estimate(8) is None  # no continuation measured yet
    for _ in range(40):  # 3-deep chains: 9 rows in 10 go on at every depth
        ctl._count_continuations([3] * 9 + [0], [3] * 10)
    p = [ctl.continuation(j) for j in (1, 2, 3)]
    assert p[0] == pytest.approx(0.9, abs=0.02)
    want = sum(math.prod(p[min(i, 2)] for i in range(j)) for j in range(1, 9))
    assert ctl._chain_estimate(8) == pytest.approx(want)
    ctl.gain[(9, 8)] = 0.5  # a (calibrated) estimate far too low: the chain's own model replaces it
    assert ctl.accepted((9, 8)) == pytest.approx(want)


def test_a_deeper_chain_never_counts_less_than_a_shallower_one_plus_its_continuation():
    """A chain deeper than the one played is recorded on its own few plays only, on other text than the shallower
    chains (recorded every step): a record taken on a hard stretch must not sink it below the chain one shallower
    (which it can never accept less than on the same text), and a chain never drafted still gets a value."""
    chains = [(d + 1, d) for d in range(1, 11)]
    ctl = BudgetController(chains, family={a: 1 for a in chains}, probe=False)
    for _ in range(40):  # the 7-deep chain is played: 9 rows in 10 go on at every depth it spans
        ctl._count_continuations([7] * 9 + [0], [7] * 10)
    for a in chains[:9]:  # calibrated estimates of the chains drafted so far (the 10-deep one never was)
        ctl.gain[a] = 0.5 * a[1]
    for _ in range(20):  # the shallower chains' records: what each accepted on the same (easy) steps
        for d in range(1, 8):
            ctl._record((d + 1, d), min(6.0, d), 0.5 * d, 0.95)
    for _ in range(3):  # the 9-deep chain, explored on a hard stretch: 2 drafts accepted
        ctl._record((10, 9), 2.0, 4.5, 0.95)
    step = ctl._chain_estimate(9) - ctl._chain_estimate(8)
    assert ctl._blended((10, 9)) < ctl.accepted((8, 7))  # what its own record alone says
    assert ctl.accepted((10, 9)) >= ctl.accepted((9, 8)) + step - 1e-9 > ctl.accepted((8, 7))
    assert (11, 10) not in ctl.gain and ctl.accepted((11, 10)) == pytest.approx(
        ctl.accepted((10, 9)) + ctl._chain_estimate(10) - ctl._chain_estimate(9))
    ctl._record((8, 7), 6.5, 3.5, 0.95)  # a new record moves every deeper chain's value (the memo is refreshed)
    assert ctl.accepted((11, 10)) > ctl.accepted((8, 7))


def _static_batches(ctl: BudgetController, batches: int, early: int, late: int) -> None:
    """Static batches of a played 7-deep chain: at 16 rows (a batch's start) every row's top-1 run is ``early``
    drafts long, at 2 rows (its end) ``late``: rows accept more as their generation goes on."""
    ctl.last = (8, 7)
    for _ in range(batches):
        for rows, runs, steps in ((16, early, 12), (2, late, 6)):
            ctl._rows = rows
            for _ in range(steps):
                ctl._record((8, 7), float(runs), 3.0, 0.95)
                ctl.observe_chains([runs] * rows, [7] * rows)


def test_records_are_kept_per_row_bucket_so_a_batch_start_is_judged_by_batch_starts():
    """At a static batch's start the records carried from the last batch's end overrated deep chains (one batch of 16,
    a 7-deep chain: 3.3-4.0 drafts a row first, up to 7 in the last steps), so the budget played the 7-deep chain where
    the 4-deep one was 7 % faster. At 16 rows the records of 16-row steps decide; batch-wide ones only fill gaps."""
    chains = [(d + 1, d) for d in range(1, 8)]
    ctl = BudgetController(chains, family={a: 1 for a in chains}, probe=False, explore_every=0)
    ctl.gain = {a: 0.5 * a[1] for a in chains}
    _static_batches(ctl, 4, early=3, late=7)
    start, end, overall = ctl.accepted((8, 7), 16), ctl.accepted((8, 7), 2), ctl.accepted((8, 7))
    assert start < overall < end and start == pytest.approx(3.0, abs=0.3) and end == pytest.approx(7.0, abs=0.6)
    for d in (4, 5, 6):  # a chain's value past the played one's depth: the 16-row continuation rates
        assert ctl._chain_estimate(d, 16) < ctl._chain_estimate(d)
    for rows in (16, 2):  # compute-bound at 16 rows (each depth costs 10 %), launch-bound at 2 (depth nearly free)
        for _ in range(3):
            for a in ((5, 4), (8, 7)):
                ctl.times.observe(rows, *a, 0.010 * (1 + (0.1 if rows == 16 else 0.01) * a[1]))
    assert ctl.rate(16, 5, 4) > 1.1 * ctl.rate(16, 8, 7) and ctl.rate(2, 8, 7) > 1.2 * ctl.rate(2, 5, 4)
    ctl.local_prior = ctl.local_tries = 1e12  # batch-wide records alone: the batch's end sways its start
    ctl._chain_memo = {}
    ctl._version += 1
    assert ctl.rate(16, 8, 7) > ctl.rate(16, 5, 4)


def test_one_row_bucket_keeps_the_batch_wide_records_exactly():
    """A batch of one size all along (batch 1, a continuous batch) sees the same records per bucket as batch-wide."""
    chains = [(d + 1, d) for d in range(1, 8)]
    ctl = BudgetController(chains + [(16, 5)], family={**{a: 1 for a in chains}, (16, 5): 2}, probe=False)
    ctl.gain = {a: 0.5 * a[1] for a in chains + [(16, 5)]}
    ctl._rows = 4
    for i in range(30):
        ctl.last = (8, 7) if i % 3 else (16, 5)
        ctl._last_accepted = 2.5
        ctl._record(ctl.last, float(i % 5), 3.0, 0.95)
        ctl.observe_chains([i % 8, 3, 7, 1], [7, 4, 7, 5] if ctl.last == (8, 7) else [5, 4, 3, 5])
    for a in chains + [(16, 5)]:
        assert ctl.accepted(a, 4) == pytest.approx(ctl.accepted(a), rel=1e-12)
        assert ctl.accepted(a, 3) == pytest.approx(ctl.accepted(a), rel=1e-12)  # row_bucket(3) == 4
