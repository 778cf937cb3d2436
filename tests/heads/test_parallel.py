"""The one-pass (P-EAGLE) head: its training pass sees exactly what the drafter's mask positions see at decode time,
its files round-trip, an EAGLE-3 head converts into one, and a head of several layers (published P-EAGLE drafters
have 4) runs all of them on every path and stays lossless."""
from dataclasses import replace

import pytest
import torch

from tests.helpers import eagle3_pair, greedy_reference, parallel_pair, randomize_
from treedec.decoding.drafter import Drafter
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.heads import DraftConfig, build_head, load_head
from treedec.heads.parallel import ParallelHead, block_mask, cod_sample
from treedec.tree.policies import ChainPolicy
from treedec.tree.policies.best_first import BestFirstPolicy


def layered_pair(seed: int, layers: int, **kw):
    """:func:`parallel_pair`'s target and head, the head with ``layers`` - 1 random plain layers after its midlayer."""
    target, head = parallel_pair(seed, **kw)
    if layers == 1:
        return target, head
    deep = ParallelHead(replace(head.config, draft_layers=layers))
    missing, unexpected = deep.load_state_dict(head.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("layers_after.") for k in missing)
    randomize_(deep.layers_after, seed + 7)
    return target, deep.eval().bind(target)


def test_block_mask_lets_a_mask_element_see_its_anchors_prefix_and_its_block_up_to_itself():
    m = block_mask(4, torch.tensor([1, 2, 1, 2]), torch.tensor([1, 1, 2, 2]))
    assert m.shape == (8, 8)
    assert m[:4, :4].equal(torch.ones(4, 4, dtype=torch.bool).tril()) and not m[:4, 4:].any()
    assert m[4].tolist() == [1, 1, 0, 0, 1, 0, 0, 0]  # (anchor 1, depth 1)
    assert m[6].tolist() == [1, 1, 0, 0, 1, 0, 1, 0]  # (anchor 1, depth 2)
    assert m[7].tolist() == [1, 1, 1, 0, 0, 1, 0, 1]  # (anchor 2, depth 2)


def test_cod_sample_keeps_fewer_anchors_deeper_and_each_block_a_prefix_of_depths():
    g = torch.Generator().manual_seed(0)
    anchor, depth = cod_sample(100, 7, lambda n: torch.rand(n, generator=g))
    counts = [int((depth == j).sum()) for j in range(1, 8)]
    want = [int((99 - j) * max(0.7 ** j, 0.2)) for j in range(1, 8)]
    assert counts[0] == want[0] and all(c <= w for c, w in zip(counts, want))
    assert all(a >= b for a, b in zip(counts, counts[1:])) and counts[-1] >= want[-1] - 2
    pairs = set(zip(anchor.tolist(), depth.tolist()))
    assert all((a, j - 1) in pairs for a, j in pairs if j > 1)  # a block holds depths 1..j
    assert all(a + j <= 99 for a, j in pairs)  # every element has a target


@pytest.mark.parametrize("flush", [False, True], ids=["one_pass", "catch_up_then_mask"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_training_pass_equals_the_drafters_marginals(seed, layers, flush):
    """Depth d's training output at anchor a == the drafter's depth-d marginal after the prefix up to a, for every a:
    the catch-up and the mask positions in one forward (``forward_block``), or the catch-up through ``forward``
    first and the mask positions after it (``forward_mask``)."""
    target, head = layered_pair(seed, layers)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (1, 14), generator=g)
    with torch.inference_mode():
        out = target.forward_train(ids, layer_inputs=head.feature_layers_needed)
        feats = head.features(out).float()
        tokens = ids[:, 1:]
        anchors, K = [2, 5, 9], head.block_size
        anchor = torch.tensor([a for a in anchors for _ in range(1, K)])
        depth = torch.tensor([j for _ in anchors for j in range(1, K)])
        first, rest = head.forward_train(tokens, feats[:, :-1], anchor, depth)
        for i, a in enumerate(anchors):
            d = Drafter(head, 1, 64)
            n = a + 1  # verified pairs 0..a; the root is tokens[a]
            d.catch_up(tokens[:, :n], feats[:, :n], None, [n], tokens[:, a])
            if flush:
                d.flush()
            m = d.marginals(head.block_size)
            torch.testing.assert_close(m[:, 0], first[:, a], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(m[0, 1:], rest[0, i * (K - 1):(i + 1) * (K - 1)], rtol=1e-4, atol=1e-4)
            assert d.cache.host_lengths == [n]  # the mask positions were not kept


def test_ragged_rows_get_each_rows_own_marginals():
    target, head = parallel_pair(3)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    with torch.inference_mode():
        feats = head.features(target.forward_train(ids, layer_inputs=head.feature_layers_needed)).float()
        tokens, lens = ids[:, 1:], [7, 10]
        both = Drafter(head, 2, 64)
        both.catch_up(tokens[:, :10], feats[:, :10], None, lens, tokens[torch.arange(2), torch.tensor(lens) - 1])
        got = both.marginals(4)
        for b, n in enumerate(lens):
            one = Drafter(head, 1, 64)
            one.catch_up(tokens[b:b + 1, :n], feats[b:b + 1, :n], None, [n], tokens[b:b + 1, n - 1])
            torch.testing.assert_close(got[b], one.marginals(4)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layers", [1, 2])
def test_save_load_round_trip_and_conversion_keeps_the_eagle3_weights(layers, tmp_path):
    target, head = layered_pair(4, layers)
    head.save(tmp_path / "p")
    back = load_head(tmp_path / "p", target=target)
    assert isinstance(back, ParallelHead) and back.block_size == head.block_size
    assert back.config.draft_layers == layers and back.new_cache(1, 4).k.shape[0] == layers
    assert all(layer.self_attn.fused and layer.mlp.fused for layer in back.layers_after)  # prepare fused them all
    torch.testing.assert_close(back.mask_hidden, head.mask_hidden)
    ids = torch.randint(0, 64, (1, 9))
    with torch.inference_mode():
        feats = head.features(target.forward_train(ids, layer_inputs=head.feature_layers_needed)).float()
        for h in (head, back):
            d = Drafter(h, 1, 32)
            d.catch_up(ids[:, 1:], feats[:, :-1], None, [8], ids[:, -1])
            h.last = d.marginals(5)
    torch.testing.assert_close(back.last, head.last, rtol=1e-4, atol=1e-4)


def test_block_size_and_layers_must_be_positive():
    target, e3 = eagle3_pair(0)
    with pytest.raises(ValueError, match="block_size"):
        build_head(DraftConfig.for_target(target.config, kind="parallel", block_size=0))
    with pytest.raises(ValueError, match="draft_layers >= 1"):
        build_head(DraftConfig.for_target(target.config, kind="parallel", block_size=4, draft_layers=0))
    with pytest.raises(ValueError, match="an EAGLE-3 head has one decoder layer"):  # several: a parallel head only
        build_head(DraftConfig.for_target(target.config, kind="eagle3", draft_layers=2))


@pytest.mark.parametrize("policy", ["chain", "best_first"])
@pytest.mark.parametrize("seed", [0, 1])
def test_two_layer_head_is_lossless(policy, seed):
    """Greedy output with a 2-layer head is vanilla's, one row and a ragged batch of three (the draft cache holds
    both layers' keys, each row's own prefix)."""
    target, head = layered_pair(seed, 2, K=5, sharpen=4)
    make = {"chain": lambda: ChainPolicy(depth=5), "best_first": lambda: BestFirstPolicy(total_tokens=16, depth=4)}
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 17, 29)]
    refs = [greedy_reference(target, p, 60) for p in prompts]
    assert SpeculativeDecoder(target, head, make[policy]()).generate(prompts[1], 60).tokens[0] == refs[1]
    assert SpeculativeDecoder(target, head, make[policy]()).generate(prompts, 60).tokens == refs
