"""A head's bf16 copy for wide batches: an fp32 head keeps a packed bf16 copy for the batches where that drafts faster."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import eagle3_pair, make_pair
from treedec.decoding.speculative import CompactingDecoder
from treedec.decoding.vanilla import VanillaDecoder
from treedec.heads import dtype as draft_dtype
from treedec.heads import load_head
from treedec.models.packed import PackedLinear
from treedec.tree.policies import AutoPolicy, ChainPolicy, DynamicPolicy


def test_auto_dtype_gives_an_fp32_head_a_bf16_copy_from_the_measured_batch(tmp_path, monkeypatch):
    target, head = make_pair(seed=3)
    target = target.to(torch.bfloat16)
    head.bind(target).save(tmp_path)
    monkeypatch.setattr(draft_dtype, "packed_bf16_is_faster", lambda shapes, rows=4: rows >= 16)
    loaded = load_head(tmp_path, target=target, dtype="auto")
    assert loaded.dtype == torch.float32
    assert loaded.for_batch(8) is loaded and loaded.for_batch(15) is loaded
    copy = loaded.for_batch(16)
    assert copy is loaded.for_batch(64) and copy is not loaded
    assert copy.dtype == torch.bfloat16 and isinstance(copy.fc, PackedLinear) and copy.target is target
    # the same weights, rounded; the copy is no part of the head's state or files
    for (name, a), (_, b) in zip(loaded.state_dict().items(), copy.state_dict().items()):
        assert torch.equal(a.to(torch.bfloat16), b), name
    assert not any("wide" in k for k in loaded.state_dict())
    loaded.save(tmp_path / "again")
    assert load_head(tmp_path / "again", target=target).dtype == torch.float32
    # a rebound head rebinds its copy
    other = make_pair(seed=4)[0].to(torch.bfloat16)
    with pytest.warns(UserWarning, match="fingerprint"):
        loaded.bind(other)
    assert loaded.for_batch(16).target is other
    # measured slower at every batch tried, explicit dtypes, fp32 targets: no copy
    monkeypatch.setattr(draft_dtype, "packed_bf16_is_faster", lambda shapes, rows=4: False)
    assert load_head(tmp_path, target=target, dtype="auto").for_batch(1024).dtype == torch.float32
    monkeypatch.setattr(draft_dtype, "packed_bf16_is_faster", lambda shapes, rows=4: rows >= 16)
    assert load_head(tmp_path, target=target, dtype="fp32").for_batch(1024).dtype == torch.float32
    assert load_head(tmp_path, target=target.float(), dtype="auto").for_batch(1024).dtype == torch.float32


def test_a_quantized_head_refuses_a_bf16_copy(tmp_path):
    target, head = make_pair(seed=3)
    head.save(tmp_path)
    q = load_head(tmp_path, target=target, quantize="int8")
    with pytest.raises(ValueError, match="int8"):
        q.add_bf16_for_wide_batches(2)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("policy", [lambda: ChainPolicy(4), lambda: DynamicPolicy(10, 3, 3),
                                    lambda: AutoPolicy(max_depth=4, top_k=3)])
def test_wide_batches_draft_with_the_bf16_copy_and_stay_lossless(policy, kind):
    """fp32 target: batches of 3+ rows draft with the bf16 copy, narrower ones with the head, every output exactly
    vanilla's; prompts admitted into a served batch's slots draft with the batch's head. EAGLE-3 heads too (their
    own LM head and draft vocabulary come along)."""
    target, head = make_pair(seed=5, vocab=96) if kind == "eagle" else eagle3_pair(5, vocab=96, k=40)
    head.add_bf16_for_wide_batches(3)
    assert type(head.for_batch(3)) is type(head)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 96, (int(n),), generator=g).tolist() for n in torch.randint(2, 30, (7,), generator=g)]
    want = VanillaDecoder(target).generate(prompts, 40).tokens
    for rows, slots, dtype in ((prompts[:2], None, torch.float32), (prompts[:5], None, torch.bfloat16),
                               (prompts, 3, torch.bfloat16), (prompts, 2, torch.float32)):
        dec = CompactingDecoder(target, head, policy())
        got = dec.serve(rows, 40, slots=slots)
        assert got.tokens == want[: len(rows)]
        assert dec.drafter.head.dtype == dtype and dec.drafter.cache.k.dtype == dtype
