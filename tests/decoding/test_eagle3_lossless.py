"""The speculative loop with an EAGLE-3 head fed the right features (its lossless greedy output under every policy:
the matrix in test_lossless_greedy.py).

A random head drafts badly, so the oracle wrapper forces long accepted paths: the catch-up then
appends many verified positions with their fused layer inputs, which the last test recomputes.
"""
import pytest
import torch

from tests.helpers import OraclePolicy, eagle3_pair, greedy_reference
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.sampling import SamplingParams
from treedec.tree.policies import ChainPolicy, DynamicPolicy, LearnedPolicy, StaticPolicy
from treedec.tree.policies.learned import save_learned
from treedec.tree.sequoia import solve

from .test_lossless_sampling import V, per_position, sample, target_law


def learned(tmp_path):
    table = solve([0.6, 0.25, 0.1], 16, 5)
    trees = {n: table.choices(n, 5) for n in range(2, 17)}
    return LearnedPolicy(str(save_learned(tmp_path / "t.yaml", trees[12], {"name": "t12", "budget": 12}, trees)))


POLICIES = {
    "chain": lambda _: ChainPolicy(depth=4),
    "static_eagle": lambda _: StaticPolicy(shape="eagle_mc_sim_7b_63"),
    "static_balanced": lambda _: StaticPolicy(shape="balanced_2x3"),
    "dynamic": lambda _: DynamicPolicy(total_tokens=20, depth=5, top_k=4),
    "learned": learned,
}


@pytest.mark.parametrize("policy", ["chain", "dynamic", "learned"])
def test_long_accepts_keep_greedy_exact_and_the_draft_reads_the_true_features(policy, tmp_path):
    target, head = eagle3_pair(5)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = greedy_reference(target, prompt, 160)
    oracle = OraclePolicy(POLICIES[policy](tmp_path), [ref], p_hit=0.9, seed=1)
    dec = SpeculativeDecoder(target, head, oracle)
    out = dec.generate(prompt, 120, stream=oracle.stream)
    assert out.tokens[0] == ref[:120] and out.stats.tau > 1.8
    assert_draft_read_true_features(dec, target, head, prompt + ref)


def assert_draft_read_true_features(dec: SpeculativeDecoder, target, head, seq: list[int]) -> None:
    """The draft cache holds n verified positions: its root logits are what a cache-free pass over the
    true sequence, on the target's true layer inputs, gives at position n-1."""
    n = dec.drafter.cache.host_lengths[0]
    ids = torch.tensor([seq])[:, : n + 1]
    with torch.no_grad():
        feats = head.features(target.forward_train(ids, layer_inputs=head.feature_layers_needed))
        want = head.forward_train(ids[:, 1:], feats[:, :-1])[0][0, n - 1]
    torch.testing.assert_close(dec.drafter.root_logits[0], want, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_compiled_verify_feeds_the_eagle3_head_the_same_features():
    target, head = eagle3_pair(8, hidden=32, heads=2, kv_heads=1)
    prompt = list(range(3, 20))
    ref = greedy_reference(target, prompt, 80)
    oracle = OraclePolicy(StaticPolicy(shape="balanced_2x3"), [ref], p_hit=0.8)
    dec = SpeculativeDecoder(target, head, oracle, compile=True)
    out = dec.generate(prompt, 40, stream=oracle.stream)
    assert out.tokens[0] == ref[:40] and out.stats.tau > 1.5
    assert_draft_read_true_features(dec, target, head, prompt + ref)


@pytest.mark.slow
@pytest.mark.parametrize("sample_drafts", [False, True])
def test_speculative_sampling_with_a_reduced_draft_vocabulary_is_exact(sample_drafts):
    """q is zero outside the head's 3-token vocabulary: SpecInfer and top-k trees still draw from p."""
    target, head = eagle3_pair(7, vocab=V, k=3, hidden=32, heads=2, kv_heads=1, peaked=4.0)
    params = SamplingParams(1.0)
    policy = ChainPolicy(3, sample_drafts=True) if sample_drafts else DynamicPolicy(8, 3, 3)
    results = per_position(sample(target, head, policy, params)[0], target_law(target, params))
    assert all(stat < limit for _, stat, limit in results), results
