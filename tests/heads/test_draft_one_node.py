"""The head's lean one-node pass (a chain's next draft) computes what its general forward computes."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import eagle3_pair, make_pair, randomize_
from treedec.decoding.drafter import Drafter
from treedec.heads import DraftHead
from treedec.profiling import count_ops
from treedec.tree.policies import ChainPolicy


def _prepared(seed: int, dtype=torch.float32, quantize=None, vocab_k: int = 0):
    target, head = make_pair(seed, vocab=96)
    randomize_(head, seed)  # an untrained head's layer is near identity: random weights test more of the maths
    if vocab_k:
        head.restrict_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(seed))[:vocab_k])
    head = head.to(dtype).prepare(target, quantize=quantize)
    return target, head


def _drafter(head, lengths: list[int], seed: int) -> Drafter:
    """A drafter whose cache holds rows of ``lengths`` (caught up over random tokens and features)."""
    B, n = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(seed)
    d = Drafter(head, B, 64)
    toks = torch.randint(0, 96, (B, n), generator=g)
    d.catch_up(toks, torch.randn(B, n, head.config.hidden_size, generator=g), None, lengths, toks[:, 0])
    with torch.inference_mode():
        d.flush()
    return d


@pytest.mark.parametrize("dtype,quantize,tol", [(torch.float32, None, 1e-5), (torch.bfloat16, None, 2e-2),
                                                (torch.float32, "int8", 1e-5)])
@pytest.mark.parametrize("lengths", [[9], [9, 9, 9], [9, 4, 7]])
@pytest.mark.parametrize("seed", range(3))
def test_one_node_pass_matches_the_general_forward(seed, lengths, dtype, quantize, tol, monkeypatch):
    """Features, logits and the keys/values written agree with the general pass (:meth:`Drafter.expand` through
    :meth:`DraftHead.forward` with its masks and positions), for a node past earlier drafts of its tree, over rows of
    one length and of several, in fp32, packed bf16 and int8; the lengths do not move."""
    target, head = _prepared(seed, dtype, quantize, vocab_k=40 if seed == 1 else 0)
    B = len(lengths)
    g = torch.Generator().manual_seed(100 + seed)
    tok = torch.randint(0, 96, (B,), generator=g)
    feat = torch.randn(B, head.config.hidden_size, generator=g).to(head.dtype)
    for depth in (1, 4):
        lean, ref = _drafter(head, lengths, seed), _drafter(head, lengths, seed)
        with torch.inference_mode():
            got = lean.expand_one(tok, feat, depth, n_prev=depth - 1)
            with monkeypatch.context() as m:
                m.setattr(DraftHead, "forward_one", lambda *a, **k: None)
                want = [x[:, 0] for x in ref.expand(tok[:, None], feat[:, None], depth, None, n_prev=depth - 1)]
        assert got is not None and got[0].dtype == head.dtype
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
        for b, n in enumerate(lengths):  # the row's prefix and its new key (slot n + depth - 1); nothing else
            slots = list(range(n)) + [n + depth - 1]
            torch.testing.assert_close(lean.cache.k[:, b, :, slots], ref.cache.k[:, b, :, slots], atol=tol, rtol=tol)
            torch.testing.assert_close(lean.cache.v[:, b, :, slots], ref.cache.v[:, b, :, slots], atol=tol, rtol=tol)
        assert lean.cache.host_lengths == lengths == lean.cache.lengths.tolist()


def test_heads_without_the_lean_pass_fall_back():
    target, eagle3 = eagle3_pair(seed=0)
    eagle3.layer.fuse()
    cache = eagle3.new_cache(1, 16)
    feat = torch.randn(1, eagle3.config.hidden_size)
    assert eagle3.forward_one(torch.tensor([3]), feat, cache, 0, 0) is None
    _, unfused = make_pair(0)
    assert unfused.forward_one(torch.tensor([3]), torch.randn(1, 64), unfused.new_cache(1, 16), 0, 0) is None
    d = Drafter(unfused, 1, 32)
    assert d.expand_one(torch.tensor([1]), torch.randn(1, 64), depth=1, n_prev=0) is None


def test_the_one_node_pass_refuses_a_full_cache():
    _, head = _prepared(0)
    cache = head.new_cache(1, 8)
    with pytest.raises(ValueError, match="KV cache overflow"):
        head.forward_one(torch.tensor([1]), torch.randn(1, 64), cache, 8, 8)
    cache.advance(5)
    head.forward_one(torch.tensor([1]), torch.randn(1, 64), cache, 2, 2)  # the last slot
    with pytest.raises(ValueError, match="KV cache overflow"):
        head.forward_one(torch.tensor([1]), torch.randn(1, 64), cache, 3, 3)


@pytest.mark.parametrize("seed", range(4))
def test_a_chain_drafts_the_same_tokens_through_the_lean_pass_with_fewer_ops(seed, monkeypatch):
    """The chain policy's draft with and without the lean pass: the same tokens at every depth, over rows of one
    length and of several (fp32), in fewer aten ops (306 against 382 for 8 nodes; most of the time saved is Python: module calls)."""
    target, head = _prepared(seed)
    g = torch.Generator().manual_seed(seed)
    lengths, depth = [[12], [12, 12], [12, 9, 11], [5, 12]][seed], 8
    B = len(lengths)

    def drafts():
        d = Drafter(head, B, 128)
        toks = torch.randint(0, 96, (B, 12), generator=copy.deepcopy(g))
        feats = torch.randn(B, 12, 64, generator=copy.deepcopy(g))
        d.catch_up(toks, feats, None, lengths, toks[:, -1])
        policy = ChainPolicy(depth)
        with torch.inference_mode():
            d.flush()
            policy.draft(d)  # (the first draft builds the policy's plans)
            with count_ops() as c:
                tree = policy.draft(d)
        return tree.tokens, c.aten_ops

    lean, lean_ops = drafts()
    monkeypatch.setattr(type(head), "forward_one", lambda *a, **k: None)
    general, general_ops = drafts()
    assert torch.equal(lean, general)
    assert lean_ops <= 0.85 * general_ops, (lean_ops, general_ops)


@pytest.mark.parametrize("lengths", [[12], [12, 9, 11]])
def test_a_scored_chain_takes_the_lean_path_with_the_general_plans_scores(lengths):
    """A chain drafted with scores (the auto budget's scored steps) goes through the lean pass too, with the general
    plan's tokens and cumulative draft log-probs; its tokens are an unscored chain's, which carries no scores."""
    target, head = _prepared(5)
    g = torch.Generator().manual_seed(5)
    B = len(lengths)
    toks = torch.randint(0, 96, (B, 12), generator=g)
    feats = torch.randn(B, 12, 64, generator=g)

    def draft(general: bool, scores: bool = True):
        d = Drafter(head, B, 128)
        d.catch_up(toks, feats, None, lengths, toks[:, -1])
        policy = ChainPolicy(6, scores=scores)
        policy.is_chain = not general  # (the general plan is what any other static shape drafts through)
        if not general:  # the lean path never runs the general expansion
            d.expand = lambda *a, **k: pytest.fail("a scored chain ran the general expansion")
        with torch.inference_mode():
            return policy.draft(d)

    lean, general, unscored = draft(False), draft(True), draft(False, scores=False)
    assert lean.is_chain and torch.equal(lean.tokens, general.tokens)
    assert torch.equal(unscored.tokens, lean.tokens) and unscored.scores is None
    torch.testing.assert_close(lean.scores, general.scores)
    assert (lean.scores[:, 1:] <= 0).all() and (lean.scores[:, 1:].diff(dim=1) <= 0).all()
