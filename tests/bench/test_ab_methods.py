"""scripts/ab.py: each method spec builds the policy it names (else an A/B compares other arms than it says)."""
import pytest

import treedec.tree.policies as P
from scripts.ab import policy


def test_auto_pools_default_and_overridden():
    default, deep, wide = policy("auto", "", P), policy("auto", "8/4", P), policy("auto", "8/4/5", P)
    depths = lambda pol: sorted({d for T, d in pol.budget.arms if T >= 16})  # noqa: E731  (trees, not the small chains)
    assert (default.max_depth, default.top_k) == (7, 4) and depths(default) == [5, 6, 7]  # min_depth: depth - 2
    assert (deep.max_depth, deep.top_k) == (8, 4) and depths(deep) == [6, 7, 8] and (16, 5) not in deep.budget.arms
    assert {(d + 1, d) for d in range(1, 9)} <= set(deep.budget.arms)  # min_depth bounds the bushy arms only
    assert depths(wide) == [5, 6, 7, 8] and {(9, 8), (6, 5)} <= set(wide.budget.arms)
    chains = policy("auto", "7/4/5/10", P)  # and chains to depth 10 (narrow batches only)
    assert chains.max_depth == 10 and chains.budget.narrow == {(9, 8), (10, 9), (11, 10)}
    assert depths(chains) == [5, 6, 7]


def test_fixed_methods_and_arm_and_unknown():
    assert policy("chain", "7", P).max_depth == 7
    pol = policy("dynamic", "16/6/2", P)
    assert (pol.total_tokens, pol.max_depth, pol.top_k) == (16, 6, 2)
    held = policy("arm", "8/7", P)
    assert held.budget.choose(1) == (8, 7) and held.budget.choose(16) == (8, 7)
    with pytest.raises(SystemExit, match="not one of auto's arms"):
        policy("arm", "9/9", P)
    with pytest.raises(SystemExit, match=r"auto:D/K/M/C"):
        policy("bushy", "", P)


def test_budget_knobs_parse_and_bad_ones_are_refused():
    from scripts.ab import budget_knobs

    assert budget_knobs("auto:7/4/5/10") == ("auto:7/4/5/10", {})
    knobs = budget_knobs("auto{local_prior=1e12, hold_margin=0.06,explore_every=16}")
    assert knobs == ("auto", {"local_prior": 1e12, "hold_margin": 0.06, "explore_every": 16})
    assert isinstance(knobs[1]["explore_every"], int)  # a step count stays an int
    with pytest.raises(SystemExit, match="NAME=NUMBER"):
        budget_knobs("auto{hold_margin=wide}")


def test_chain_records_script_weighs_long_runs_as_the_budget_does():
    """scripts/chain_records.py: one play a step is the per-step record, all the covered steps the text's own ratio."""
    from scripts.chain_records import record_tau

    runs = [9, 1]  # a 10-deep chain's rows: one took 9 drafts, one stopped after 1
    assert record_tau(runs, 3, 0.0) == pytest.approx(1 + (3 + 1) / 2)
    assert record_tau(runs, 3, 1.0) == pytest.approx((10 + 2) / (10 / 4 + 1))  # 12 tokens over 3.5 steps
    assert record_tau(runs, 3, 0.0) < record_tau(runs, 3, 0.5) < record_tau(runs, 3, 1.0)
