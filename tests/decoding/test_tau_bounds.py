"""τ (tokens per target step) bounds that can fail: τ >= 1 holds by construction (every step emits the
target's own token), so the checks here pin both ends instead.

* an oracle draft (every node on the target's greedy path rewritten to the target's own choice) must be
  accepted whole: τ near depth + 1;
* an untrained head agrees with the target about as often as chance: τ near 1.
"""
import pytest
import torch

from tests.helpers import OraclePolicy, greedy_reference
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.tree.policies import ChainPolicy, StaticPolicy

NEW = 120


def prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in (4, 19)]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("depth", [2, 4])
def test_an_oracle_chain_reaches_depth_plus_one(tiny_target, tiny_head, seed, depth):
    ps = prompts(seed)
    refs = [greedy_reference(tiny_target, p, NEW) for p in ps]
    oracle = OraclePolicy(ChainPolicy(depth=depth), refs, p_hit=1.0, seed=seed)
    out = SpeculativeDecoder(tiny_target, tiny_head, oracle).generate(ps, NEW, stream=oracle.stream)
    assert out.tokens == refs
    # every step accepts the whole chain; only the last one can be cut short by max_new_tokens
    assert depth + 1 - 0.15 * depth < out.stats.tau <= depth + 1


def test_an_oracle_tree_accepts_its_deepest_path(tiny_target, tiny_head):
    ps = prompts(7)
    refs = [greedy_reference(tiny_target, p, NEW) for p in ps]
    policy = StaticPolicy(shape="balanced_2x3")
    oracle = OraclePolicy(policy, refs, p_hit=1.0, seed=7)
    out = SpeculativeDecoder(tiny_target, tiny_head, oracle).generate(ps, NEW, stream=oracle.stream)
    assert out.tokens == refs
    assert policy.max_depth + 1 - 0.5 < out.stats.tau <= policy.max_depth + 1


@pytest.mark.parametrize("seed", range(3))
def test_an_untrained_head_stays_near_one(tiny_target, tiny_head, seed):
    out = SpeculativeDecoder(tiny_target, tiny_head, ChainPolicy(depth=4)).generate(prompts(seed), NEW)
    assert 1.0 <= out.stats.tau < 1.3
