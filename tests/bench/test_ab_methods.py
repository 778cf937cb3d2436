"""scripts/ab.py: each method spec builds the policy it names (else an A/B compares other trees than it says)."""
import pytest

import treedec.tree.policies as P
from scripts.ab import policy, policy_knobs


def test_auto_takes_its_config_keys():
    assert isinstance(policy("auto", "", P), P.AutoPolicy)
    chains = policy("auto", "", P, knobs={"max_depth": 6, "top_k": 1})
    assert chains.max_depth == 6 and {k for k, _, _ in chains.shapes} == {1}


def test_fixed_methods_and_unknown():
    assert policy("chain", "7", P).max_depth == 7
    pol = policy("dynamic", "16/6/2", P)
    assert (policy("best_first", "24/6", P).total_tokens, policy("best_first", "24/6", P).max_depth) == (24, 6)
    assert (pol.total_tokens, pol.max_depth, pol.top_k) == (16, 6, 2)
    with pytest.raises(SystemExit, match="only auto takes"):
        policy("chain", "7", P, knobs={"depth": 3})
    with pytest.raises(SystemExit, match=r"dynamic:T/D/K, best_first:T/D, auto"):
        policy("bushy", "", P)


def test_policy_knobs_parse_and_bad_ones_are_refused():
    assert policy_knobs("auto") == ("auto", {})
    knobs = policy_knobs("auto{max_depth=8, top_k=2}")
    assert knobs == ("auto", {"max_depth": 8, "top_k": 2}) and isinstance(knobs[1]["top_k"], int)
    with pytest.raises(SystemExit, match="NAME=NUMBER"):
        policy_knobs("auto{top_k=wide}")
