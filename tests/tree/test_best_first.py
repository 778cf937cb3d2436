"""tree=best_first (DDTree): the drafted tree is exactly the T - 1 best rank paths by summed log-marginal.

A brute-force reference enumerates every path of depth <= D over a small vocabulary and keeps the T - 1 best; the
policy's per-depth top-k must give the same node set, scores and ranks, as a well-formed tree (topological, connected,
distinct sibling tokens), row by row, with no host reads. Also: which heads and depths it accepts (check_head).
"""
import itertools

import pytest
import torch

from tests.helpers import dflash_pair, eagle3_pair, greedy_reference, host_reads_per_step, make_pair, parallel_pair
from treedec.decoding.drafter import Drafter
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.profiling import count_ops
from treedec.sampling import SamplingParams
from treedec.tree import Tree, TreeError
from treedec.tree.policies import AutoPolicy, ChainPolicy, DynamicPolicy, LearnedPolicy, StaticPolicy
from treedec.tree.policies.base import topk_logp
from treedec.tree.policies.best_first import BestFirstPolicy
from treedec.tree.policies.learned import save_learned
from treedec.tree.policies.lookup import LookupPolicy


class FakeDrafter:
    """What BestFirstPolicy reads of a Drafter: fixed per-depth logits [B, D, V]; draft index i is target id ids[i]."""

    def __init__(self, logits: torch.Tensor, ids: torch.Tensor | None = None):
        self.logits = logits
        self.batch, self.device = logits.shape[0], logits.device
        self.ids = torch.arange(logits.shape[-1]) if ids is None else ids
        self.root_tokens = torch.arange(logits.shape[0]) + 1000
        self.asked: list[int] = []

    def marginals(self, depth: int) -> torch.Tensor:
        self.asked.append(depth)
        return self.logits[:, :depth]

    def topk(self, logits, k, temperature=1.0):
        lp, idx = topk_logp(logits, k, temperature)
        return lp, self.ids[idx]


def reference(logits: torch.Tensor, T: int, temperature: float = 1.0) -> list[tuple[float, tuple[int, ...]]]:
    """(score, path of draft indices) of every path of depth <= D over one row's logits [D, V], best first (ties: the
    shallower first): the first T - 1 are the tree's nodes."""
    lq = torch.log_softmax(logits.double() / temperature, -1).tolist()
    D, V = len(lq), len(lq[0])
    out = []
    for d in range(1, D + 1):
        for path in itertools.product(range(V), repeat=d):
            out.append((sum(lq[i][t] for i, t in enumerate(path)), path))
    out.sort(key=lambda sp: (-sp[0], len(sp[1])))
    return out


def paths_of(tree: Tree, b: int) -> list[tuple[int, ...]]:
    """Each non-root node's path of tokens from the root (root excluded), in node order."""
    par, tok = tree.parents[b].tolist(), tree.tokens[b].tolist()
    out = []
    for c in range(1, len(par)):
        path, n = [], c
        while n > 0:
            path.append(tok[n])
            n = par[n]
        out.append(tuple(reversed(path)))
    return out


def check_well_formed(tree: Tree, D: int, root_tokens) -> None:
    """Topological, connected, depths and ancestry consistent with parents, siblings distinct, the root's token."""
    B, T = tree.tokens.shape
    assert tree.parents.shape == tree.depth.shape == tree.rank.shape == (B, T)
    anc = tree.ancestors()
    for b in range(B):
        par, dep = tree.parents[b], tree.depth[b]
        assert int(par[0]) == -1 and int(dep[0]) == 0 and int(tree.tokens[b, 0]) == int(root_tokens[b])
        assert bool((par[1:] >= 0).all()) and bool((par[1:] < torch.arange(1, T)).all())  # connected, topological
        assert torch.equal(dep[1:], dep[par[1:]] + 1) and int(dep.max()) <= D
        for p in set(par[1:].tolist()):
            kids = (par == p).nonzero().flatten()
            assert len(set(tree.tokens[b, kids].tolist())) == len(kids)  # distinct sibling tokens
        assert torch.equal(anc[b] if anc.dim() == 3 else anc, Tree.from_parents(par).ancestors())
        sc = tree.scores[b]
        assert float(sc[0]) == 0 and bool((sc[1:] <= sc[par[1:]] + 1e-6).all())  # a child never outscores its parent


def assert_is_reference(tree: Tree, logits: torch.Tensor, ids: torch.Tensor, T: int, temperature: float = 1.0):
    for b in range(logits.shape[0]):
        ref = reference(logits[b], T, temperature)
        gap = ref[T - 2][0] - ref[T - 1][0]
        assert gap > 1e-4, "the seed gives a near tie at the cut: pick another"
        want = {tuple(int(ids[t]) for t in p): s for s, p in ref[: T - 1]}
        got = paths_of(tree, b)
        assert set(got) == set(want) and len(got) == T - 1
        lq = torch.log_softmax(logits[b].double() / temperature, -1)
        order = lq.argsort(-1, descending=True).tolist()  # rank of each draft index at each depth
        inv = {int(t): i for i, t in enumerate(ids.tolist())}
        for c, path in enumerate(got, start=1):
            assert float(tree.scores[b, c]) == pytest.approx(want[path], abs=1e-4)
            assert int(tree.rank[b, c]) == order[len(path) - 1].index(inv[path[-1]])


# (V, D, T): T - 1 <= V (each depth contributes its T - 1 best tokens; validate refuses more), T - 1 = V in some
SIZES = [(9, 3, 10), (6, 3, 7), (5, 4, 6), (8, 2, 9), (6, 1, 4), (4, 3, 5), (12, 3, 13), (5, 5, 4)]


@pytest.mark.parametrize("sharp", [1.0, 3.0], ids=["flat", "peaked"])  # peaked marginals: deeper trees
@pytest.mark.parametrize("V, D, T", SIZES, ids=[f"V{v}-D{d}-T{t}" for v, d, t in SIZES])
def test_the_tree_is_the_best_paths_by_summed_log_marginal(V, D, T, sharp):
    g = torch.Generator().manual_seed(V * 100 + D * 10 + T)
    logits = sharp * torch.randn(3, D, V, generator=g)
    ids = torch.randperm(50, generator=g)[:V]  # draft indices map to target ids
    fake = FakeDrafter(logits, ids)
    tree = BestFirstPolicy(T, D).draft(fake)
    assert fake.asked == [D] and tree.size == T  # one marginals call, for the whole depth
    check_well_formed(tree, D, fake.root_tokens)
    assert_is_reference(tree, logits, ids, T)


def test_peaked_marginals_give_deep_trees_and_flat_ones_wide_trees():
    """The reference's shape really does depend on the marginals: a sanity check of the cases above."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 4, 8, generator=g)
    deep = BestFirstPolicy(8, 4).draft(FakeDrafter(6 * base))
    wide = BestFirstPolicy(8, 4).draft(FakeDrafter(0.1 * base))
    assert int(deep.depth.max()) == 4 and int(wide.depth.max()) == 1


@pytest.mark.parametrize("T, D", [(6, 3), (9, 4), (5, 2)])
def test_ties_still_give_a_connected_tree(T, D):
    """Equal marginals (uniform rows), a one-hot depth (a child scores as much as its parent) and a mix: every kept
    node's parent is kept, and the score multiset is the reference's."""
    V = 8
    uniform = torch.zeros(1, D, V)
    onehot = torch.zeros(1, D, V)
    onehot[0, :, 2] = 60.0  # log q = 0 at the top token: ties across depths
    mixed = torch.randn(1, D, V, generator=torch.Generator().manual_seed(T))
    mixed[0, 1] = 0.0  # one uniform depth among random ones
    mixed[0, 0, :2] = 1.5  # two equal best tokens at depth 1
    logits = torch.cat([uniform, onehot, mixed])
    fake = FakeDrafter(logits)
    tree = BestFirstPolicy(T, D).draft(fake)
    check_well_formed(tree, D, fake.root_tokens)
    for b in range(3):
        want = sorted(s for s, _ in reference(logits[b], T)[: T - 1])
        got = sorted(tree.scores[b, 1:].tolist())
        assert got == pytest.approx(want, abs=1e-4)


def test_batch_rows_are_independent():
    """Each row's tree is the tree of that row drafted alone, whatever the other rows hold."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, 12, generator=g) * torch.tensor([0.3, 1.0, 3.0, 8.0])[:, None, None]
    pol = BestFirstPolicy(12, 3)
    both = pol.draft(FakeDrafter(logits))
    for b in range(4):
        alone = BestFirstPolicy(12, 3).draft(FakeDrafter(logits[b:b + 1]))
        assert paths_of(both, b) == [tuple(p) for p in paths_of(alone, 0)]
        for f in ("parents", "depth", "rank"):
            assert torch.equal(getattr(both, f)[b], getattr(alone, f)[0])
        torch.testing.assert_close(both.scores[b], alone.scores[0])
    # the rows differ (so the check above can fail)
    assert len({tuple(both.depth[b].tolist()) for b in range(4)}) > 1


@pytest.mark.parametrize("temperature", [0.4, 1.0, 2.5])
def test_sampling_scores_paths_at_the_sampling_temperature(temperature):
    """Under sampling the scores are log-marginals at the sampling temperature (so the node set follows it); greedy
    decoding (and temperature 1) scores at 1."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 9, generator=g) * 1.5
    fake = FakeDrafter(logits)
    tree = BestFirstPolicy(10, 3).draft(fake, SamplingParams(temperature))
    check_well_formed(tree, 3, fake.root_tokens)
    assert_is_reference(tree, logits, fake.ids, 10, temperature)
    greedy = BestFirstPolicy(10, 3).draft(fake, SamplingParams())
    assert_is_reference(greedy, logits, fake.ids, 10, 1.0)


def test_a_colder_temperature_gives_a_deeper_tree():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 4, 10, generator=g) * 2
    cold = BestFirstPolicy(10, 4).draft(FakeDrafter(logits), SamplingParams(0.3))
    hot = BestFirstPolicy(10, 4).draft(FakeDrafter(logits), SamplingParams(3.0))
    assert int(cold.depth.max()) > int(hot.depth.max())
    assert float(cold.depth.float().mean()) > float(hot.depth.float().mean())


ONE_PASS_PAIRS = {"parallel": parallel_pair, "dflash": dflash_pair}


def primed(seed=0, K=5, k=40, lens=(9, 4), sharpen=4.0, kind="parallel"):
    """A real Drafter over a sharpened one-pass head after a catch-up of random target features (ragged rows)."""
    target, head = ONE_PASS_PAIRS[kind](seed, K=K, k=k, sharpen=sharpen)
    g = torch.Generator().manual_seed(seed)
    L = max(lens)
    d = Drafter(head, len(lens), 128)
    toks = torch.randint(0, 64, (len(lens), L), generator=g)
    feats = torch.randn(len(lens), L, len(head.config.feature_layers) * 64, generator=g)
    with torch.inference_mode():
        d.catch_up(toks, feats, torch.tensor(lens), list(lens), toks[:, 0])
        d.flush()
    return d


@pytest.mark.parametrize("kind", list(ONE_PASS_PAIRS))
@pytest.mark.parametrize("lens", [(9, 4), (6, 6)], ids=["ragged", "even"])
def test_the_real_drafter_gives_the_reference_tree_without_host_reads(lens, kind):
    """With a one-pass head: the tree of its marginals (mapped to target ids) is the reference's, drafting reads
    nothing back from the device, and the mask positions leave the cache as they found it."""
    d = primed(lens=lens, kind=kind)
    pol = BestFirstPolicy(12, 3)
    with torch.inference_mode():
        pol.draft(d)  # the policy's constants, outside the count
        with count_ops() as c:
            tree = pol.draft(d)
        logits = d.marginals(3).float()
    assert c.host_reads == 0, c.reads
    assert d.cache.host_lengths == list(lens)
    check_well_formed(tree, 3, d.root_tokens)
    assert int(tree.depth.max()) >= 2  # (the sharpened head drafts past depth 1)
    assert_is_reference(tree, logits, d.head.vocab_ids, 12)


@pytest.mark.parametrize("kind", list(ONE_PASS_PAIRS))
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, top_p=0.95)], ids=["greedy", "sample"])
def test_best_first_reads_the_device_once_per_step(params, kind):
    """A decoding step with a best-first tree reads the host once (the step's read): drafting adds none."""
    target, head = ONE_PASS_PAIRS[kind](1, K=4, sharpen=4.0)
    dec = SpeculativeDecoder(target, head, BestFirstPolicy(12, 4), params)
    per_step, steps, res, reads = host_reads_per_step(dec)
    assert res.stats.steps > 10
    assert per_step <= 1 + 1 / steps, reads  # a rare top-p miss may add one


def learned_policy(tmp_path):
    return LearnedPolicy(str(save_learned(tmp_path / "t.yaml", [[0], [1], [0, 0]], {"name": "t"})))


@pytest.mark.parametrize("make", [lambda _: DynamicPolicy(16, 4, 4), lambda _: StaticPolicy(shape="balanced_2x3"),
                                  learned_policy, lambda _: LookupPolicy(DynamicPolicy(16, 4, 4))],
                         ids=["dynamic", "static", "learned", "lookup_dynamic"])
def test_node_by_node_policies_refuse_a_one_pass_head(make, tmp_path):
    target, head = parallel_pair(0, K=5)
    with pytest.raises(TreeError, match="one-pass.*use tree=chain, tree=best_first"):
        SpeculativeDecoder(target, head, make(tmp_path))


@pytest.mark.parametrize("pair", [lambda: make_pair(0), lambda: eagle3_pair(0)], ids=["eagle", "eagle3"])
@pytest.mark.parametrize("make", [lambda: BestFirstPolicy(16, 4), lambda: LookupPolicy(BestFirstPolicy(16, 4))],
                         ids=["best_first", "lookup_best_first"])
def test_best_first_refuses_an_autoregressive_head(pair, make):
    target, head = pair()
    with pytest.raises(TreeError, match=r"one-pass head's per-position marginals.*draft=tiny_code_parallel.*tree=dynamic"):
        SpeculativeDecoder(target, head, make())


@pytest.mark.parametrize("make", [lambda: BestFirstPolicy(16, 6), lambda: ChainPolicy(6),
                                  lambda: LookupPolicy(ChainPolicy(6))], ids=["best_first", "chain", "lookup_chain"])
def test_a_tree_deeper_than_the_block_is_refused(make):
    target, head = parallel_pair(0, K=5)
    with pytest.raises(TreeError, match="drafts 6 deep.*set the tree's depth to at most 5"):
        SpeculativeDecoder(target, head, make())
    SpeculativeDecoder(target, head, BestFirstPolicy(16, 5))  # depth = block_size is fine
    SpeculativeDecoder(target, head, ChainPolicy(5))


def test_a_best_first_tree_wider_than_the_draft_vocabulary_names_total_tokens():
    """T - 1 = 59 best tokens per marginal from a 40-token draft vocabulary: the error must name the setting to lower
    (best_first has no top_k and no shape)."""
    target, head = parallel_pair(0, K=5, k=40)
    SpeculativeDecoder(target, head, BestFirstPolicy(41, 3))  # T - 1 = 40 = the draft vocabulary: fine
    with pytest.raises(TreeError, match="total_tokens"):
        SpeculativeDecoder(target, head, BestFirstPolicy(60, 3))


@pytest.mark.parametrize("top_k", [1, 4])
def test_tree_auto_with_a_one_pass_head_plays_chains_and_best_first_trees_from_one_pool(top_k):
    """A one-pass head: auto's candidates are no deeper than its block; every best-first tree comes from one pool of
    the largest tree's T - 1 best per depth (what observe() reads for every tree); top_k 1 means chains only."""
    target, head = parallel_pair(0, K=5, sharpen=4.0)
    policy = AutoPolicy(max_depth=8, top_k=top_k, max_total_tokens=20)
    dec = SpeculativeDecoder(target, head, policy)
    assert max(d for _, d, _ in policy.shapes) == 5
    trees = [(k, t) for k, d, t in policy.shapes if k > 1]
    assert (not trees) if top_k == 1 else (trees and {k for k, _ in trees} == {max(t for _, t in trees) - 1})
    assert {d for k, d, t in policy.shapes if k == 1} == set(range(6))  # a plain step and a chain of every depth
    prompt = [1, 2, 3]
    assert dec.generate([prompt], 120).tokens[0] == greedy_reference(target, prompt, 120)
    assert top_k == 1 or any(T > D + 1 for T, D in policy.history)  # trees were played (and observed)


def test_tree_auto_sizes_best_first_trees_to_the_draft_vocabulary():
    """A 40-token draft vocabulary: auto's best-first trees stop at 41 nodes (each depth's 40 tokens), with no error
    to lower a setting the user never set, and decoding is still vanilla's."""
    target, head = parallel_pair(0, K=5, k=40, sharpen=4.0)
    policy = AutoPolicy()
    dec = SpeculativeDecoder(target, head, policy)
    assert max(t for k, _, t in policy.shapes if k > 1) == 32  # the largest candidate size <= 41
    assert dec.generate([[1, 2, 3]], 40).tokens[0] == greedy_reference(target, [1, 2, 3], 40)
