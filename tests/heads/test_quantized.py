"""draft.quantize=int8: int8 weights for a draft head's few-row passes; drafts change at most at near-ties, the
output never."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import greedy_reference, make_pair
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.heads import build_head, load_head
from treedec.heads.quantized import Int8Linear, int8_is_faster, is_quantized, quantize_linears
from treedec.tree.policies import AutoPolicy, ChainPolicy, DynamicPolicy, StaticPolicy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_the_rounded_weight_for_few_rows_and_the_dense_one_for_many(dtype):
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 40).to(dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g))
        lin.bias.copy_(torch.randn(40, generator=g))
    q = Int8Linear.of(lin)
    assert q.qweight.dtype == torch.int8 and q.scale.dtype == dtype
    # the int8 weight is the weight to within half a quantization step per row
    assert ((q.dequantized(torch.float32) - lin.weight.float()).abs() <= q.scale.float()[:, None] / 2 + 1e-3).all()
    for rows in (1, 3, Int8Linear.max_rows):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        want = F.linear(x.float(), q.dequantized(torch.float32), lin.bias.float())
        got = q(x)
        assert got.dtype == dtype and got.shape == (rows, 40)
        assert torch.allclose(got.float(), want, rtol=2e-2, atol=0.3 if dtype == torch.bfloat16 else 1e-3)
        assert not torch.equal(got, lin(x))  # really the int8 weight, not the dense one
    x = torch.randn(2, Int8Linear.max_rows, 96, generator=g).to(dtype)  # 16 rows: the full-precision linear
    assert torch.equal(q(x), lin(x))


def test_quantize_linears_skips_the_named_prefixes():
    m = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8)))
    m._lm_rows = nn.Linear(8, 8)
    quantize_linears(m, skip=("_lm_",))
    assert isinstance(m[0], Int8Linear) and isinstance(m[1][0], Int8Linear) and type(m._lm_rows) is nn.Linear
    assert is_quantized(m) and not is_quantized(nn.Linear(2, 2))


def _quantized_pair(seed: int, **kw):
    target, draft = make_pair(seed, **kw)
    q = build_head(draft.config).eval()
    q.load_state_dict(draft.state_dict())
    return target, draft.prepare(target), q.prepare(target, quantize="int8")


def test_a_quantized_head_drafts_the_full_heads_tokens_but_at_near_ties():
    target, full, q = _quantized_pair(0, peaked=4.0)
    assert isinstance(q.fc, Int8Linear) and isinstance(q.layer.mlp.gate_up_proj, Int8Linear) and q._lm_int8
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(4, 1, target.config.hidden_size, generator=g)
    a, b = full.logits(feats), q.logits(feats)
    assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
    assert not torch.equal(a, b)  # the int8 rows were used


POLICIES = {"chain": lambda: ChainPolicy(depth=4), "static": lambda: StaticPolicy(shape="balanced_2x3"),
            "dynamic": lambda: DynamicPolicy(total_tokens=16, depth=5, top_k=3),
            "auto": lambda: AutoPolicy(max_depth=5, top_k=3, max_total_tokens=16)}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("seed", range(3))
def test_greedy_output_with_a_quantized_head_is_vanillas(policy, seed):
    """Rows of 1, 3 and 10 prompts: head passes of few rows (int8) and of many (the dense linears)."""
    target, _, q = _quantized_pair(seed, peaked=3.0)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
               for _ in range(10)]
    refs = [greedy_reference(target, p, 60) for p in prompts]
    dec = SpeculativeDecoder(target, q, POLICIES[policy]())
    for rows in (prompts[:1], prompts[:3], prompts):
        assert dec.generate(rows, 60).tokens == refs[: len(rows)]


def test_a_quantized_head_is_not_saved_and_bad_values_are_named(tmp_path):
    target, full, q = _quantized_pair(0)
    with pytest.raises(ValueError, match="int8"):
        q.save(tmp_path / "q")
    assert not (tmp_path / "q").exists()
    full.save(tmp_path / "full")
    with pytest.raises(ValueError, match="draft.quantize='int4'.*auto or int8"):
        load_head(tmp_path / "full", target=target, quantize="int4")
    assert isinstance(load_head(tmp_path / "full", target=target, quantize="int8").fc, Int8Linear)
    auto = load_head(tmp_path / "full", target=target, quantize="auto")
    assert is_quantized(auto) == int8_is_faster(auto._linear_shapes(), auto.dtype)


@pytest.mark.parametrize("seed", range(2))
def test_an_int8_eagle3_head_quantizes_its_own_lm_head_and_stays_lossless(seed):
    from tests.helpers import eagle3_pair

    target, head = eagle3_pair(seed)
    q = build_head(head.config).eval()
    q.load_state_dict(head.state_dict())
    q = q.prepare(target, quantize="int8")
    assert isinstance(q.lm_head, Int8Linear) and isinstance(q.fc, Int8Linear) and q._lm_int8 is None
    assert all(type(m) is not Int8Linear for m in target.modules())  # the target is never touched
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (4, 19, 33)]
    refs = [greedy_reference(target, p, 50) for p in prompts]
    assert SpeculativeDecoder(target, q, DynamicPolicy(total_tokens=12, depth=4, top_k=3)).generate(
        prompts, 50).tokens == refs
