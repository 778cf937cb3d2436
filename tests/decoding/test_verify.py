"""Acceptance rules on hand-made trees: greedy walks, and the exact emitted distribution when sampling."""
import pytest
import torch

from treedec.decoding.verify import verify_greedy, verify_sampling
from treedec.sampling import SamplingParams, target_probs

from .stats import as_dict, fits

#   0 -> 1 (tok 3), 2 (tok 5);   1 -> 3 (tok 4)
CHILDREN = [[1, 2], [3], [], []]
TOKENS = [9, 3, 5, 4]


def test_greedy_follows_argmax_and_returns_bonus():
    v = verify_greedy(CHILDREN, TOKENS, argmax=[3, 4, 0, 7])
    assert v.path == [0, 1, 3] and v.bonus == 7
    v = verify_greedy(CHILDREN, TOKENS, argmax=[5, 4, 1, 7])
    assert v.path == [0, 2] and v.bonus == 1
    v = verify_greedy(CHILDREN, TOKENS, argmax=[6, 4, 1, 7])
    assert v.path == [0] and v.bonus == 6
    assert v.tried_ranks == [(1, 2, -1)]


def first_token_samples(logits, params, q=None, n=20000, seed=0):
    """The first emitted token over n verifications; with q, the children are drawn i.i.d. from q as the rule assumes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = TOKENS
        if q is not None:
            kids = torch.multinomial(q[0], 2, replacement=True, generator=g).tolist()
            tokens = [TOKENS[0], kids[0], kids[1], int(torch.multinomial(q[1], 1, generator=g))]
        v = verify_sampling(CHILDREN, tokens, logits, params, q, g)
        out.append(tokens[v.path[1]] if len(v.path) > 1 else v.bonus)
    return out


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5, top_p=0.9)])
def test_sequential_rule_emits_exactly_the_target_distribution(params):
    torch.manual_seed(1)
    logits = torch.randn(4, 8) * 1.5
    samples = first_token_samples(logits, params)
    assert fits(samples, as_dict(target_probs(logits[0], params)))


def test_specinfer_rule_with_sampled_drafts():
    torch.manual_seed(2)
    logits = torch.randn(4, 8)
    q = torch.softmax(torch.randn(4, 8), -1)
    assert fits(first_token_samples(logits, SamplingParams(1.0), q), as_dict(target_probs(logits[0], SamplingParams(1.0))))


def test_specinfer_rule_needs_real_draft_samples():
    """The same rule on tokens that were *not* drawn from q is biased: the test can tell."""
    torch.manual_seed(2)
    logits = torch.randn(4, 8)
    q = torch.softmax(torch.randn(4, 8), -1)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(20000):
        v = verify_sampling(CHILDREN, TOKENS, logits, SamplingParams(1.0), q, g)
        out.append(TOKENS[v.path[1]] if len(v.path) > 1 else v.bonus)
    assert not fits(out, as_dict(target_probs(logits[0], SamplingParams(1.0))))


def test_a_wrong_rule_is_caught():
    """Skipping the residual update (Medusa-style 'accept if likely enough') biases towards drafted tokens."""
    torch.manual_seed(1)
    logits = torch.randn(4, 8) * 1.5
    params = SamplingParams(1.0)
    g = torch.Generator().manual_seed(0)
    p = target_probs(logits[0], params)
    out = []
    for _ in range(20000):
        tok = next((TOKENS[c] for c in CHILDREN[0] if float(torch.rand((), generator=g)) < float(p[TOKENS[c]])), None)
        out.append(tok if tok is not None else int(torch.multinomial(p, 1, generator=g)))
    assert not fits(out, as_dict(p))
