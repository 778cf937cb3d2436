"""The sampling distribution: one definition (target_probs), a sort-free batched draw from it, per-row streams."""
import pytest
import torch

from treedec import sampling
from treedec.sampling import RowStreams, SamplingParams, draw, inverse_cdf, next_token, nucleus, settle, target_probs

from .stats import as_dict, fits, two_sample_fits


@pytest.fixture(params=["blocked", "flat"])
def search(request, monkeypatch):
    """Run a test with the blocked inverse CDF (many rows) and with the plain cumsum (few rows) alike."""
    monkeypatch.setattr(sampling, "BLOCKED_FROM", 0 if request.param == "blocked" else 1 << 62)
    return request.param


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


def batched_draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    """n draws from ``logits`` [V] as one row of n nodes (the decoder's shape) -> tokens, share of settled misses."""
    streams = RowStreams(torch.Generator().manual_seed(seed), 1, "cpu")
    d = draw(logits.expand(1, n, -1), params, streams.rand(n, params.candidates))
    missed = 0.0 if d.miss is None else float(d.miss.float().mean())
    return settle(d, params, streams, [0])[0], missed


TIES = torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0, 0.0, -1.0, -3.0, 0.5, 0.5, 1.5, -2.0])


@pytest.mark.parametrize("name,logits,params", [
    ("plain", None, SamplingParams(1.0, top_p=0.6)),
    ("top_k_and_top_p", None, SamplingParams(0.7, top_k=5, top_p=0.8)),
    ("low_top_p_many_misses", None, SamplingParams(1.0, top_p=0.3)),  # (1 - mass)^2 ~ 0.5: settle does half the work
    ("tiny_top_p", None, SamplingParams(1.3, top_p=1e-4)),  # the nucleus is the argmax alone
    ("ties_cut_by_top_p", TIES, SamplingParams(1.0, top_p=0.35)),  # the threshold falls inside a run of equal logits
    ("ties_tiny_top_p", TIES, SamplingParams(0.5, top_p=1e-6)),  # tied maxima: all three stay
    ("ties_top_k_inside_a_run", TIES, SamplingParams(1.0, top_k=4, top_p=0.9)),
    ("no_top_p", None, SamplingParams(0.9, top_k=6)),
])
def test_sort_free_draws_follow_target_probs_exactly(name, logits, params, search):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, generator=g) * 1.5 if logits is None else logits
    want = target_probs(logits, params)
    got, missed = batched_draws(logits, params, 100_000)
    assert fits(got.tolist(), as_dict(want))
    assert bool((want[got] > 0).all())  # never a token outside top-k / the nucleus
    if name == "low_top_p_many_misses":
        assert missed > 0.1  # the exact settle path really ran


def test_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0, 0.0]])  # zero weight first, between and last
    u = torch.tensor([[0.0, 0.2, 0.5, 0.81, 1 - 2 ** -24, 1.0]])  # 1.0: a generator that returned its upper bound
    assert inverse_cdf(probs, u).tolist() == [[3, 3, 3, 1, 1, 1]]


def test_row_streams_are_independent_of_the_batch():
    """Row b's stream depends on the caller's generator state and b only; rows never share numbers."""
    one = RowStreams(torch.Generator().manual_seed(5), 1, "cpu")
    four = RowStreams(torch.Generator().manual_seed(5), 4, "cpu")
    a, b = one.rand(3, 2), four.rand(3, 2)
    assert torch.equal(a[0], b[0])
    assert len({tuple(r.flatten().tolist()) for r in b}) == 4
    four.row(2, 7)  # a row that draws more (a settled miss) shifts no other row
    one.row(0, 0)
    assert torch.equal(one.rand(5)[0], four.rand(5)[0])
    g = torch.Generator().manual_seed(5)
    first, second = RowStreams(g, 1, "cpu").rand(4), RowStreams(g, 1, "cpu").rand(4)
    assert not torch.equal(first, second)  # a generator used twice gives new streams


def test_greedy_needs_no_stream():
    logits = torch.randn(3, 9)
    assert torch.equal(next_token(logits, SamplingParams()), logits.argmax(-1))


def draw_before_issue_16(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """The draw as it was (softmax, a full cumsum, the first CDF entry above u * total, candidates
    tested in turn), missed rows drawn from the sorted nucleus: the reference the new draw must equal."""
    probs = target_probs(logits, SamplingParams(params.temperature, params.top_k))  # tempered, top-k'd
    cand = inverse_cdf(probs, u)
    keep = nucleus(probs, params.top_p)
    inside = keep.gather(-1, cand)
    first = inside.to(torch.uint8).argmax(-1, keepdim=True)
    token = cand.gather(-1, first).squeeze(-1)
    exact = inverse_cdf(target_probs(logits, params), torch.rand(u.shape[:-1] + (1,))).squeeze(-1)
    return torch.where(inside.any(-1), token, exact)


COMBOS = [SamplingParams(0.3, top_p=0.9), SamplingParams(0.8, top_p=0.95), SamplingParams(1.5, top_k=5, top_p=0.7),
          SamplingParams(1.0, top_k=3), SamplingParams(0.8, top_p=0.5)]


@pytest.mark.parametrize("V", [37, 150])  # one padded block; three blocks, the last padded
@pytest.mark.parametrize("params", COMBOS, ids=lambda p: f"t{p.temperature}_k{p.top_k}_p{p.top_p}")
def test_new_draw_equals_the_old_in_distribution(params, V, search):
    """Two-sample chi-square of 60k draws each, new (settled) against the pre-issue-16 draw."""
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(V, generator=g) * 2
    torch.manual_seed(0)
    old = draw_before_issue_16(logits.expand(60_000, V), params, torch.rand(60_000, params.candidates))
    new, _ = batched_draws(logits, params, 60_000, seed=1)
    assert two_sample_fits(old.tolist(), new.tolist())
    assert int(new.max()) < V  # the padding past V is never drawn


def test_the_comparison_catches_a_draw_that_ignores_top_p(monkeypatch):
    """Negative control: candidates accepted without the nucleus test fail the same two-sample test."""
    params, V = SamplingParams(0.8, top_p=0.5), 37
    logits = torch.randn(V, generator=torch.Generator().manual_seed(V)) * 2
    torch.manual_seed(0)
    old = draw_before_issue_16(logits.expand(60_000, V), params, torch.rand(60_000, params.candidates))
    new, _ = batched_draws(logits, SamplingParams(0.8), 60_000, seed=1)
    assert not two_sample_fits(old.tolist(), new.tolist())


@pytest.mark.parametrize("shape", [(1, 1), (1, 26), (3, 7)])
def test_draws_are_reproducible_under_a_seed(shape, search):
    """Same seed: the same tokens, whatever was drawn in between (reused buffers); another seed: others."""
    B, T = shape
    logits = torch.randn(B, T, 300, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(0.8, top_p=0.9)

    def run(seed):
        streams = RowStreams(torch.Generator().manual_seed(seed), B, "cpu")
        plain = torch.stack([next_token(logits[:, t], params, streams) for t in range(T)], 1)  # vanilla's steps
        nodes = settle(draw(logits, params, streams.rand(T, 2)), params, streams, range(B))  # a tree's nodes
        return torch.cat([plain, nodes], 1)

    first = run(7)
    draw(torch.randn(5, 40, 999), params, torch.rand(5, 40, 2))  # other shapes through the same buffers
    assert torch.equal(first, run(7))
    assert not torch.equal(first, run(8))
