"""Tree policies: shapes, EAGLE-2 invariants, and draft-tree ≡ draft-branches for the drafter."""
import pytest
import torch

from tests.helpers import make_pair
from treedec.decoding.drafter import Drafter
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.tree import Tree, TreeError
from treedec.tree.policies import ChainPolicy, DynamicPolicy, StaticPolicy
from treedec.tree.policies.best_first import BestFirstPolicy
from treedec.tree.shapes import list_shapes, load_shape


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
        for tokens, anc, n_prev, _feat, logp in calls:
            anc = anc if anc.dim() == 3 else anc[None].expand(2, -1, -1)
            for j in range(tokens.shape[1]):
                seen = anc[:, j, : n_prev + j].clone()  # ancestors before the node itself: the parent is the latest
                idx = torch.arange(n_prev + j).expand(2, -1)
                par = torch.where(seen, idx, -1).max(1).values if n_prev + j else torch.full((2,), -1)
                assert bool(anc[:, j, n_prev + j].all())  # a node sees itself
                inputs.append((tokens[:, j], par, logp[:, j]))
        for b in range(2):
            for i, (_tok, _par, logp) in enumerate(inputs):
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
    best = lambda t: t.scores[:, 1:].max(1).values
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
    kernels = lambda c: sum(n for op, n in c.ops.items() if op not in views)
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


# ---------------------------------------------------------------- one-pass (parallel) heads


def head_passes(monkeypatch) -> dict:
    """Count every forward of a parallel head (``forward``: a catch-up; ``forward_block``: mask positions, with or
    without a catch-up before them in the same pass; ``forward_one``: an EAGLE chain node's lean pass)."""
    from treedec.heads.parallel import ParallelHead

    calls = {"forward": 0, "forward_block": 0, "forward_one": 0}
    for name in calls:
        real = getattr(ParallelHead, name)

        def counted(self, *a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(ParallelHead, name, counted)
    return calls


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_a_parallel_chain_costs_one_head_pass_per_step(depth, monkeypatch):
    """A one-pass head drafts a chain of depths 2..K with one forward over the mask positions, and a step's catch-up
    rides in that same forward: a whole generation costs one head pass per drafted step (depth 1: the catch-up
    alone), however deep the chain."""
    from tests.helpers import parallel_pair

    target, head = parallel_pair(2, K=5, sharpen=4.0)
    calls = head_passes(monkeypatch)
    dec = SpeculativeDecoder(target, head, ChainPolicy(depth), eos_ids=[])
    steps, passes = [], []
    total = lambda: calls["forward"] + calls["forward_block"] + calls["forward_one"]
    res = dec.generate([[1, 2, 3, 4], [5, 6]], 30, hook=lambda info: (steps.append(info.tree.size),
                                                                       passes.append(total())))
    assert len(steps) == res.stats.steps > 5 and all(s == depth + 1 for s in steps)
    assert passes == list(range(1, len(steps) + 1)), calls  # one pass per step, the first step's included
    assert calls["forward_one"] == 0
    assert calls["forward_block"] == (len(steps) if depth > 1 else 0), calls
    assert total() == len(steps) + 1  # and generate's end flushes the last catch-up (one more pass)
    # and drafted alone, after the catch-up: one pass over the mask positions, nothing else
    d = dec.drafter
    with torch.inference_mode():
        d.flush()
        before = dict(calls)
        tree = ChainPolicy(depth).draft(d)
    assert tree.size == depth + 1
    assert calls["forward_block"] - before["forward_block"] == (depth > 1) and calls["forward"] == before["forward"]


@pytest.mark.parametrize("policy", [lambda: ChainPolicy(5), lambda: BestFirstPolicy(12, 4)], ids=["chain", "best_first"])
def test_a_parallel_heads_mask_positions_do_not_stay_in_the_draft_cache(policy):
    """After every step the draft cache (with what is pending) holds exactly the verified prefix, as the target's
    cache does; and at the end the drafter's marginals are those of a fresh drafter that caught up on the whole
    verified sequence at once (so no mask position's key was kept, or seen, where a verified pair now is)."""
    from tests.helpers import parallel_pair
    from treedec.heads.parallel import ParallelHead

    target, head = parallel_pair(3, K=5, sharpen=4.0)
    dec = SpeculativeDecoder(target, head, policy(), eos_ids=[])
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
    accepted = [[] for _ in prompts]  # each row's tokens accepted by the steps (those past its budget too)
    checked, last_active = [], []

    def hook(info):
        d = dec.drafter
        pending = [sum(p.n_host[b] for p in d._pending) for b in range(d.batch)]
        lens = [n + k for n, k in zip(d.cache.host_lengths, pending)]
        checked.append(lens == dec.cache.host_lengths)
        for a, toks in zip(accepted, info.tokens):
            a.extend(toks)
        last_active[:] = info.active

    res = dec.generate(prompts, 25, hook=hook)
    assert len(checked) == res.stats.steps and all(checked)
    seqs = [p + out[:1] + a for p, out, a in zip(prompts, res.tokens, accepted)]  # prompt, the prefill's token, steps'
    for b, s in enumerate(seqs):
        assert s[len(prompts[b]):][:25] == res.tokens[b]
    with torch.inference_mode():
        got = dec.drafter.marginals(5).float()
        for b, s in enumerate(seqs):
            ids = torch.tensor([s])
            feats = head.features(target.forward_train(ids, layer_inputs=head.feature_layers_needed)).float()
            fresh = Drafter(head, 1, 128)
            fresh.catch_up(ids[:, 1:], feats[:, :-1], None, [len(s) - 1], ids[:, -1])
            want = fresh.marginals(5)[0].float()
            # depth 1 is the root's: a row that finished before the last step keeps its cache but not its root state
            # (the step's catch-up of no pair leaves it undefined, and nothing reads it); its mask positions still see
            # its own prefix alone
            d0 = 0 if last_active[b] else 1
            torch.testing.assert_close(got[b, d0:], want[d0:], rtol=1e-4, atol=1e-4)
            assert fresh.cache.host_lengths == [len(s) - 1]
    assert any(last_active) and not all(last_active)  # (both kinds of row were checked)
    assert isinstance(head, ParallelHead)


def test_a_catch_up_and_its_mask_positions_in_one_pass_equal_the_two_passes():
    """Drafter.marginals with a catch-up pending (one forward: the catch-up, then the mask positions) gives the same
    marginals and draft cache as flushing the catch-up first and then running the mask positions: over ragged rows
    (a row whose catch-up is shorter than the step's widest, so padding sits between its pairs and its mask
    positions) and packed catch-ups of several steps."""
    from tests.helpers import parallel_pair

    target, head = parallel_pair(4, K=5, sharpen=2.0)
    g = torch.Generator().manual_seed(4)
    F = 3 * 64

    def run(fused: bool):
        d = Drafter(head, 3, 128)
        out = []
        with torch.inference_mode():
            for lens in [(5, 9, 2), (1, 3, 2), (2, 1, 4), (3, 3, 3)]:
                w = max(lens)
                toks = torch.randint(0, 64, (3, w), generator=torch.Generator().manual_seed(sum(lens) * 7 + w))
                feats = torch.randn(3, w, F, generator=torch.Generator().manual_seed(sum(lens) * 11 + w))
                d.catch_up(toks, feats, torch.tensor(lens), list(lens), toks[torch.arange(3), torch.tensor(lens) - 1])
                if len(out) == 1:  # two catch-ups pending at once: packed before the pass
                    out.append(None)
                    continue
                if not fused:
                    d.flush()
                out.append(d.marginals(4).float())
                assert d.cache.host_lengths == [int(x) for x in d.cache.lengths]
            return out, list(d.cache.host_lengths), d.cache.k[..., : min(d.cache.host_lengths), :].clone()

    (one, lens1, k1), (two, lens2, k2) = run(True), run(False)
    assert lens1 == lens2
    for a, b in zip(one, two):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-4)
    del g
