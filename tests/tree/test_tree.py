"""Tree core: construction, validation, derived views (ancestry, bits, positions, paths).

Every derived view is checked against an independent brute-force computation over the
parent list (walking up the parents in plain Python), on hand-made and random trees.
"""
from __future__ import annotations

import math

import pytest
import torch

from treedec.tree import Tree, TreeError, ancestor_matrix, chain_bits, pack_bits, unpack_bits

# ------------------------------------------------------------------ brute-force references


def random_parents(T: int, gen: torch.Generator, style: str = "uniform") -> list[int]:
    """A random topological parent list of T nodes (node 0 = root)."""
    parents = [-1]
    for i in range(1, T):
        if style == "uniform":  # parent uniform among earlier nodes: shallow, bushy
            q = int(torch.randint(0, i, (1,), generator=gen))
        elif style == "deep":  # parent among the last 3 nodes: long paths, large depth
            lo = max(0, i - 3)
            q = int(torch.randint(lo, i, (1,), generator=gen))
        else:
            raise AssertionError(style)
        parents.append(q)
    return parents


def bf_ancestors(parents: list[int]) -> list[set[int]]:
    """For each node, itself plus all its ancestors, by walking up the parents."""
    out = []
    for i in range(len(parents)):
        s, p = set(), i
        while p != -1:
            s.add(p)
            p = parents[p]
        out.append(s)
    return out


def bf_depth(parents: list[int]) -> list[int]:
    return [len(a) - 1 for a in bf_ancestors(parents)]


def bf_path(parents: list[int], i: int) -> list[int]:
    path = []
    while i != -1:
        path.append(i)
        i = parents[i]
    return path[::-1]


def bf_bits(rows: list[set[int]], n_cols: int) -> torch.Tensor:
    """Pack sets of column indices into signed int64 words with Python big ints."""
    W = max(1, math.ceil(n_cols / 64))
    out = []
    for cols in rows:
        big = sum(1 << j for j in cols)
        words = []
        for w in range(W):
            u = (big >> (64 * w)) & ((1 << 64) - 1)
            words.append(u - (1 << 64) if u >= (1 << 63) else u)  # two's complement
        out.append(words)
    return torch.tensor(out, dtype=torch.int64)


def bf_auto_rank(parents: list[int]) -> list[int]:
    seen: dict[int, int] = {}
    rank = [0]
    for q in parents[1:]:
        rank.append(seen.get(q, 0))
        seen[q] = seen.get(q, 0) + 1
    return rank


SIZES = [1, 2, 3, 5, 17, 63, 64, 65, 100, 127, 128, 129, 200]


def random_trees():
    """(T, style, seed) triples covering 1..200 nodes, shallow and deep."""
    cases = [(T, style, 1000 + T) for T in SIZES for style in ("uniform", "deep")]
    g = torch.Generator().manual_seed(7)
    cases += [(int(torch.randint(1, 201, (1,), generator=g)), "uniform", s) for s in range(10)]
    return cases


def make_random(T, style, seed):
    g = torch.Generator().manual_seed(seed)
    return random_parents(T, g, style)


# ------------------------------------------------------------------ construction

EXAMPLE = [[0], [1], [2], [0, 0], [0, 1], [2, 0]]  # the tree of docs/design.md §1


def test_from_choices_design_example():
    t = Tree.from_choices(EXAMPLE)
    # flattened [r, a, b, c, d, e, f]: a, b, c children of r; d, e of a; f of c
    assert t.parents.tolist() == [-1, 0, 0, 0, 1, 1, 3]
    assert t.depth.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert t.rank.tolist() == [0, 0, 1, 2, 0, 1, 0]
    assert len(t) == t.size == 7
    assert t.max_depth == 2
    assert t.parents.dtype == t.depth.dtype == t.rank.dtype == torch.long
    assert t.position_ids(10).tolist() == [10, 11, 11, 11, 12, 12, 12]


def test_from_choices_sorts_unordered_paths():
    shuffled = [[2, 0], [0, 1], [2], [0], [0, 0], [1]]
    t = Tree.from_choices(shuffled)
    assert t.parents.tolist() == Tree.from_choices(EXAMPLE).parents.tolist()
    # to_choices gives the paths in the stored (length, ranks) order
    assert t.to_choices() == sorted(shuffled, key=lambda c: (len(c), c))


def test_from_choices_accepts_tuples_and_tensors():
    t = Tree.from_choices([(0,), (0, torch.tensor(1).item()), (1,)])
    assert t.parents.tolist() == [-1, 0, 0, 1]
    assert t.to_choices() == [[0], [1], [0, 1]]


def test_from_choices_empty_is_root_only():
    t = Tree.from_choices([])
    assert t.parents.tolist() == [-1]
    assert t.to_choices() == []
    assert t.leaves() == [0]
    assert t.ancestor_bits().tolist() == [[1]]


def test_from_choices_rank_gap_keeps_ranks():
    # only the 2nd-best child of the root: rank 1 is kept, not renumbered
    t = Tree.from_choices([[1], [1, 3]])
    assert t.parents.tolist() == [-1, 0, 1]
    assert t.rank.tolist() == [0, 1, 3]
    assert t.to_choices() == [[1], [1, 3]]


def test_from_parents_basic_and_tensor_input():
    p = [-1, 0, 0, 1, 1, 2, 5]
    for src in (p, torch.tensor(p), torch.tensor(p, dtype=torch.int32)):
        t = Tree.from_parents(src)
        assert t.parents.tolist() == p
        assert t.parents.dtype == torch.long
        assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
        assert t.rank.tolist() == [0, 0, 1, 0, 1, 0, 0]


def test_from_parents_explicit_rank_and_tokens():
    tokens = torch.tensor([5, 6, 7])
    scores = torch.tensor([0.0, -1.0, -2.0])
    t = Tree.from_parents([-1, 0, 0], tokens=tokens, scores=scores, rank=[0, 3, 1])
    assert t.rank.tolist() == [0, 3, 1]
    assert t.to_choices() == [[3], [1]]
    assert torch.equal(t.tokens, tokens) and torch.equal(t.scores, scores)
    u = t.with_tokens(torch.tensor([1, 2, 3]))
    assert u.tokens.tolist() == [1, 2, 3]
    assert torch.equal(u.scores, scores)  # kept when not given
    assert u.parents.tolist() == t.parents.tolist()
    assert t.tokens.tolist() == [5, 6, 7]  # original untouched


@pytest.mark.parametrize("n", [1, 2, 6, 65])
def test_chain(n):
    t = Tree.chain(n)
    assert t.parents.tolist() == [-1] + list(range(n - 1))
    assert t.depth.tolist() == list(range(n))
    assert t.rank.tolist() == [0] * n
    assert t.max_depth == n - 1
    assert torch.equal(t.ancestors(), torch.ones(n, n, dtype=torch.bool).tril())
    assert torch.equal(t.ancestor_bits(), chain_bits(n))
    assert t.leaves() == [n - 1]
    assert t.retrieve_indices().tolist() == [list(range(n))]
    assert t.to_choices() == [[0] * k for k in range(1, n)]


# ------------------------------------------------------------------ random trees vs brute force


@pytest.mark.parametrize("T,style,seed", random_trees())
def test_random_tree_matches_brute_force(T, style, seed):
    p = make_random(T, style, seed)
    t = Tree.from_parents(p)
    anc = bf_ancestors(p)

    assert t.depth.tolist() == bf_depth(p)
    assert t.rank.tolist() == bf_auto_rank(p)
    assert t.max_depth == max(bf_depth(p))

    # dense ancestry
    dense = torch.zeros(T, T, dtype=torch.bool)
    for i, s in enumerate(anc):
        dense[i, list(s)] = True
    assert torch.equal(t.ancestors(), dense)
    assert torch.equal(t.mask(), dense)

    # packed bits: shape, dtype, exact words (incl. the sign bit)
    bits = t.ancestor_bits()
    assert bits.shape == (T, math.ceil(T / 64))
    assert bits.dtype == torch.int64
    assert torch.equal(bits, bf_bits(anc, T))
    assert torch.equal(unpack_bits(bits, T), dense)

    # paths
    for i in range(T):
        assert t.path_to(i) == bf_path(p, i)


@pytest.mark.parametrize("T,style,seed", random_trees())
def test_random_tree_choices_round_trip(T, style, seed):
    p = make_random(T, style, seed)
    t = Tree.from_parents(p)
    ch = t.to_choices()
    assert len(ch) == T - 1
    for i, c in enumerate(ch, start=1):
        assert len(c) == t.depth[i].item()
        assert c == [t.rank[j].item() for j in bf_path(p, i)[1:]]
    u = Tree.from_choices(ch)
    assert len(u) == T
    assert {tuple(c) for c in u.to_choices()} == {tuple(c) for c in ch}
    # the rebuilt tree is the same tree up to node order: same depth multiset, same leaf count
    assert sorted(u.depth.tolist()) == sorted(t.depth.tolist())
    assert len(u.leaves()) == len(t.leaves())
    # and from_choices is idempotent through to_choices
    assert Tree.from_choices(u.to_choices()).parents.tolist() == u.parents.tolist()


@pytest.mark.parametrize("T,style,seed", random_trees())
def test_random_tree_children_leaves_retrieve(T, style, seed):
    p = make_random(T, style, seed)
    t = Tree.from_parents(p)
    children = t.children()
    assert children == [[j for j in range(T) if p[j] == i] for i in range(T)]
    leaves = t.leaves()
    assert leaves == [i for i in range(T) if i not in set(p)]

    ri = t.retrieve_indices()
    assert ri.dtype == torch.long
    assert ri.shape == (len(leaves), t.max_depth + 1)
    got_leaves = []
    for row in ri.tolist():
        n = sum(1 for x in row if x != -1)
        assert all(x != -1 for x in row[:n]) and all(x == -1 for x in row[n:])  # padding at the end
        path = row[:n]
        assert path[0] == 0
        for a, b in zip(path, path[1:]):
            assert p[b] == a  # consecutive entries are parent -> child
        assert path[-1] in leaves
        assert n == t.depth[path[-1]].item() + 1
        got_leaves.append(path[-1])
    assert sorted(got_leaves) == sorted(leaves)
    assert len(set(got_leaves)) == len(got_leaves)  # every leaf exactly once


# ------------------------------------------------------------------ layout helpers


def test_bits_use_sign_bit_and_multiple_words():
    T = 130
    t = Tree.chain(T)
    bits = t.ancestor_bits()
    assert bits.shape == (T, 3)
    # row 63 sees columns 0..63: the whole first word, i.e. -1 in two's complement
    assert bits[63].tolist() == [-1, 0, 0]
    # row 62 sees 0..62: everything but the sign bit
    assert bits[62].tolist() == [(1 << 63) - 1, 0, 0]
    # row 64 sees a full first word and bit 0 of the second
    assert bits[64].tolist() == [-1, 1, 0]
    assert bits[129].tolist() == [-1, -1, 3]
    # a node whose only non-self ancestor is column 63: root -> ... -> 63 -> 64 in a star
    parents = [-1] + [0] * 63 + [63]  # node 64 is child of node 63
    b = Tree.from_parents(parents).ancestor_bits()
    assert b[63].tolist() == [-(1 << 63) + 1, 0]  # bits 0 and 63
    assert b[64].tolist() == [-(1 << 63) + 1, 1]  # bits 0, 63 and 64


@pytest.mark.parametrize("N", [0, 1, 63, 64, 65, 128, 200])
def test_pack_unpack_round_trip(N):
    g = torch.Generator().manual_seed(N)
    mask = torch.rand(3, 5, N, generator=g) < 0.5
    if N:
        mask[..., N - 1] = True  # make sure the last (possibly sign) bit is exercised
    bits = pack_bits(mask)
    assert bits.dtype == torch.int64
    assert bits.shape == (3, 5, max(1, math.ceil(N / 64)))
    assert torch.equal(unpack_bits(bits, N), mask)
    rows = [set(torch.nonzero(r).flatten().tolist()) for r in mask.reshape(-1, N)] if N else [set()] * 15
    assert torch.equal(bits.reshape(15, -1), bf_bits(rows, N))


def test_pack_bits_single_column_values():
    for j in (0, 1, 62, 63, 64, 127):
        m = torch.zeros(1, 128, dtype=torch.bool)
        m[0, j] = True
        bits = pack_bits(m)[0].tolist()
        expect = [0, 0]
        expect[j // 64] = -(1 << 63) if j % 64 == 63 else 1 << (j % 64)
        assert bits == expect, j


@pytest.mark.parametrize("T", [1, 7, 64, 150])
def test_batched_ancestor_matrix_equals_per_row(T):
    g = torch.Generator().manual_seed(T)
    rows = [random_parents(T, g, "uniform" if b % 2 else "deep") for b in range(4)]
    P = torch.tensor(rows)
    D = torch.stack([Tree.from_parents(r).depth for r in rows])
    for batched in (ancestor_matrix(P), ancestor_matrix(P, D)):
        assert batched.shape == (4, T, T) and batched.dtype == torch.bool
        for b, r in enumerate(rows):
            assert torch.equal(batched[b], Tree.from_parents(r).ancestors())
            assert torch.equal(batched[b], ancestor_matrix(torch.tensor(r)))
    # packed per-row bits agree with each tree's own
    pb = pack_bits(ancestor_matrix(P))
    for b, r in enumerate(rows):
        assert torch.equal(pb[b], Tree.from_parents(r).ancestor_bits())


def test_ancestor_matrix_2d_batch_dims():
    g = torch.Generator().manual_seed(3)
    rows = [random_parents(20, g, "deep") for _ in range(6)]
    P = torch.tensor(rows).view(2, 3, 20)
    out = ancestor_matrix(P)
    assert out.shape == (2, 3, 20, 20)
    for k, r in enumerate(rows):
        assert torch.equal(out.view(6, 20, 20)[k], Tree.from_parents(r).ancestors())


def test_chain_bits():
    for T in (1, 63, 64, 65):
        expect = bf_bits([set(range(i + 1)) for i in range(T)], T)
        assert torch.equal(chain_bits(T), expect)


def test_position_ids_int_and_tensor():
    t = Tree.from_choices(EXAMPLE)
    d = [0, 1, 1, 1, 2, 2, 2]
    assert t.position_ids().tolist() == d
    assert t.position_ids(5).tolist() == [5 + x for x in d]
    assert t.position_ids(torch.tensor(3)).tolist() == [3 + x for x in d]
    pos = t.position_ids(torch.tensor([0, 4, 100]))
    assert pos.shape == (3, 7) and pos.dtype == torch.long
    assert pos.tolist() == [[L + x for x in d] for L in (0, 4, 100)]
    pos32 = t.position_ids(torch.tensor([2, 9], dtype=torch.int32))
    assert pos32.dtype == torch.long and pos32.tolist() == [[L + x for x in d] for L in (2, 9)]


def test_children_and_leaves_example():
    t = Tree.from_choices(EXAMPLE)
    assert t.children() == [[1, 2, 3], [4, 5], [], [6], [], [], []]
    assert t.leaves() == [2, 4, 5, 6]
    assert t.retrieve_indices().tolist() == [[0, 2, -1], [0, 1, 4], [0, 1, 5], [0, 3, 6]]
    assert t.path_to(0) == [0]
    assert t.path_to(6) == [0, 3, 6]


def test_views_are_cached_and_consistent():
    t = Tree.from_choices(EXAMPLE)
    assert t.ancestor_bits() is t.ancestor_bits()
    assert t.ancestors() is t.mask()
    bits = t.ancestor_bits().tolist()
    # bit j of row i iff j == i or j is an ancestor of i
    assert bits == [[0b1], [0b11], [0b101], [0b1001], [0b10011], [0b100011], [0b1001001]]


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "choices,word",
    [
        ([[0], [0, 0, 0]], "parent"),  # [0, 0] missing
        ([[1, 0]], "parent"),  # [1] missing
        ([[0], [0]], "duplicate"),
        ([[0], [1], (0,)], "duplicate"),  # same path as list and tuple
        ([[-1]], "negative"),
        ([[0], [0, -2]], "negative"),
        ([[0], []], "empty"),
    ],
)
def test_from_choices_rejects(choices, word):
    with pytest.raises(TreeError, match=word) as ei:
        Tree.from_choices(choices)
    assert isinstance(ei.value, ValueError)


def test_missing_parent_message_names_the_fix():
    with pytest.raises(TreeError) as ei:
        Tree.from_choices([[0], [0, 1, 2]])
    assert "[0, 1]" in str(ei.value)


@pytest.mark.parametrize(
    "parents,word",
    [
        ([], "empty"),
        ([0, 0], "root"),  # root with a parent
        ([3, 0, 0, 0], "root"),
        ([-1, 0, 3, 1], "topological"),  # node 2's parent comes after it
        ([-1, 2, 0], "topological"),
        ([-1, 1], "cycle"),  # self-parent
        ([-1, 0, 2], "cycle"),
        ([-1, 0, 5], "outside"),  # out of range
        ([-1, 0, -1], "outside"),  # a second root
        ([-1, -7], "outside"),
    ],
)
def test_from_parents_rejects(parents, word):
    with pytest.raises(TreeError, match=word) as ei:
        Tree.from_parents(parents)
    assert isinstance(ei.value, ValueError)


def test_from_parents_rejects_wrong_lengths():
    with pytest.raises(TreeError, match="rank"):
        Tree.from_parents([-1, 0, 0], rank=[0, 0])
    with pytest.raises(TreeError, match="tokens"):
        Tree.from_parents([-1, 0, 0], tokens=torch.tensor([1, 2]))
    with pytest.raises(TreeError, match="scores"):
        Tree.from_parents([-1, 0], scores=torch.zeros(3))


def test_chain_rejects_zero():
    with pytest.raises(TreeError, match="at least"):
        Tree.chain(0)
