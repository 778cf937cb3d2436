"""Sequoia DP vs brute force, the expected-τ formula vs Monte Carlo (and vs the real verifier's stats),
the calibration probe, and LearnedPolicy reading shape files."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from treedec.decoding.loop import DecodeStats
from treedec.decoding.verify import accept_paths, acceptance_counts, verify_greedy
from treedec.tree import Tree, TreeError
from treedec.tree.policies import LearnedPolicy, StaticPolicy
from treedec.tree.policies.learned import load_learned, save_learned
from treedec.tree.sequoia import AcceptanceCounts, child_probs, choose, comb_choices, expected_accepted, solve


def plane_trees(n: int, max_depth: int, max_width: int):
    """Every tree of n nodes (root included) with contiguous child ranks, as choices."""

    def forests(m: int, d: int):
        # ordered lists of subtrees (each: list of relative paths) using m nodes, rooted at depth d
        if m == 0:
            yield []
            return
        if d > max_depth:
            return
        for k in range(1, m + 1):
            for first in subtrees(k, d):
                for rest in forests(m - k, d):
                    if len(rest) + 1 <= max_width:
                        yield [first] + rest

    def subtrees(k: int, d: int):
        for kids in forests(k - 1, d + 1):
            yield kids

    def paths(kids, prefix):
        out = []
        for r, sub in enumerate(kids):
            out.append(prefix + [r])
            out += paths(sub, prefix + [r])
        return out

    for kids in forests(n - 1, 1):
        yield paths(kids, [])


def brute_force(p, n: int, depth: int, width: int) -> float:
    return max((expected_accepted(c, p) if c else 0.0 for c in plane_trees(n, depth, width)), default=-np.inf)


def test_plane_tree_enumeration_counts():
    # Catalan numbers: plane trees with n nodes = C(n - 1), without depth/width limits.
    assert [sum(1 for _ in plane_trees(n, 99, 99)) for n in range(1, 8)] == [1, 1, 2, 5, 14, 42, 132]
    assert sum(1 for _ in plane_trees(5, 1, 99)) == 1  # a star
    assert sum(1 for _ in plane_trees(4, 99, 1)) == 1  # a chain


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    K, D, N = 3, 4, 8
    rates = [rng.uniform(0.05, 0.95, K), rng.uniform(0.05, 0.95, (D, K))]  # by rank; by depth and rank
    for p in rates:
        table = solve(p, N, D, K)
        for depth in range(1, D + 1):
            for n in range(1, N + 1):
                want = brute_force(p, n, depth, K)
                assert table.value[depth, n] == pytest.approx(want, abs=1e-12), (n, depth)
                if not np.isfinite(want):
                    continue
                choices = table.choices(n, depth)
                assert len(choices) == n - 1 and max((len(c) for c in choices), default=0) <= depth
                assert expected_accepted(choices, p) == pytest.approx(want, abs=1e-12)
                Tree.from_choices(choices) if choices else None  # valid tree


def test_dp_width_limit_and_infeasible_budgets():
    table = solve([0.5, 0.3], 10, 2, max_width=2)
    assert np.isfinite(table.value[2, 7]) and not np.isfinite(table.value[2, 8])  # 1 + 2 + 4 = 7 nodes max
    with pytest.raises(ValueError, match="no tree of 8 nodes"):
        table.choices(8, 2)


def test_dp_monotone_and_prefers_rank0_spine():
    table = solve([0.9, 0.05], 16, 8)
    v = table.value[8, 1:]
    assert np.all(np.diff(v) >= -1e-12)
    assert table.choices(5, 8) == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]  # a near-certain top-1: a chain
    assert table.choices(3, 1) == [[0], [1]]  # depth 1: a star of the two measured ranks
    with pytest.raises(ValueError):
        solve([1.2, 0.1], 4, 2)


def simulate(choices, p, trials: int, rng: random.Random) -> float:
    tree = Tree.from_choices(choices)
    kids, depth, rank = tree.children(), tree.depth.tolist(), tree.rank.tolist()
    P = np.asarray(p, dtype=float)
    P = P[None] if P.ndim == 1 else P
    total = 0
    for _ in range(trials):
        node = 0
        while kids[node]:
            for c in sorted(kids[node], key=lambda c: rank[c]):
                row = P[min(depth[c], len(P)) - 1]
                if rng.random() < row[rank[c]]:
                    node = c
                    total += 1
                    break
            else:
                break
    return total / trials


def test_expected_accepted_matches_monte_carlo():
    rng = random.Random(0)
    p_by_depth = [[0.7, 0.4, 0.2], [0.6, 0.3, 0.1], [0.5, 0.2, 0.1]]
    for p in ([0.6, 0.3, 0.15], p_by_depth):
        choices = solve(p, 20, 3).choices(20, 3)
        exact = expected_accepted(choices, p)
        mc = simulate(choices, p, 40000, rng)
        assert mc == pytest.approx(exact, abs=0.02)
    assert expected_accepted([[0], [1], [0, 0]], [0.5, 0.5]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert child_probs([0.5, 0.5, 1.0]).tolist() == [0.5, 0.25, 0.25]


def test_verifier_stats_recover_rates_and_tau():
    """Drive the real greedy verifier with a target whose argmax hits rank r with probability q[r]:
    the decoder's rank counts recover p, AcceptanceCounts the (depth, rank) table, and the mean
    accepted length matches expected_accepted."""
    rng = np.random.default_rng(1)
    p = np.array([0.6, 0.35, 0.2])
    q = child_probs(p)
    choices = comb_choices(3, 4)
    tree = Tree.from_choices(choices)
    kids = tree.children()
    N, T = 6000, len(tree)
    # node i drafts token i; at each node the target's argmax is its child of rank r w.p. q[r], else -1
    u = rng.random((N, T))
    argmax = np.full((N, T), -1)
    for i in range(T):
        edges = np.cumsum([q[int(tree.rank[c])] for c in kids[i]])
        pick = np.searchsorted(edges, u[:, i], side="right")
        hit = pick < len(kids[i])
        argmax[hit, i] = np.array(kids[i])[pick[hit]]
    batch = Tree(tree.parents.expand(N, T), tree.depth.expand(N, T), tree.rank.expand(N, T),
                 torch.arange(T).expand(N, T), anc=tree.ancestors())
    acc = accept_paths(batch, torch.from_numpy(argmax), tree.max_depth)
    stats, counts = DecodeStats(), AcceptanceCounts()
    stats.add_counts(*acceptance_counts(batch, acc, torch.ones(N, dtype=torch.bool), 8).tolist())
    n = acc.n.tolist()
    stats.record([True] * N, [k - 1 for k in n], n, T)
    for b in range(N):
        counts.add(verify_greedy(kids, list(range(T)), argmax[b].tolist()).tried_ranks)
    by_rank = stats.as_dict()["accept_by_rank"]
    assert [by_rank[r] for r in range(3)] == pytest.approx(p.tolist(), abs=0.03)
    assert counts.pooled() == pytest.approx(p, abs=0.03)
    rates = counts.rates(per_depth=True)
    assert rates.shape == (4, 3) and np.allclose(rates, p[None], atol=0.06)
    assert stats.tau == pytest.approx(expected_accepted(choices, p) + 1, abs=0.05)
    assert counts.as_dict()["tau"] == pytest.approx(stats.tau)


def test_choose_hardware_aware():
    table = solve([0.8, 0.3, 0.1], 32, 6)
    # verify time flat up to 8 nodes, then steep: the best budget is around 8
    t_verify = {2: 1.0, 8: 1.0, 16: 4.0, 32: 8.0}
    pick = choose(table, t_verify, t_draft=0.05)
    assert pick.n == 8 and pick.tokens_per_s == pytest.approx(pick.expected_tau / pick.step_s)
    brute = max((table.tau(n, d) / (table.depth_of(n, d) * 0.05 + np.interp(n, [2, 8, 16, 32], [1, 1, 4, 8])), n, d)
                for n in range(2, 33) for d in range(1, 7) if np.isfinite(table.value[d, n]))
    assert pick.tokens_per_s == pytest.approx(brute[0])
    # expensive drafting favours shallow trees
    assert choose(table, t_verify, t_draft=5.0).depth < choose(table, t_verify, t_draft=0.0).depth
    # no timings: the most expected tau
    assert choose(table, budgets=[32]).expected_tau == pytest.approx(table.tau(32, 6))


def test_comb_probe_shape():
    for k, d in [(1, 3), (3, 3), (6, 6)]:
        c = comb_choices(k, d)
        assert len(c) == d + (k - 1) * d * (d + 1) // 2
        tree = Tree.from_choices(c)
        assert tree.max_depth == d
        spine = [0] * (d - 1)
        assert all(spine[:i] + [r] in c for i in range(d) for r in range(k))  # every rank at every depth
    with pytest.raises(TreeError):
        comb_choices(0, 3)


def test_learned_policy_reads_shape_file(tmp_path):
    table = solve([0.7, 0.3], 12, 4)
    trees = {n: table.choices(n, 4) for n in range(2, 13)}
    f = save_learned(tmp_path / "t.yaml", trees[8], {"name": "learned_T8", "budget": 8, "expected_tau": table.tau(8)},
                     trees)
    pol = LearnedPolicy(str(f))
    assert isinstance(pol, StaticPolicy) and pol.max_size == 8 and pol.meta["name"] == "learned_T8"
    assert pol.shape.to_choices() == trees[8]
    assert LearnedPolicy(str(f), total_tokens=5).max_size == 5
    assert load_learned(f)["trees"][12] == trees[12]
    assert StaticPolicy(shape=str(f)).max_size == 8  # an ordinary shape file too
    with pytest.raises(TreeError, match="total_tokens=40"):
        LearnedPolicy(str(f), total_tokens=40)
    with pytest.raises(TreeError, match="not found"):
        LearnedPolicy(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("name: x\n")
    with pytest.raises(TreeError, match="choices"):
        LearnedPolicy(str(tmp_path / "bad.yaml"))


def test_plane_trees_cover_dp_search_space():
    # the DP's trees are among the enumerated ones (contiguous ranks, limits respected)
    table = solve([0.5, 0.4, 0.3], 6, 3)
    all6 = {tuple(sorted(map(tuple, c))) for c in plane_trees(6, 3, 3)}
    assert tuple(sorted(map(tuple, table.choices(6, 3)))) in all6
    assert len(list(itertools.islice(plane_trees(6, 3, 3), 5))) == 5


def test_monotone_timings():
    from treedec.tree.sequoia import interpolate, monotone

    m = monotone({2: 1.0, 4: 0.8, 8: 1.2, 16: 1.1, 32: 3.0})
    assert list(m.values()) == pytest.approx([0.9, 0.9, 1.15, 1.15, 3.0])
    assert interpolate(m, 24) == pytest.approx((1.15 + 3.0) / 2) and interpolate(m, 100) == 3.0
