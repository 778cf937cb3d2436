"""The sampling distribution: one definition (target_probs), and a sort-free sampler that draws from it."""
import pytest
import torch

from treedec.decoding.sampling import SamplingParams, nucleus, sample_target, target_probs


@pytest.mark.parametrize("seed", range(20))
def test_nucleus_is_the_smallest_most_likely_set_reaching_top_p(seed):
    torch.manual_seed(seed)
    probs = (torch.randn(4, 300) * (seed % 4 + 0.5)).softmax(-1)
    for top_p in (0.3, 0.9, 0.99):
        desc, order = probs.sort(-1, descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, (desc.cumsum(-1) - desc) < top_p)
        assert torch.equal(nucleus(probs, top_p), keep)
    ties = torch.tensor([[0.3, 0.3, 0.3, 0.1]])
    assert nucleus(ties, 0.4).tolist() == [[True, True, True, False]]  # ties with the threshold stay together


@pytest.mark.parametrize("params,draws", [(SamplingParams(1.0, top_p=0.6), 4), (SamplingParams(0.7, top_k=5, top_p=0.8), 4),
                                          (SamplingParams(1.0, top_p=0.3), 1)])  # draws=1: many rows take the exact fallback
def test_sort_free_sampler_draws_from_target_probs(params, draws):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, generator=g) * 1.5
    n = 200_000
    got = torch.bincount(sample_target(logits.expand(n, 12), params, g, draws=draws), minlength=12).float() / n
    want = target_probs(logits, params)
    assert torch.allclose(got, want, atol=4e-3)
    assert float(got[want == 0].sum()) == 0.0  # never a token outside top-k / the nucleus
