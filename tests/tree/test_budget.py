"""The online tree budget: step-time model, bounds, and a reaction to a synthetic slowdown (injected clock)."""
from __future__ import annotations

import pytest
import torch

from treedec.tree import TreeError
from treedec.tree.budget import BudgetController, StepTimeModel
from treedec.tree.policies import DynamicPolicy

from tests.decoding.test_policies import primed_drafter
from tests.helpers import greedy_reference, make_pair


def test_step_time_model_fits_unmeasured_sizes_with_non_negative_slopes():
    m = StepTimeModel()
    assert m.predict(1, 16, 5) is None
    for T in (8, 32):
        m.observe(1, T, 5, 0.01 + 0.001 * T)
    assert m.predict(1, 64, 5) == pytest.approx(0.01 + 0.064)  # the linear fit a + b*T
    assert m.predict(2, 64, 5) is None  # another row count is another machine load: measured on its own
    m2 = StepTimeModel()
    for T, t in ((8, 0.05), (32, 0.02)):  # noise that makes big trees look cheaper: no negative slope
        m2.observe(1, T, 5, t)
    assert m2.predict(1, 64, 5) >= min(0.05, 0.02)


class FakeClock:
    """Step seconds from a synthetic model of the arm the controller chose for the step that just ended."""

    def __init__(self, cost):
        self.now, self.cost, self.ctl = 0.0, cost, None

    def __call__(self) -> float:
        if self.ctl is not None and self.ctl.last is not None:
            self.now += self.cost(*self.ctl.last)
        return self.now


def drive(ctl: BudgetController, clock: FakeClock, steps: int, gain) -> list:
    owner = object()
    for _ in range(steps):
        T, d = ctl.start(owner, 1)
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


@pytest.mark.parametrize("seed", range(3))
def test_auto_policy_stays_within_bounds_and_is_lossless(seed):
    from treedec.decoding.speculative import SpeculativeDecoder

    target, draft = make_pair(seed + 30)
    pol = DynamicPolicy("auto", depth=5, top_k=4, max_total_tokens=40, explore_every=2)
    assert pol.max_size == 40 and pol.max_depth == 5
    prompt = list(range(3, 12 + seed))
    out = SpeculativeDecoder(target, draft, pol).generate(prompt, 100)
    assert out.tokens[0] == greedy_reference(target, prompt, 100)
    assert {T for T, _ in pol.budget.history} <= {8, 16, 24, 32, 40} and len(set(pol.budget.history)) > 1
    assert {d for _, d in pol.budget.history} <= {3, 4, 5}
    d = primed_drafter(seed)
    with torch.inference_mode():
        tree = pol.draft(d)
    assert tree.size == pol.budget.last[0] and int(tree.depth.max()) <= pol.budget.last[1]


def test_auto_policy_reads_its_injected_clock_and_prefers_small_trees_when_nodes_are_dear():
    from treedec.decoding.speculative import SpeculativeDecoder

    target, draft = make_pair(33)
    clock = FakeClock(lambda T, d: 0.001 * T ** 2)
    pol = DynamicPolicy("auto", depth=4, top_k=4, explore_every=4, clock=clock)
    clock.ctl = pol.budget
    SpeculativeDecoder(target, draft, pol).generate(list(range(5, 15)), 150)
    late = pol.budget.history[-20:]
    assert max(set(late), key=late.count)[0] == 8


def test_auto_budget_validation():
    with pytest.raises(TreeError, match="min_depth"):
        DynamicPolicy("auto", depth=4, top_k=4, min_depth=6)
    with pytest.raises(TreeError, match="total_tokens"):
        DynamicPolicy("many", depth=4, top_k=4)
    assert DynamicPolicy("auto", depth=3, top_k=2, max_total_tokens=64).max_size == 8  # 2 + 2*4 nodes drafted: 8 fits
