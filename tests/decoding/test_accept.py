"""Device-side acceptance equals the sequential reference walks, for random trees and choices."""
import pytest
import torch

from treedec.decoding.verify import (
    accept_chain,
    accept_paths,
    acceptance_counts,
    add_chain_counts,
    node_choices,
    verify_greedy,
    verify_sampling,
)
from treedec.sampling import RowStreams, SamplingParams, settle, target_probs
from treedec.tree import Tree
from treedec.tree.policies.base import ancestry

from .stats import two_sample_fits


def random_batch(B: int, T: int, V: int, gen: torch.Generator, distinct: bool = True) -> Tree:
    """B random trees of T nodes (per-row shapes) with distinct sibling tokens (as top-k drafts have)."""
    parents = torch.full((B, T), -1, dtype=torch.long)
    depth = torch.zeros(B, T, dtype=torch.long)
    rank = torch.zeros(B, T, dtype=torch.long)
    tokens = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        used: dict[int, set[int]] = {}
        for i in range(1, T):
            open_ = [q for q in range(i) if len(used.get(q, ())) < V]  # a node has at most V distinct children
            p = open_[int(torch.randint(0, len(open_), (1,), generator=gen))]
            parents[b, i], depth[b, i] = p, depth[b, p] + 1
            rank[b, i] = len(used.setdefault(p, set()))
            while True:
                t = int(torch.randint(0, V, (1,), generator=gen))
                if not distinct or t not in used[p]:
                    break
            used[p].add(t)
            tokens[b, i] = t
        tokens[b, 0] = int(torch.randint(0, V, (1,), generator=gen))
    D = int(depth.max())
    return Tree(parents, depth, rank, tokens, anc=ancestry(parents, D)), D


@pytest.mark.parametrize("seed", range(30))
def test_device_walk_equals_the_sequential_greedy_walk(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, V = 4, int(torch.randint(1, 40, (1,), generator=g)), 3  # a tiny vocabulary: many matches, deep paths
    tree, D = random_batch(B, T, V, g)
    choice = torch.randint(0, V, (B, T), generator=g)
    acc = accept_paths(tree, choice, D)
    counts = acceptance_counts(tree, acc, torch.ones(B, dtype=torch.bool), D + 3)
    want = torch.zeros_like(counts)
    for b in range(B):
        ref = verify_greedy(tree.children(b), tree.tokens[b].tolist(), choice[b].tolist())
        n = int(acc.n[b])
        assert acc.path[b, :n].tolist() == ref.path
        assert int(acc.bonus[b]) == ref.bonus
        assert acc.emit[b, :n].tolist() == tree.tokens[b, ref.path[1:]].tolist() + [ref.bonus]
        assert acc.on_path[b].nonzero().flatten().tolist() == sorted(ref.path)
        ranks = tree.rank[b]
        for depth, n_tried, hit in ref.tried_ranks:
            want[1, depth] += 1
            want[0, depth] += hit >= 0
            kids = tree.children(b)[ref.path[depth - 1]]
            for c in kids[:n_tried]:
                want[3, ranks[c]] += 1
            if hit >= 0:
                want[2, ranks[kids[hit]]] += 1
    assert torch.equal(counts, want)


@pytest.mark.parametrize("seed", range(20))
def test_the_chain_walk_equals_the_general_walk(seed):
    """accept_chain is accept_paths on a chain, field for field (a path cap past the chain's depth included), with a
    tiny vocabulary so that runs of every length occur, and its host-side counts are the general ones."""
    g = torch.Generator().manual_seed(seed)
    B, T, V = 6, int(torch.randint(2, 10, (1,), generator=g)), 2
    cap = T - 1 + int(torch.randint(0, 3, (1,), generator=g))
    idx = torch.arange(T)
    tree = Tree((idx - 1).expand(B, T), idx.expand(B, T), torch.zeros(B, T, dtype=torch.long),
                torch.randint(0, V, (B, T), generator=g), is_chain=True)
    choice = torch.randint(0, V, (B, T), generator=g)
    miss = torch.rand(B, T, generator=g) < 0.2
    want, got = accept_paths(tree, choice, cap, miss), accept_chain(tree, choice, cap, miss)
    for name in ("path", "n", "bonus", "emit", "on_path", "unsettled"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    active = torch.rand(B, generator=g) < 0.8  # finished rows count nothing (their n is 0 in the decoder)
    n = torch.where(active, got.n, 0)
    host = [[0] * (cap + 3) for _ in range(4)]
    add_chain_counts(host, n.tolist(), T - 1)
    assert host == acceptance_counts(tree, want, active, cap + 3).tolist()


def test_finished_rows_count_nothing():
    g = torch.Generator().manual_seed(0)
    tree, D = random_batch(3, 12, 2, g)
    acc = accept_paths(tree, torch.zeros(3, 12, dtype=torch.long), D)
    counts = acceptance_counts(tree, acc, torch.tensor([False, False, False]), D + 2)
    assert int(counts.sum()) == 0


def vectorised(tree: Tree, logits: torch.Tensor, params: SamplingParams, D: int, seed: int, settled: bool = True):
    """The decoder's rule on N rows: one draw per node, the walk, unsettled rows settled exactly and walked again."""
    streams = RowStreams(torch.Generator().manual_seed(seed), tree.tokens.shape[0], "cpu")
    draws = node_choices(logits, params, streams)
    acc = accept_paths(tree, draws.token, D, draws.miss)
    if settled and acc.unsettled is not None and bool(acc.unsettled.any()):
        redo = acc.unsettled.nonzero().flatten().tolist()
        acc = accept_paths(tree, settle(draws, params, streams, redo), D)
    return acc


def star(N: int, kids_tokens: torch.Tensor) -> Tree:
    """N copies of a root with children carrying ``kids_tokens``."""
    k = len(kids_tokens)
    parents = torch.tensor([-1] + [0] * k).expand(N, k + 1)
    tokens = torch.cat([torch.zeros(N, 1, dtype=torch.long), kids_tokens.expand(N, k)], 1)
    return Tree(parents, torch.tensor([0] + [1] * k).expand(N, k + 1), torch.arange(-1, k).clamp(min=0).expand(N, k + 1),
                tokens, anc=ancestry(parents, 1))


@pytest.mark.parametrize("seed", range(3))
def test_one_draw_per_node_has_the_sequential_rules_acceptance_statistics(seed):
    """For distinct (top-k) children, "draw x ~ p, move to the child carrying x" accepts child i with
    probability p(c_i) and emits a bonus distributed as p outside the children, as the sequential rule does."""
    g = torch.Generator().manual_seed(seed)
    V, N = 6, 40000
    logits = torch.randn(V, generator=g) * 2
    params = SamplingParams(0.9, top_p=0.95)
    p = target_probs(logits, params)
    kids_tokens = torch.randperm(V, generator=g)[:3]
    acc = vectorised(star(N, kids_tokens), logits.expand(N, 4, V), params, 1, seed)
    accepted = acc.n == 2
    for i, t in enumerate(kids_tokens.tolist()):
        rate = float(((acc.path[:, 1] == i + 1) & accepted).float().mean())
        assert rate == pytest.approx(float(p[t]), abs=4 * (float(p[t]) / N) ** 0.5 + 1e-3)
    bonus = acc.bonus[~accepted]
    rest = p.clone()
    rest[kids_tokens] = 0
    if rest.sum() > 0:
        rest /= rest.sum()
        freq = torch.bincount(bonus, minlength=V).float() / max(len(bonus), 1)
        assert torch.allclose(freq, rest, atol=0.02)
        assert not bool(torch.isin(bonus, kids_tokens).any())  # the bonus is never a child's token


SEQ_CASES = {  # (seed, tree size, vocabulary, logit scale, params): deep paths, children of several ranks
    "top_p": (0, 16, 4, 1.0, SamplingParams(0.9, top_p=0.9)),
    "top_k_top_p_low": (1, 20, 5, 0.7, SamplingParams(1.3, top_k=4, top_p=0.6)),  # many misses: settled, walked again
    "plain": (2, 12, 4, 1.5, SamplingParams(0.7)),
}


def sampled_outcomes(case: str, rule: str, n: int, wrong: str | None = None) -> list:
    """(accepted length, emitted tokens) of n verifications of one random tree with random per-node logits."""
    seed, T, V, scale, params = SEQ_CASES[case]
    g = torch.Generator().manual_seed(seed)
    tree, D = random_batch(1, T, V, g)
    logits = torch.randn(T, V, generator=g) * scale
    if rule == "sequential":
        kids, toks = tree.children(0), tree.tokens[0].tolist()
        rng = torch.Generator().manual_seed(100 + seed)
        out = []
        for _ in range(n):
            v = verify_sampling(kids, toks, logits, params, generator=rng)
            out.append((len(v.path), tuple(toks[c] for c in v.path[1:]) + (v.bonus,)))
        return out
    rows = Tree(tree.parents.expand(n, T), tree.depth.expand(n, T), tree.rank.expand(n, T), tree.tokens.expand(n, T),
                anc=tree.ancestors()[0])
    acc = vectorised(rows, logits.expand(n, T, V), params, D, 200 + seed, settled=wrong != "no_settle")
    if wrong == "bonus":  # the bonus redrawn from all of p: ignores that the children were already rejected
        last = acc.path.gather(1, (acc.n - 1)[:, None]).squeeze(1)
        acc.emit.scatter_(1, (acc.n - 1)[:, None], torch.multinomial(target_probs(logits, params)[last], 1, generator=g))
    return [(k, tuple(e[:k])) for k, e in zip(acc.n.tolist(), acc.emit.tolist())]


@pytest.mark.parametrize("case", list(SEQ_CASES))
def test_vectorised_rule_matches_the_sequential_rule(case):
    """Same distribution of accepted lengths and of emitted token sequences as the accept/renormalise walk."""
    seq, vec = sampled_outcomes(case, "sequential", 6000), sampled_outcomes(case, "vectorised", 12000)
    assert two_sample_fits([k for k, _ in seq], [k for k, _ in vec])
    assert two_sample_fits([t for _, t in seq], [t for _, t in vec])


@pytest.mark.parametrize("case,wrong", [("top_p", "bonus"), ("top_k_top_p_low", "no_settle")])
def test_a_wrong_vectorised_rule_fails_the_same_comparison(case, wrong):
    """A bonus redrawn from all of p, or missed top-p draws left as their first candidate, must be detected."""
    seq, bad = sampled_outcomes(case, "sequential", 6000), sampled_outcomes(case, "vectorised", 12000, wrong)
    assert not two_sample_fits([t for _, t in seq], [t for _, t in bad])
