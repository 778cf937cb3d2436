"""Prompt lookup beside a draft tree: the n-gram index, the merged tree, and losslessness."""
import random

import pytest
import torch

from tests.helpers import compose_config, greedy_reference, make_pair
from treedec.attention.layout import ancestor_matrix
from treedec.decoding.speculative import CompactingDecoder, SpeculativeDecoder
from treedec.decoding.vanilla import VanillaDecoder
from treedec.sampling import SamplingParams
from treedec.tree.policies import ChainPolicy, DynamicPolicy, LookupPolicy, StaticPolicy, TreePolicy
from treedec.tree.policies.lookup import NgramIndex
from treedec.tree.tree import Tree, TreeError


def test_ngram_index_copies_what_followed_the_latest_earlier_occurrence():
    idx = NgramIndex([5, 1, 2, 9, 9, 1, 2, 7, 8, 1, 2], sizes=(3, 2))
    assert idx.propose(3) == [7, 8, 1]  # "1 2" last ended at 6 (not at the end itself): what followed it
    idx.extend([7])  # "1 2 7" occurred before: the 3-gram wins over the 2-gram
    assert idx.propose(4) == [8, 1, 2, 7]
    assert NgramIndex([1, 2, 3, 4], sizes=(2,)).propose(5) == []  # no earlier occurrence
    assert NgramIndex([4, 4], sizes=(1,)).propose(3) == [4]  # overlapping the suffix, as prompt lookup does


@pytest.mark.parametrize("seed", range(5))
def test_ngram_index_grown_step_by_step_equals_one_built_at_once(seed):
    rng = random.Random(seed)
    toks = [rng.randrange(6) for _ in range(300)]
    grown, cut = NgramIndex(toks[:7], sizes=(3, 2, 1)), 7
    while cut < len(toks):
        k = rng.randint(1, 6)
        grown.extend(toks[cut: cut + k])
        cut += k
        once = NgramIndex(toks[:cut], sizes=(3, 2, 1))
        assert grown.last == once.last and grown.propose(8) == once.propose(8)
        tail = toks[:cut]  # brute force: the latest earlier end of the longest suffix that recurs
        for n in (3, 2, 1):
            ends = [e for e in range(n - 1, len(tail) - 1) if tail[e + 1 - n: e + 1] == tail[-n:]]
            if ends:
                assert once.propose(8) == tail[ends[-1] + 1: ends[-1] + 9]
                break


class Fixed(TreePolicy):
    """An inner policy that returns a prepared tree."""

    def __init__(self, tree: Tree):
        self.tree, self.max_depth, self.max_size, self.max_inputs, self.max_rank = tree, 5, tree.size, 4, 3

    def draft(self, drafter, params=None, generator=None):
        return self.tree


def _inner_tree(B: int, shape: str) -> Tree:
    t = Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]) if shape == "bushy" else Tree.chain(4)
    T = t.size
    rep = lambda x: x.expand(B, T)
    return Tree(rep(t.parents), rep(t.depth), rep(t.rank), torch.arange(B * T).view(B, T) + 100,
                torch.zeros(B, T), anc=t.ancestors())


@pytest.mark.parametrize("shape", ["bushy", "chain"])
def test_the_copy_joins_each_row_as_a_chain_under_the_root_and_short_rows_are_padded(shape):
    B = 3
    inner = _inner_tree(B, shape)
    pol = LookupPolicy(Fixed(inner), tokens=4, ngram=(2,))
    pol.begin([[1, 2, 3, 1], [7, 8, 9], [4, 5, 6, 7, 8, 4]], [2, 1, 5])  # copies: [3, 1, 2], none, [6, 7, 8, 4]
    tree = pol.draft(None)
    T, L = inner.size, 4
    assert tree.size == T + L and tree.tokens[:, :T].equal(inner.tokens)
    assert tree.tokens[0, T:T + 3].tolist() == [3, 1, 2] and tree.tokens[2, T:].tolist() == [6, 7, 8, 4]
    real = ~tree.pad
    assert real[:, :T].all() and real[0].tolist()[T:] == [True] * 3 + [False] and not real[1, T:].any()
    assert bool((tree.parents[:, 1:] < torch.arange(1, T + L)).all())  # topological
    for b in range(B):  # real nodes: the ancestry of their parents; padding: only itself, never the root
        want = ancestor_matrix(tree.parents[b], tree.depth[b])
        for i in range(T + L):
            row = tree.anc[b, i]
            if real[b, i]:
                assert row.equal(want[i]) and (i == 0 or tree.depth[b, i] == tree.depth[b, tree.parents[b, i]] + 1)
            else:
                assert row.nonzero().flatten().tolist() == [i]
    assert pol.max_size == T + L and pol.max_depth == max(5, L)


def test_no_copy_keeps_the_inner_tree_and_sampled_steps_verify_it_alone():
    inner = _inner_tree(1, "bushy")
    pol = LookupPolicy(Fixed(inner), tokens=4)
    pol.begin([[1, 2, 3, 4]], [5])
    assert pol.draft(None) is inner  # no n-gram recurs
    pol.begin([[1, 2, 3, 1, 2]], [3])
    tree = pol.draft(None)  # a 3-token copy, padded to the width bucket 4
    assert tree.size == inner.size + 4 and tree.pad[0, -1] and not tree.pad[0, :-1].any()
    assert pol.draft(None, SamplingParams(temperature=0.8)) is inner
    with pytest.raises(TreeError, match="tokens >= 1"):
        LookupPolicy(Fixed(inner), tokens=0)
    with pytest.raises(TreeError, match="max_rows >= 1"):
        LookupPolicy(Fixed(inner), max_rows=0)


def test_a_finished_row_of_an_uncompacted_batch_gets_no_copy():
    from treedec.decoding.loop import StepInfo

    pol = LookupPolicy(Fixed(_inner_tree(2, "chain")), tokens=4)
    pol.begin([[1, 2, 1], [3, 4, 3]], [2, 4])
    assert pol.draft(None).pad is None  # both rows copy two tokens
    pol.observe(StepInfo(1, [True, False], [[1], []], [2, 0]))  # row 1 finished
    tree = pol.draft(None)
    assert tree.tokens[0, 4:].tolist() == [2, 1] and not tree.pad[0].any() and tree.pad[1, 4:].all()


def test_copies_only_while_the_batch_is_at_most_max_rows_wide():
    inner = _inner_tree(3, "chain")
    pol = LookupPolicy(Fixed(inner), tokens=4, max_rows=2)
    pol.begin([[1, 2, 1]] * 3, [2] * 3)
    assert pol.draft(None) is inner  # three rows: the inner tree alone
    pol.keep_rows([0, 2])  # a row finished and left the batch: two rows get their copies again
    pol.inner.tree = _inner_tree(2, "chain")
    assert pol.draft(None).size == inner.size + 2


INNER = {
    "chain": lambda: ChainPolicy(depth=3),
    "static": lambda: StaticPolicy(shape="eagle_mc_sim_7b_63"),
    "dynamic": lambda: DynamicPolicy(total_tokens=12, depth=4, top_k=3),
    "dynamic_shared": lambda: DynamicPolicy(total_tokens=10, depth=4, top_k=3, node_share=0.6),
}


def _run(inner: str, seed: int, tokens: int = 10):
    target, draft = make_pair(seed)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 23, 41)]
    refs = [greedy_reference(target, p, 160) for p in prompts]
    return refs, SpeculativeDecoder(target, draft, LookupPolicy(INNER[inner](), tokens=tokens)).generate(prompts, 160)


@pytest.mark.parametrize("inner", list(INNER))
def test_copies_are_accepted_past_the_inner_trees_depth(inner):
    """Random tiny models fall into loops, where a copy of the context is right for many tokens: such paths are
    accepted beyond the inner tree's depth (with seed 0 the loops are longer than every inner tree here)."""
    refs, out = _run(inner, 0, tokens=12)
    assert out.tokens == refs and max(out.stats.accepted) > INNER[inner]().max_depth


@pytest.mark.parametrize("inner", ["chain", "dynamic"])
@pytest.mark.parametrize("skip", [True, False])
def test_after_copies_outran_the_tree_the_next_step_verifies_them_alone(inner, skip):
    """Once every live row accepted more copied tokens than the inner tree is deep, the next step verifies the copies
    alone under the root (padding where the inner tree was: the same shape as the step before) and runs no
    draft-head pass (the head catches up on the next drafted step); lossless."""
    target, draft = make_pair(0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 23, 41)]
    pol = LookupPolicy(INNER[inner](), tokens=12, skip_draft=skip)
    passes = []
    draft.register_forward_hook(lambda *_: passes.append(1))
    steps, expect = [], [False]

    def check(info):
        t, n = info.tree, info.tree.inner_size
        alone = n is not None and t.pad is not None and bool(t.pad[:, 1:n].all())  # the inner slots: padding
        steps.append((alone, expect[-1], len(passes)))
        passes.clear()
        live = [b for b, on in enumerate(pol.active) if on]
        expect.append(skip and bool(live) and all(info.n_accept[b] - 1 > pol.inner.max_depth and pol.rows[b].propose(12)
                                                  for b in live))

    out = SpeculativeDecoder(target, draft, pol).generate(prompts, 160, hook=check)
    assert out.tokens == [greedy_reference(target, p, 160) for p in prompts]
    assert [alone for alone, _, _ in steps] == [want for _, want, _ in steps]
    alone = [n for a, _, n in steps if a]
    assert pol.skipped_steps == len(alone) and (len(alone) > 3 if skip else not alone)
    assert sum(alone) <= len(alone) // 2  # only a catch-up grown past Drafter.MAX_PENDING runs the head
    assert all(n > 0 for a, _, n in steps[1:] if not a)


class Spy(ChainPolicy):
    """A chain that records what it is told it accepted."""

    def __init__(self, depth):
        super().__init__(depth)
        self.seen = []

    def observe(self, info):
        self.seen.append(list(info.n_accept))


def test_the_inner_policy_learns_only_what_its_own_nodes_accepted():
    """Copies accepted past the chain's depth reach the output, but the chain (tree=auto, in use) is told only
    what its own nodes accepted, at most its depth, read in the step's one transfer."""
    target, draft = make_pair(0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 23, 41)]
    spy = Spy(3)
    out = SpeculativeDecoder(target, draft, LookupPolicy(spy, tokens=12)).generate(prompts, 160)
    assert out.tokens == [greedy_reference(target, p, 160) for p in prompts]
    assert max(out.stats.accepted) > 3 and spy.seen
    assert all(n <= 4 for ns in spy.seen for n in ns)  # root + 3 drafts at most
    own = sum(max(n - 1, 0) for ns in spy.seen for n in ns)
    assert own < sum(k * c for k, c in out.stats.accepted.items()) / 4  # the copies' tokens were not credited to it


@pytest.mark.parametrize("seed", range(3))
def test_each_rows_context_follows_it_when_finished_rows_leave_the_batch(seed):
    target, draft = make_pair(seed + 20)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (9, 30, 4, 17)]
    refs = [greedy_reference(target, p, 140) for p in prompts]
    eos = refs[1][50]  # one row stops early at its EOS, the others run on in a narrower batch
    want = VanillaDecoder(target, eos_ids=[eos]).generate(prompts, 120).tokens
    pol = LookupPolicy(ChainPolicy(3), tokens=8)
    dec = CompactingDecoder(target, draft, pol, eos_ids=[eos])
    seen = []

    def check(info):  # after every step, each live slot's context is its own row's verified tokens
        for j, b in enumerate(dec._live):
            ctx = pol.rows[j].tokens
            seen.append(ctx == prompts[b] + refs[b][: len(ctx) - len(prompts[b])])

    out = dec.generate(prompts, 120, hook=check)
    assert out.tokens == want and len({len(t) for t in want}) > 1 and seen and all(seen)


def test_tree_lookup_config_instantiates_and_unknown_keys_name_the_fix():
    from omegaconf import OmegaConf

    from treedec.config.checks import instantiate_checked, validate_tree
    from treedec.errors import ConfigError

    cfg = compose_config("generate", ["tree=lookup", "tree.tokens=16", "tree.inner.depth=6"])
    validate_tree(cfg.tree)
    pol = instantiate_checked(cfg.tree, "tree")
    assert isinstance(pol, LookupPolicy) and pol.tokens == 16 and pol.inner.max_depth == 6 and pol.max_depth == 16
    bad = OmegaConf.to_container(cfg.tree)
    bad["inner"]["dpeth"] = 4
    with pytest.raises(ConfigError, match="tree.inner"):
        validate_tree(bad)


def test_the_copy_width_takes_a_few_buckets_so_few_verify_shapes_are_built():
    target, draft = make_pair(0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (5, 23, 41)]
    sizes = set()
    dec = SpeculativeDecoder(target, draft, LookupPolicy(ChainPolicy(3), tokens=12))
    dec.generate(prompts, 160, hook=lambda info: sizes.add(info.tree.size))
    assert len(sizes) > 2 and sizes <= {1, 4} | {4 + w for w in (1, 2, 4, 8, 12)}  # copies alone: padded to 4 + w


@pytest.mark.parametrize("inner", ["chain", "dynamic"])
def test_a_lookup_step_reads_the_device_once(inner):
    """The copies come from host state and the inner tree's own acceptance rides in the step's one read."""
    from treedec.profiling import count_ops

    target, draft = make_pair(0)
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23)]
    dec = SpeculativeDecoder(target, draft, LookupPolicy(INNER[inner](), tokens=10))
    with count_ops() as short:
        a = dec.generate(prompts, 40)
    with count_ops() as long:
        b = dec.generate(prompts, 160)
    steps = b.stats.steps - a.stats.steps
    assert steps > 10 and (long.host_reads - short.host_reads) == steps
