"""The head's lean one-node pass (a chain's next draft) computes what its general forward computes."""
from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import eagle3_pair, make_pair, randomize_
from treedec.decoding.drafter import Drafter
from treedec.profiling import count_ops
from treedec.tree.policies import ChainPolicy


def _prepared(seed: int, dtype=torch.float32, quantize=None, vocab_k: int = 0):
    target, head = make_pair(seed, vocab=96)
    randomize_(head, seed)  # an untrained head's layer is near identity: random weights test more of the maths
    if vocab_k:
        head.restrict_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(seed))[:vocab_k])
    head = head.to(dtype).prepare(target, quantize=quantize)
    return target, head


def _filled_cache(head, B: int, length: int, seed: int):
    cache = head.new_cache(B, 64)
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 96, (B, length), generator=g)
    feats = torch.randn(B, length, head.config.hidden_size, generator=g).to(head.dtype)
    with torch.inference_mode():
        head(toks, feats, cache, torch.arange(length)[None].expand(B, -1))
    cache.advance(length)
    return cache


@pytest.mark.parametrize("dtype,quantize,tol", [(torch.float32, None, 1e-5), (torch.bfloat16, None, 2e-2),
                                                (torch.float32, "int8", 1e-5)])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_one_node_pass_matches_the_general_forward(seed, B, dtype, quantize, tol):
    """Features and the key/value written agree with :meth:`DraftHead.forward` of the same node, for a node written
    past earlier drafts of its tree (slot) at another RoPE position than its slot, in fp32, packed bf16 and int8."""
    target, head = _prepared(seed, dtype, quantize, vocab_k=40 if seed == 1 else 0)
    g = torch.Generator().manual_seed(100 + seed)
    tok = torch.randint(0, 96, (B,), generator=g)
    feat = torch.randn(B, head.config.hidden_size, generator=g).to(head.dtype)
    for n_prev in (0, 3):
        lean, ref = _filled_cache(head, B, 9, seed), _filled_cache(head, B, 9, seed)
        slot, position = 9 + n_prev, 9 - 1 + n_prev + 1
        with torch.inference_mode():
            got = head.forward_one(tok, feat, lean, slot, position)
            ref.advance(n_prev)
            want = head(tok[:, None], feat[:, None], ref, torch.full((B, 1), position), "full")[:, 0]
        assert got is not None and got.dtype == head.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(lean.k[:, :, :, : slot + 1], ref.k[:, :, :, : slot + 1], atol=tol, rtol=tol)
        torch.testing.assert_close(lean.v[:, :, :, : slot + 1], ref.v[:, :, :, : slot + 1], atol=tol, rtol=tol)
        assert lean.host_lengths == [9] * B  # the length does not move


def test_heads_without_the_lean_pass_fall_back():
    target, eagle3 = eagle3_pair(seed=0)
    eagle3.layer.fuse()
    cache = eagle3.new_cache(1, 16)
    feat = torch.randn(1, eagle3.config.hidden_size)
    assert eagle3.forward_one(torch.tensor([3]), feat, cache, 0, 0) is None
    _, unfused = make_pair(0)
    assert unfused.forward_one(torch.tensor([3]), torch.randn(1, 64), unfused.new_cache(1, 16), 0, 0) is None
    _, head = _prepared(0)
    d = Drafter(head, 2, 32)
    d.cache.advance([4, 6])  # rows of several lengths: the general pass (its masks) is needed
    assert d.expand_one(torch.tensor([1, 2]), torch.randn(2, 64), depth=1, n_prev=0) is None


def test_the_one_node_pass_refuses_a_full_cache():
    _, head = _prepared(0)
    cache = head.new_cache(1, 8)
    with pytest.raises(ValueError, match="KV cache overflow"):
        head.forward_one(torch.tensor([1]), torch.randn(1, 64), cache, 8, 8)


@pytest.mark.parametrize("seed", range(4))
def test_a_chain_drafts_the_same_tokens_through_the_lean_pass_with_fewer_ops(seed, monkeypatch):
    """The chain policy's draft with and without the lean pass: the same tokens at every depth over several steps
    (fp32), in fewer aten ops (306 against 382 for 8 nodes; most of the time saved is Python: module calls)."""
    target, head = _prepared(seed)
    g = torch.Generator().manual_seed(seed)
    B, depth = 1 + seed % 2, 8

    def drafts():
        d = Drafter(head, B, 128)
        toks = torch.randint(0, 96, (B, 12), generator=copy.deepcopy(g))
        feats = torch.randn(B, 12, 64, generator=copy.deepcopy(g))
        d.catch_up(toks, feats, None, [12] * B, toks[:, -1])
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
