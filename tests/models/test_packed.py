"""Packed bf16 linears: bit for bit F.linear, re-packed when the weight changes, plain F.linear elsewhere."""
import copy

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import tiny_model
from treedec.models import load_model
from treedec.models.packed import AVAILABLE, PackedLinear, pack_linears, should_pack
from treedec.tree import Tree

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="this torch build has no oneDNN linear ops")


def packed_copy(lin: torch.nn.Linear) -> PackedLinear:
    return pack_linears(copy.deepcopy(lin))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (3, 26), (16, 4)])
def test_a_packed_linear_equals_f_linear_bit_for_bit(bias, shape):
    gen = torch.Generator().manual_seed(len(shape) + shape[1])
    lin = torch.nn.Linear(96, 160, bias=bias).to(torch.bfloat16).requires_grad_(False)
    p = packed_copy(lin)
    assert isinstance(p, PackedLinear)
    x = torch.randn(*shape, 96, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        assert p._packed is not None  # packed when made
        got = p(x)
        assert torch.equal(got, F.linear(x, lin.weight, lin.bias))
        xt = torch.randn(96, *shape, generator=gen).to(torch.bfloat16).movedim(0, -1)  # a non-contiguous input
        # (F.linear adds a bias to a strided input after rounding; the packed kernel fuses it, as for a contiguous one)
        assert torch.equal(p(xt), F.linear(xt.contiguous() if bias else xt, lin.weight, lin.bias))


def test_the_packed_copy_follows_the_weight():
    lin = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16).requires_grad_(False)
    p = packed_copy(lin)
    x = torch.randn(4, 64).to(torch.bfloat16)
    with torch.inference_mode():
        before = p(x)
    with torch.no_grad():
        p.weight.mul_(-2.0)  # in place, as an optimizer step or load_state_dict writes it
    with torch.inference_mode():
        after = p(x)
    assert torch.equal(after, F.linear(x, p.weight)) and not torch.equal(after, before)


def test_autograd_fp32_and_one_row_mode_take_plain_f_linear():
    lin = torch.nn.Linear(32, 16).to(torch.bfloat16)
    p = packed_copy(lin)
    x = torch.randn(5, 32).to(torch.bfloat16)
    packed = p._packed
    p(x).float().sum().backward()  # training: autograd through the ordinary weight
    assert p.weight.grad is not None and p._packed is packed
    with torch.inference_mode(), torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(p(x), F.linear(x, p.weight, p.bias))
    f = pack_linears(torch.nn.Linear(32, 16))
    with torch.inference_mode():
        f(torch.randn(5, 32))
    assert f._packed is None  # fp32: never packed


def test_load_model_packs_bf16_on_cpu_only_and_keeps_the_state_dict():
    bf = load_model("tiny-code", dtype="bf16")
    fp = load_model("tiny-code", dtype="fp32")
    tr = load_model("tiny-code", dtype="bf16", trainable=True)
    kinds = lambda m: {type(x) for x in m.modules() if isinstance(x, torch.nn.Linear)}
    assert kinds(bf) == {PackedLinear} and should_pack(bf)
    assert kinds(fp) == {torch.nn.Linear} and kinds(tr) == {torch.nn.Linear} and not should_pack(fp)
    assert list(bf.state_dict()) == list(tr.state_dict())


@pytest.mark.parametrize("T", [1, 5])
def test_a_packed_bf16_model_decodes_bit_for_bit_like_an_unpacked_one(T):
    plain = tiny_model(seed=4).to(torch.bfloat16)
    packed = copy.deepcopy(plain).pack()
    tree = Tree.from_parents([-1, 0, 0, 1, 3][:T])
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    out = []
    with torch.inference_mode():
        for m in (plain, packed):
            c = m.new_cache(2, 32)
            m(ids, c)
            c.advance(12)
            nxt = ids[:, :T]
            res = m(nxt, c, position_ids=c.lengths[:, None] + tree.depth, tree_mask=tree.mask()) if T > 1 else m(nxt, c)
            out.append((res.logits, c.k.clone()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_a_packed_model_deep_copies_and_its_copy_repacks():
    bf = load_model("tiny-code", dtype="bf16")
    twin = copy.deepcopy(bf)  # the bench's vanilla_fp32 copies the target
    lin = twin.model.layers[0].mlp.down_proj
    assert isinstance(lin, PackedLinear) and lin._packed is None
    x = torch.randn(3, 704).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(lin(x), bf.model.layers[0].mlp.down_proj(x)) and lin._packed is not None
        f32 = copy.deepcopy(bf).float()
        assert f32.model.layers[0].mlp.down_proj(x.float()).dtype == torch.float32


def test_packed_weight_multiplies_as_f_linear_and_only_where_packing_applies():
    """A draft head's LM rows (a plain tensor, even one made in inference mode) packed: F.linear's numbers."""
    from treedec.models.packed import packed_weight

    w = torch.randn(48, 32)
    assert packed_weight(w) is None  # fp32: nothing to pack
    with torch.inference_mode():
        wb = w.to(torch.bfloat16)  # an inference tensor (no version counter): copied into a normal one
        x = torch.randn(3, 32).to(torch.bfloat16)
        p = packed_weight(wb)
        assert torch.equal(p(x), F.linear(x, wb))


def test_the_head_dtype_measurement_needs_packing(monkeypatch):
    from treedec.models import packed

    packed.packed_bf16_is_faster.cache_clear()
    monkeypatch.setattr(packed, "AVAILABLE", False)
    assert packed.packed_bf16_is_faster(((32, 16),)) is False
    packed.packed_bf16_is_faster.cache_clear()
