"""Invariant 2: at temperature > 0 speculative sampling draws from the target's own distribution.

A tiny-vocabulary target makes the exact joint distribution of the first three tokens cheap to
compute; thousands of batch rows (independent draws) are generated in one call and compared
with a chi-square test at p ~ 1e-4. Tokens 2 and 3 come from tree verification.
"""
import itertools

import pytest
import torch

from treedec.decoding import speculative
from treedec.decoding.sampling import SamplingParams, target_probs
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.decoding.verify import Verdict
from treedec.tree.policies import ChainPolicy, DynamicPolicy, StaticPolicy

from .helpers import make_pair
from .stats import fits

V, N, PROMPT = 5, 3000, [1, 2, 3, 4]
CASES = {
    "dynamic_topk": (lambda: DynamicPolicy(8, 3, 3), SamplingParams(1.0)),
    "static_topk_filtered": (lambda: StaticPolicy(shape="balanced_2x3"), SamplingParams(0.8, top_k=4, top_p=0.95)),
    "chain_sampled_drafts": (lambda: ChainPolicy(3, sample_drafts=True), SamplingParams(1.0)),
    "static_sampled_drafts": (lambda: StaticPolicy(shape="balanced_2x3", sample_drafts=True), SamplingParams(1.2)),
}


@torch.inference_mode()
def exact_joint(target, params, n=3) -> dict:
    """P(x1..xn | prompt) for every sequence, by brute force over the vocabulary."""
    probs = {}
    for seq in itertools.product(range(V), repeat=n):
        p = 1.0
        for i in range(n):
            ids = torch.tensor([PROMPT + list(seq[:i])])
            logits = target(ids, target.new_cache(1, ids.shape[1]), logits="last").logits[0, -1]
            p *= float(target_probs(logits, params)[seq[i]])
        probs[seq] = p
    return probs


def sample_first_three(target, draft, policy, params, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = SpeculativeDecoder(target, draft, policy, params).generate([PROMPT] * N, 3, generator=g)
    return [tuple(t) for t in out.tokens]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_target_distribution(case):
    target, draft = make_pair(7, vocab=V, hidden=32, heads=2, kv_heads=1, peaked=4.0)
    make_policy, params = CASES[case]
    samples = sample_first_three(target, draft, make_policy(), params)
    assert fits(samples, exact_joint(target, params))


@pytest.mark.slow
def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch):
    """A bonus redrawn from the whole of p (not p outside the rejected children) must be detected."""
    real = speculative.accept_paths

    def biased(tree, choice, max_depth):
        acc = real(tree, choice, max_depth)
        fresh = torch.randint(0, V, acc.bonus.shape)  # ignores that the children were already rejected
        acc.bonus.copy_(fresh)
        acc.emit.scatter_(1, (acc.n - 1)[:, None], fresh[:, None])
        return acc

    monkeypatch.setattr(speculative, "accept_paths", biased)
    target, draft = make_pair(7, vocab=V, hidden=32, heads=2, kv_heads=1, peaked=4.0)
    make_policy, params = CASES["dynamic_topk"]
    assert not fits(sample_first_three(target, draft, make_policy(), params), exact_joint(target, params))


@pytest.mark.slow
def test_a_wrong_specinfer_rule_fails_the_same_test(monkeypatch):
    """Sampled drafts: accepting children without the residual update must be detected."""

    def biased(children, tokens, logits, params, draft_probs=None, generator=None):
        node, path = 0, [0]
        while True:
            p = target_probs(logits[node], params)
            nxt = next((c for c in children[node] if float(torch.rand((), generator=generator)) < float(p[tokens[c]])), None)
            if nxt is None:
                return Verdict(path, int(torch.multinomial(p, 1, generator=generator)))
            node = nxt
            path.append(node)

    monkeypatch.setattr(speculative, "verify_sampling", biased)
    target, draft = make_pair(7, vocab=V, hidden=32, heads=2, kv_heads=1, peaked=4.0)
    make_policy, params = CASES["chain_sampled_drafts"]
    assert not fits(sample_first_three(target, draft, make_policy(), params), exact_joint(target, params))
