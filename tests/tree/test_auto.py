"""tree=auto: the choice rule, the step-cost profile and its cache, and the acceptance correction."""
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from treedec.tree.cost import StepCost, cache_dir
from treedec.tree.policies import AutoPolicy
from treedec.tree.tree import TreeError


class FakeCost:
    """A synthetic step-cost model: seconds per shape from a formula of (rows, width, depth, T)."""

    def __init__(self, policy, fn):
        self.shapes, self.fn, self.seen = policy.shapes, fn, []

    def seconds(self, rows):
        return np.array([self.fn(rows, k, d, t) for k, d, t in self.shapes])

    def profiled(self, rows):
        return self.seconds(rows)

    def observe(self, rows, shape, seconds):
        self.seen.append((rows, shape, seconds))


def started(cost_fn, c=0.8, gain=0.0, **kw) -> AutoPolicy:
    """A policy past its measuring steps: chain continuation ``c`` at every depth; a tree of T nodes and depth D
    reaches each of its depths with ``gain`` * (T - D - 1) more than its chain (each node beyond the chain's adds
    ``gain``)."""
    pol = AutoPolicy(calibration=None, **kw)
    pol.cost, pol._plan = FakeCost(pol, cost_fn), []
    pol.promise[:] = c
    for i in pol._tree:
        _, d, t = pol.shapes[i]
        pol.S[i, :d] = gain * (t - d - 1)
    return pol


def rate(pol, rows):
    return (1 + pol.expected()) / pol.cost.seconds(rows)


def test_the_rule_picks_the_most_tokens_per_second():
    # memory-bound verify (flat in T), a draft pass per depth: deep chains pay until continuation runs out
    pol = started(lambda rows, k, d, t: 1.0 + 0.1 * d + 0.001 * t, c=0.9, gain=0.02)
    i = pol.choose(1)
    assert i == int(np.argmax(rate(pol, 1)))
    assert pol.shapes[i][0] == 4  # 2 % more a node for a per mille of verify each: a wide tree
    assert pol.shapes[i][1] >= 5


def test_it_shrinks_to_a_chain_then_to_plain_decoding_when_verify_is_compute_bound():
    verify = lambda rows, t: 1.0 + 0.02 * rows * t  # noqa: E731  (cost grows with the tokens verified)
    pol = started(lambda rows, k, d, t: verify(rows, t) + 0.05 * d * (1 + k * rows / 64), c=0.7, gain=0.05)
    small, large, huge = (pol.shapes[pol.choose(b)] for b in (1, 16, 400))
    assert small[0] == 4 and small[2] > small[1] + 1  # one row: a bushy tree
    assert large[0] == 1 and large[2] == large[1] + 1  # 16 rows: a chain
    assert huge == (1, 0, 1)  # 400 rows: the root alone
    assert huge[1] < large[1] <= small[1]


def test_chains_only_with_top_k_one_and_bad_settings_are_refused():
    pol = AutoPolicy(max_depth=6, top_k=1, calibration=None)
    assert {k for k, _, _ in pol.shapes} == {1} and pol.max_size == 7 and pol._plan == [6]
    for bad in ({"max_depth": 2.5}, {"top_k": "3"}, {"max_total_tokens": 1}, {"max_depth": 0}):
        with pytest.raises(TreeError, match="whole number"):
            AutoPolicy(calibration=None, **bad)


def test_the_first_steps_count_the_deepest_chain_on_four_rows_then_draft_the_deepest_pool():
    pol = AutoPolicy(max_depth=5, top_k=3, calibration=None)
    pol.cost = FakeCost(pol, lambda *a: 1.0)
    chain = pol.shapes.index((1, 5, 6))
    for _ in range(2):  # two rows a step: two steps
        assert pol.choose(2) == chain
        pol._pending = (chain, torch.full((5,), 0.5))
        pol.observe(info([3, 6]))
    assert pol.shapes[pol.choose(2)][:2] == (3, 5)


def info(n_accept):
    return SimpleNamespace(active=[True] * len(n_accept), n_accept=n_accept)


def test_the_chain_estimate_converges_on_a_biased_calibration():
    """The scores promise a continuation of 0.5 a depth; every row accepts all 3 drafts: within a few dozen steps
    the continuation is near 1 at the depths counted, and the 3-deep chain's estimate near the 3 drafts it gets."""
    pol = started(lambda *a: 1.0)
    chain = pol.shapes.index((1, 3, 4))
    for step in range(40):
        pol._pending = (chain, torch.tensor([0.5, 0.25, 0.125]))
        pol.observe(info([4, 4]))
        if step == 0:  # 2 prior rows at the pooled count (itself 2 rows at 0.5 and 6 at 1: 0.875), 2 observed at 1
            assert pol.continuation[:3] == pytest.approx([0.9375] * 3)
    assert pol.continuation[:3] == pytest.approx([1, 1, 1], abs=0.03)
    assert pol.continuation[3:] == pytest.approx(pol.continuation[3])  # never counted: the count over all depths
    assert pol.expected()[chain] == pytest.approx(3, abs=0.1)


def test_rows_that_stop_early_lower_the_continuation_only_where_they_stop():
    pol = started(lambda *a: 1.0, c=0.5)
    chain = pol.shapes.index((1, 4, 5))
    pol._pending = (chain, torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    pol.observe(info([3, 5, 1]))  # accepted 2, 4 and 0 drafts
    hits, trials = np.array([2, 2, 1, 1]), np.array([3, 2, 2, 1])
    pooled = (2 * 0.5 + hits.sum()) / (2 + trials.sum())
    assert pol.continuation[:4] == pytest.approx((2 * pooled + hits) / (2 + trials))


def test_a_long_stretch_of_plain_steps_fades_back_to_the_count_over_all_depths():
    pol = started(lambda rows, k, d, t: 1.0 if d == 0 else 1e9, c=0.5)  # drafting never pays: plain steps
    chain = pol.shapes.index((1, 2, 3))
    pol._pending = (chain, torch.tensor([0.5, 0.25]))
    pol.observe(info([3] * 8 + [1] * 8))  # half the rows accept both drafts, half none
    before = pol.continuation.copy()
    drafter = type("D", (), {"batch": 1, "root_tokens": torch.zeros(1, dtype=torch.long)})()
    for _ in range(200):
        assert pol.draft(drafter).size == 1
    pooled = (2 * 0.5 + 16) / (2 + 24)
    assert before[0] == pytest.approx((2 * pooled + 8) / (2 + 16)) and pol.continuation[:2] == pytest.approx(
        [pooled, pooled], abs=0.01)


def test_tree_reach_and_gamma():
    pol = AutoPolicy(max_depth=3, top_k=2, calibration=None)
    pol.cost = FakeCost(pol, lambda *a: 1.0)
    chain = pol.shapes.index((1, 3, 4))
    pol._pending = (chain, torch.tensor([0.8, 0.4, 0.1]))
    pol.observe(info([1]))
    assert pol.promise[:3] == pytest.approx([0.8, 0.5, 0.25])  # the first measurement replaces the prior
    tree = pol.shapes.index((2, 3, 4))
    mass = torch.zeros(2, 10, 3)  # [depth limits 2..3, T - 1, depth]: the best T - 1 nodes' reach per depth
    mass[1, 2] = torch.tensor([1.0, 0.5, 0.05])  # two children of the root, one grandchild
    pol._pending = (tree, mass)
    reach = np.cumprod(pol.continuation)[:3]
    pol.observe(info([3]))  # two drafts accepted
    assert pol.S[tree] == pytest.approx([0.2, 0.1, 0.0]) and not pol.S[chain].any()
    assert pol.gamma == pytest.approx((0.9 + 2 - reach.sum()) / (0.9 + 0.3))
    assert pol.reach()[tree] == pytest.approx(np.minimum(1, np.cumprod(pol.continuation)[:3] + pol.gamma * pol.S[tree]))


def test_every_candidate_drafts_a_valid_tree_of_its_own_size_and_depth():
    from tests.decoding.test_policies import primed_drafter

    pol = AutoPolicy(max_depth=4, top_k=3, max_total_tokens=16, calibration=None)
    pol.cost = FakeCost(pol, lambda *a: 1.0)
    drafter = primed_drafter()
    for i, (k, d, t) in enumerate(pol.shapes):
        pol.choose = lambda rows, i=i: i
        with torch.inference_mode():
            tree = pol.draft(drafter)
        assert tree.size == t and (tree.parents[:, 1:] >= 0).all()
        assert int(tree.depth.max()) == d if k == 1 else int(tree.depth.max()) <= d  # a tree keeps its best nodes
        pol.observe(info([1, 1]))


# ------------------------------------------------------------------------------------ the step-cost profile
def entry(scale=1.0):
    return {"verify": {1: 1.0 * scale, 2: 2.0 * scale, 8: 8.0 * scale}, "draft": {1: {1: 0.1, 4: 0.4}}}


SHAPES = [(1, 0, 1), (1, 1, 2), (1, 4, 5)]


def test_profile_round_trip_interpolates_and_refines(tmp_path):
    calls = []
    cost = StepCost(SHAPES, {"device": "x"}, lambda rows: calls.append(rows) or entry(rows), tmp_path)
    assert cost.seconds(1) == pytest.approx([1.0, 2.1, 5.4])  # verify at T=5 between 2 and 8, draft at depth 4
    assert cost.seconds(2) == pytest.approx(np.array([1.0, 2.1, 5.4]) + (np.array([4, 8, 20]) - [1, 2, 5]) / 3)
    assert calls == [1, 4] and cost.path.is_file()  # rows 2: between the measured 1 and 4
    again = StepCost(SHAPES, {"device": "x"}, lambda rows: pytest.fail("measured again"), tmp_path)
    assert again.seconds(2) == pytest.approx(cost.seconds(2))  # a later process loads it
    again.observe(1, 2, 10.8)  # 5.4 s over the profile: the cell moves 0.3 of the way, the others by the step's rest
    assert again.seconds(1)[2] == pytest.approx(5.4 + 0.3 * 5.4)
    assert again.seconds(1)[0] == pytest.approx(1.0 + 0.3 * 5.4)


def test_a_corrupt_or_stale_profile_is_measured_again_with_a_warning(tmp_path, caplog):
    measured = []
    make = lambda key: StepCost(SHAPES, key, lambda rows: measured.append(rows) or entry(), tmp_path)  # noqa: E731
    make({"device": "x", "threads": 2}).seconds(1)
    path = next(tmp_path.glob("step-cost-*.json"))
    with caplog.at_level(logging.WARNING):
        stale = make({"device": "x", "threads": 4})  # same file (threads are not in its name), another setup
        assert stale.seconds(1) == pytest.approx([1.0, 2.1, 5.4])
    assert "measured for another setup (threads)" in caplog.text and measured == [1, 1]
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        make({"device": "x", "threads": 4}).seconds(1)
    assert "not a readable step-cost profile" in caplog.text and measured == [1, 1, 1]
    assert json.loads(path.read_text())["key"]["threads"] == 4  # rewritten whole


def test_the_cache_folder_follows_the_key_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEDEC_CACHE", str(tmp_path / "a"))
    assert cache_dir() == tmp_path / "a" and cache_dir(tmp_path / "b") == tmp_path / "b"
    monkeypatch.delenv("TREEDEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "treedec"


def test_an_unwritable_cache_never_fails_a_run(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")  # the cache folder cannot be made under it
    with caplog.at_level(logging.WARNING):
        assert StepCost(SHAPES, {"device": "x"}, lambda rows: entry(), blocked / "cache").seconds(1)[0] == 1.0
    assert "could not keep the step-cost profile" in caplog.text


def test_a_wide_batch_is_profiled_at_64_rows_and_extended_linearly(tmp_path):
    calls = []
    cost = StepCost(SHAPES, {"device": "x"}, lambda rows: calls.append(rows) or entry(rows), tmp_path)
    at16, at64 = np.array([16.0, 32.1, 80.4]), np.array([64.0, 128.1, 320.4])  # entry(rows) scales verify by rows
    assert cost.seconds(112) == pytest.approx(at64 + (at64 - at16))  # 112 rows: as far past 64 as 64 is past 16
    assert sorted(calls) == [16, 64]
