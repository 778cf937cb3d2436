"""The DFlash drafter: its training pass sees exactly what the drafter's block sees at decode time, ragged rows get
their own marginals, its files round-trip, and the draft cache keeps the context alone."""
import pytest
import torch

from tests.helpers import dflash_pair
from treedec.decoding.drafter import Drafter
from treedec.heads import DraftConfig, build_head, load_head


def drafter_after(head, seq: torch.Tensor, feats: torch.Tensor, a: int, flush: bool) -> Drafter:
    """A drafter whose cache holds the features of positions < a and whose root is x_a (the catch-up pending, or
    written first with ``flush``)."""
    d = Drafter(head, 1, 64)
    d.catch_up(seq[:, 1:a + 1], feats[:, :a], None, [a], seq[:, a])
    if flush:
        d.flush()
    return d


@pytest.mark.parametrize("flush", [False, True], ids=["one_pass", "context_then_block"])
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_training_pass_equals_the_drafters_marginals(seed, layers, flush):
    """Block a's training logits == the drafter's marginals after the features of positions < a with root x_a: the
    context written and the block run in one head pass, or the context first and the block after it."""
    target, head = dflash_pair(seed, K=4, layers=layers, sharpen=2.0)
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 64, (1, 16), generator=g)
    anchor = torch.tensor([1, 5, 9, 14])
    with torch.inference_mode():
        feats = head.features(target.forward_train(seq, layer_inputs=head.feature_layers_needed))
        train = head.forward_train(seq, feats, anchor, 4)  # [1, A, 4, K]
        for i, a in enumerate(anchor.tolist()):
            d = drafter_after(head, seq, feats, a, flush)
            got = d.marginals(4)
            torch.testing.assert_close(got, train[:, i], atol=2e-5, rtol=2e-5)
            assert d.cache.host_lengths == [a]  # the context stays, the block is dropped
            # a shallower tree reads the first depths of the whole block: the block it was trained at
            torch.testing.assert_close(d.marginals(2), train[:, i, :2], atol=2e-5, rtol=2e-5)


def test_ragged_rows_get_each_rows_own_marginals():
    target, head = dflash_pair(3, K=5, sharpen=2.0)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 64, (1, n), generator=g) for n in (12, 5)]
    with torch.inference_mode():
        feats = [head.features(target.forward_train(s, layer_inputs=head.feature_layers_needed)) for s in seqs]
        alone = [drafter_after(head, s, f, s.shape[1] - 1, False).marginals(5) for s, f in zip(seqs, feats)]
        W = max(s.shape[1] for s in seqs) - 1
        toks = torch.zeros(2, W, dtype=torch.long)
        fts = torch.zeros(2, W, feats[0].shape[-1])
        for b, (s, f) in enumerate(zip(seqs, feats)):
            n = s.shape[1] - 1
            toks[b, :n], fts[b, :n] = s[0, 1:], f[0, :n]
        d = Drafter(head, 2, 64)
        d.catch_up(toks, fts, None, [s.shape[1] - 1 for s in seqs], torch.stack([s[0, -1] for s in seqs]))
        both = d.marginals(5)
    for b in range(2):
        torch.testing.assert_close(both[b], alone[b][0], atol=2e-5, rtol=2e-5)


def test_save_load_round_trip(tmp_path):
    target, head = dflash_pair(0, K=4, layers=2)
    head.save(tmp_path / "h")
    back = load_head(tmp_path / "h", target=target, dtype=torch.float32)
    assert back.config.kind == "dflash" and back.config.draft_layers == 2 and back.block_size == 4
    assert all(torch.equal(back.state_dict()[k], v) for k, v in head.state_dict().items())
    assert back.layers[1].self_attn.fused and back.layers[1].mlp.fused  # prepared: every layer fused
    seq = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        feats = head.features(target.forward_train(seq, layer_inputs=head.feature_layers_needed))
        torch.testing.assert_close(drafter_after(back, seq, feats, 8, False).marginals(4),
                                   drafter_after(head, seq, feats, 8, False).marginals(4), atol=1e-5, rtol=1e-5)


def test_block_size_and_layers_must_be_positive():
    target, _ = dflash_pair(0)
    for kw in (dict(block_size=0, draft_layers=2), dict(block_size=4, draft_layers=0)):
        with pytest.raises(ValueError, match="block_size >= 1 and draft_layers >= 1"):
            build_head(DraftConfig.for_target(target.config, kind="dflash", **kw))


def test_default_feature_layers_are_dflashs():
    """One per drafter layer, from the output of target layer 1 to that of layer L-3 (treedec's ids: inputs, + 1)."""
    from treedec.models import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=36, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    got = DraftConfig.for_target(cfg, kind="dflash", draft_layers=5, block_size=15).feature_layers
    assert got == [i + 1 for i in (1, 9, 17, 25, 33)]  # z-lab/Qwen3-8B-DFlash-b16's target_layer_ids
