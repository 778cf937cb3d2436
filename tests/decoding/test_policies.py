"""Tree policies: shapes, EAGLE-2 invariants, and draft-tree ≡ draft-branches for the drafter."""
import pytest
import torch

from treedec.decoding.drafter import Drafter
from treedec.tree import Tree, TreeError
from treedec.tree.policies import ChainPolicy, DynamicPolicy, StaticPolicy
from treedec.tree.shapes import list_shapes, load_shape

from tests.helpers import make_pair


def primed_drafter(seed=0, batch=2, prompt_len=(9, 4)):
    """A drafter after prefill on random target features (rows of different lengths)."""
    target, draft = make_pair(seed)
    g = torch.Generator().manual_seed(seed)
    L = max(prompt_len)
    d = Drafter(draft, batch, 128)
    toks = torch.randint(0, 64, (batch, L), generator=g)
    feats = torch.randn(batch, L, 64, generator=g)
    with torch.inference_mode():
        d.catch_up(toks, feats, torch.tensor(prompt_len[:batch]), list(prompt_len[:batch]), toks[:, 0])
    return d


@pytest.mark.parametrize("name", list_shapes())
def test_static_policy_grows_exactly_its_shape(name):
    d = primed_drafter()
    pol = StaticPolicy(shape=name)
    with torch.inference_mode():
        tree = pol.draft(d)
    shape = Tree.from_choices(load_shape(name))
    for b in range(2):
        assert torch.equal(tree.parents[b], shape.parents)
        assert torch.equal(tree.rank[b], shape.rank)
    # the root's rank-r child is the draft's r-th most likely token
    first = [c for c in range(len(shape)) if int(shape.parents[c]) == 0]
    top = d.root_logits.topk(len(first)).indices
    for c in first:
        assert torch.equal(tree.tokens[:, c], top[:, int(shape.rank[c])])
    assert torch.equal(tree.tokens[:, 0], d.root_tokens)


def test_chain_policy_is_a_chain():
    d = primed_drafter()
    with torch.inference_mode():
        tree = ChainPolicy(depth=6).draft(d)
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3, 4, 5]
    assert tree.depth[1].tolist() == list(range(7))
    with pytest.raises(TreeError):
        ChainPolicy(0)


@pytest.mark.parametrize("total,depth,k", [(10, 4, 3), (30, 6, 5), (61, 6, 10), (100, 3, 8)])
@pytest.mark.parametrize("seed", range(3))
def test_dynamic_tree_invariants(total, depth, k, seed):
    d = primed_drafter(seed)
    with torch.inference_mode():
        tree = DynamicPolicy(total, depth, k).draft(d)
    assert tree.size == total
    for b in range(2):
        par, dep, sc = tree.parents[b], tree.depth[b], tree.scores[b]
        assert par[0] == -1 and dep[0] == 0
        assert bool((par[1:] < torch.arange(1, total)).all())  # topological, connected to the root
        assert bool((par[1:] >= 0).all())
        assert torch.equal(dep[1:], dep[par[1:]] + 1)
        assert bool((sc[1:] <= sc[par[1:]] + 1e-6).all())  # a child never outscores its parent
        assert int(dep.max()) <= depth
        # siblings are distinct tokens with distinct ranks
        for p in set(par[1:].tolist()):
            kids = (par == p).nonzero().flatten()
            assert len(set(tree.tokens[b, kids].tolist())) == len(kids)
        Tree.from_parents(par)  # validates


def test_dynamic_tree_keeps_the_best_scored_nodes():
    """With one depth, the kept nodes are exactly the top (total-1) root children."""
    d = primed_drafter(1)
    with torch.inference_mode():
        tree = DynamicPolicy(6, 1, 10).draft(d)
    top = d.root_logits.topk(5).indices
    for b in range(2):
        assert set(tree.tokens[b, 1:].tolist()) == set(top[b].tolist())


def test_dynamic_budget_validation():
    with pytest.raises(TreeError, match="total_tokens"):
        DynamicPolicy(total_tokens=100, depth=2, top_k=3)
    with pytest.raises(TreeError):
        DynamicPolicy(total_tokens=10, depth=0, top_k=3)


@pytest.mark.parametrize("policy", [lambda: StaticPolicy(shape="eagle_mc_sim_7b_63"), lambda: DynamicPolicy(20, 5, 4)])
def test_draft_tree_equals_draft_branches(policy, monkeypatch):
    """Each drafted node's draft log-probs equal a plain one-token-at-a-time draft pass along its own path."""
    d = primed_drafter(2)
    calls = []
    real = d.expand

    def spy(tokens, parent_feats, depth, anc_rows, n_prev):
        feat, logits = real(tokens, parent_feats, depth, anc_rows, n_prev)
        calls.append((tokens, anc_rows, n_prev, feat, torch.log_softmax(logits.float(), -1)))
        return feat, logits

    monkeypatch.setattr(d, "expand", spy)
    with torch.inference_mode():
        policy().draft(d)
        inputs = []  # per forest node: (token [B], parent forest index [B] or -1, logp)
        for tokens, anc, n_prev, feat, logp in calls:
            anc = anc if anc.dim() == 3 else anc[None].expand(2, -1, -1)
            for j in range(tokens.shape[1]):
                seen = anc[:, j, : n_prev + j].clone()  # ancestors before the node itself: the parent is the latest
                idx = torch.arange(n_prev + j).expand(2, -1)
                par = torch.where(seen, idx, -1).max(1).values if n_prev + j else torch.full((2,), -1)
                assert bool(anc[:, j, n_prev + j].all())  # a node sees itself
                inputs.append((tokens[:, j], par, logp[:, j]))
        for b in range(2):
            for i, (tok, par, logp) in enumerate(inputs):
                chain, node = [], i  # walk up the forest to build this node's branch
                while node >= 0:
                    chain.append(node)
                    node = int(inputs[node][1][b])
                chain.reverse()
                cache = d.head.new_cache(1, 128)
                L = int(d.cache.lengths[b])
                cache.k[:, :, :, :L] = d.cache.k[:, b : b + 1, :, :L]
                cache.v[:, :, :, :L] = d.cache.v[:, b : b + 1, :, :L]
                cache.rollback(L)
                f = d.root_feat[b : b + 1]
                for depth, n in enumerate(chain, start=1):
                    f2 = d.head(inputs[n][0][b : b + 1, None], f[:, None], cache, torch.tensor([[L - 1 + depth]]))
                    cache.advance(1)
                    f = f2[:, 0]
                ref = torch.log_softmax(d.head.logits(f)[0].float(), -1)
                assert torch.allclose(ref, logp[b], atol=1e-4), (b, i)


def test_dynamic_scores_follow_the_sampling_temperature():
    """Scores are draft log-probs at the sampling temperature: cold sampling keeps the top path's
    score near 0, hot sampling spreads it; the drafted tokens of the root's children do not change."""
    from treedec.sampling import SamplingParams

    d = primed_drafter(3)
    with torch.inference_mode():
        cold = DynamicPolicy(6, 1, 5).draft(d, SamplingParams(0.2))
        base = DynamicPolicy(6, 1, 5).draft(d)
        hot = DynamicPolicy(6, 1, 5).draft(d, SamplingParams(2.0))
    assert torch.equal(cold.tokens, base.tokens) and torch.equal(hot.tokens, base.tokens)
    best = lambda t: t.scores[:, 1:].max(1).values  # noqa: E731
    assert bool((best(cold) > best(base)).all()) and bool((best(base) > best(hot)).all())
    want = torch.log_softmax(d.root_logits.float() / 0.2, -1).topk(5).values
    assert torch.allclose(cold.scores[:, 1:].sort(1, descending=True).values, want, atol=1e-4)


@pytest.mark.parametrize("policy", [lambda s: ChainPolicy(4, scores=s),
                                    lambda s: StaticPolicy(shape="eagle_mc_sim_7b_63", scores=s)])
def test_static_trees_skip_scores_unless_asked_and_draft_the_same_tokens(policy):
    d = primed_drafter(2)
    with torch.inference_mode():
        fast, scored = policy(False).draft(d), policy(True).draft(d)
    assert fast.scores is None and torch.equal(fast.tokens, scored.tokens)
    assert torch.equal(fast.ancestors(), scored.ancestors())
    sc, par = scored.scores[0], scored.parents[0]
    assert sc[0] == 0 and bool((sc[1:] < sc[par[1:]]).all())  # cumulative log-probs: each edge costs something


def test_a_chain_node_over_ragged_rows_sees_what_its_tree_mask_shows():
    """A chain's node (``anc_rows=None``) over rows of different lengths attends through a length mask: the same
    features and logits as the general tree mask of a node that sees every input before it."""
    d = primed_drafter(4)
    tok = torch.tensor([[5], [7]])
    feat = d.root_feat[:, None]
    with torch.inference_mode():
        for n_prev in (0, 3):
            lean = d.expand(tok, feat, depth=n_prev + 1, anc_rows=None, n_prev=n_prev)
            general = d.expand(tok, feat, depth=n_prev + 1, anc_rows=torch.ones(1, n_prev + 1, dtype=torch.bool),
                               n_prev=n_prev)
            assert torch.equal(lean[0], general[0]) and torch.equal(lean[1], general[1])


def test_a_path_of_lower_ranked_drafts_is_not_a_top1_chain():
    """Only a path of top-1 drafts takes the chain's fast paths (drafting by slices, acceptance and counts off the
    host): a static path through a runner-up child drafts that child, as its shape says."""
    d = primed_drafter(5)
    pol = StaticPolicy(choices=[[1], [1, 0]])
    assert not pol.is_chain and ChainPolicy(2).is_chain
    with torch.inference_mode():
        tree = pol.draft(d)
    assert not tree.is_chain
    assert torch.equal(tree.tokens[:, 1], d.root_logits.topk(2).indices[:, 1])


def test_the_draft_heads_rope_spans_the_targets_context():
    """An imported head whose config states a shorter context than its target's still rotates every position the
    target can reach exactly (its RoPE table is sized by the longer of the two)."""
    from treedec.models.llama import rope_cos_sin

    d = primed_drafter(6)
    head = d.head
    head.config.max_position_embeddings = 16
    head._rope_table = None
    pos = torch.tensor([[900], [1000]])
    with torch.inference_mode():
        _, cos, sin = head._mask_rope(1, d.cache, pos, "full")
    want = rope_cos_sin(pos, head.inv_freq)
    assert torch.equal(cos, want[0].to(cos.dtype)) and torch.equal(sin, want[1].to(sin.dtype))


def test_a_top1_chain_drafts_with_fewer_kernels_and_the_same_tokens():
    """The chain's lean draft (views where the general static plan runs index and index_put kernels) gives the
    general plan's tree with at least two kernels (ops other than views) fewer per depth; counts, not timings, so
    the saving is checked on any machine."""
    from treedec.profiling import count_ops

    views = {"aten::select.int", "aten::slice.Tensor", "aten::unsqueeze", "aten::view", "aten::expand",
             "aten::as_strided", "aten::alias", "aten::detach", "aten::detach_", "aten::t", "aten::transpose.int",
             "aten::reshape", "aten::_reshape_alias", "aten::squeeze.dim"}
    kernels = lambda c: sum(n for op, n in c.ops.items() if op not in views)  # noqa: E731
    d = primed_drafter(7)
    lean, general = ChainPolicy(5), ChainPolicy(5)
    general.is_chain = False  # the general static plan, for comparison
    with torch.inference_mode():
        lean.draft(d), general.draft(d)  # plans and the root's catch-up, outside the counts
        with count_ops() as a:
            t_lean = lean.draft(d)
        with count_ops() as b:
            t_general = general.draft(d)
    assert torch.equal(t_lean.tokens, t_general.tokens) and t_lean.is_chain and not t_general.is_chain
    assert kernels(b) - kernels(a) >= 2 * 5, (a.ops, b.ops)
    assert a.host_reads == b.host_reads == 0
