"""Every tree-attention backend against an independent fp64 reference, plus input validation.

The triton backend runs under the interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1), so shapes stay small; kernel-specific cases live in
test_triton_kernel.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import HAVE_TRITON, NO_TRITON
from treedec.attention import BACKENDS, tree_attention
from treedec.tree import Tree

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL = [pytest.param(b, marks=pytest.mark.skipif(b == "triton" and not HAVE_TRITON, reason=NO_TRITON))
       for b in BACKENDS]


def run(case, backend, **kw):
    return tree_attention(case.q, case.k, case.v, case.bits, case.prefix_lens, backend=backend, **kw)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("T,prefix", [(1, 0), (1, 9), (2, 1), (17, 0), (64, 70), (65, 3)])
def test_chain_equals_causal_attention(attn_cases, backend, T, prefix):
    """A chain is plain causal attention over prefix + chain (checked with is_causal SDPA)."""
    case = attn_cases.make(B=1, Hq=4, Hkv=2, T=T, D=16, prefix_lens=(prefix,), parents="chain", extra=0,
                           device=DEVICE)
    out = run(case, backend)
    n = prefix + T
    q_full = torch.cat([torch.zeros(1, 4, prefix, 16, device=DEVICE), case.q], dim=2).double()
    k_full = case.k[:, :, :n].double().repeat_interleave(2, dim=1)
    v_full = case.v[:, :, :n].double().repeat_interleave(2, dim=1)
    causal = F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=True)[:, :, prefix:]
    torch.testing.assert_close(out.double(), causal, **attn_cases.tol(torch.float32, DEVICE))


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("T", [1, 9, 70])
def test_star(attn_cases, backend, T):
    case = attn_cases.make(Hq=2, Hkv=2, T=T, prefix_lens=(5,), parents="star", device=DEVICE)
    attn_cases.check(run(case, backend), case, torch.float32)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize(
    "T,prefix,Hq,Hkv,D",
    [
        (1, 0, 4, 1, 16),
        (3, 1, 8, 1, 32),     # G = 8
        (7, 65, 4, 1, 24),    # D not a power of two, prefix past one block
        (16, 0, 4, 4, 16),    # no prefix
        (33, 127, 2, 1, 16),  # prefix one short of two blocks
        (64, 64, 2, 2, 16),   # one full word of bits
        (100, 10, 4, 2, 16),  # two words
        (130, 3, 1, 1, 16),   # three words
    ],
)
def test_random_tree(attn_cases, backend, T, prefix, Hq, Hkv, D):
    case = attn_cases.make(Hq=Hq, Hkv=Hkv, T=T, D=D, prefix_lens=(prefix,), seed=T + prefix, device=DEVICE)
    attn_cases.check(run(case, backend), case, torch.float32)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("per_row", [False, True])
def test_ragged_batch(attn_cases, backend, per_row):
    """Rows with different prefix lengths, with one shared tree or one tree per row ([B, T, W] bits)."""
    case = attn_cases.make(B=4, Hq=4, Hkv=1, T=20, prefix_lens=(0, 37, 69, 1), per_row=per_row, seed=3,
                           device=DEVICE)
    if per_row:
        assert case.bits.dim() == 3 and len({tuple(p) for p in case.parents}) > 1
    attn_cases.check(run(case, backend), case, torch.float32)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (4, 4)])
def test_sdpa_folded_query_groups(attn_cases, monkeypatch, per_row, Hq, Hkv):
    """A batch wide enough to fold each K/V head's query heads into its rows (with the mask folded
    here or inside) matches the fp64 reference and, bit for bit, the unfolded enable_gqa path."""
    from treedec.attention import dense_mask, fold_query_groups, query_fold, reference

    B = 16 // Hkv
    assert query_fold(B, Hq, Hkv, 6) == Hq // Hkv and query_fold(1, Hq, Hkv, 6) == 1
    case = attn_cases.make(B=B, Hq=Hq, Hkv=Hkv, T=6, D=16, prefix_lens=tuple(range(3, 3 + 5 * B, 5)),
                           per_row=per_row, seed=5)
    mask = dense_mask(case.bits, case.prefix_lens, 6, case.k.shape[2])[:, None]
    folded = fold_query_groups(mask, Hq // Hkv)
    assert folded.shape[-2] == 6 * (Hq // Hkv)
    outs = [run(case, "sdpa"), run(case, "sdpa", mask=mask), run(case, "sdpa", mask=folded)]
    monkeypatch.setattr(reference, "query_fold", lambda B, Hq, Hkv, T: 1)
    plain = run(case, "sdpa", mask=mask)
    for out in outs:
        attn_cases.check(out, case, torch.float32)
        assert torch.equal(out, plain)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("T,prefix,G", [(5, 11, 1), (24, 40, 4)])
def test_fp16(attn_cases, backend, T, prefix, G):
    case = attn_cases.make(Hq=2 * G, Hkv=2, T=T, D=32, prefix_lens=(prefix,), dtype=torch.float16, device=DEVICE)
    attn_cases.check(run(case, backend), case, torch.float16)


@pytest.mark.parametrize("backend", ALL)
def test_explicit_scale(attn_cases, backend):
    case = attn_cases.make(Hq=2, Hkv=1, T=6, prefix_lens=(9,), device=DEVICE)
    ref = attn_cases.reference(case.q, case.k, case.v, case.parents, case.prefix_lens, scale=0.3)
    out = run(case, backend, scale=0.3)
    torch.testing.assert_close(out.double().cpu(), ref, **attn_cases.tol(torch.float32, DEVICE))


@pytest.mark.parametrize("backend", ALL)
def test_invisible_keys_do_not_matter(attn_cases, backend):
    """Changing K/V of a non-ancestor tree node, or keys past prefix_len + T, leaves rows unchanged."""
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]  # node 6's ancestry: 0, 1, 3; node 7's: 0, 2, 5
    case = attn_cases.make(B=2, Hq=4, Hkv=2, T=8, prefix_lens=(10, 4), parents=parents, extra=6, device=DEVICE)
    base = run(case, backend)

    k2, v2 = case.k.clone(), case.v.clone()
    for b, L in enumerate(case.prefix_lens.tolist()):
        k2[b, :, L + 5] += 100.0  # node 5: not an ancestor of 6 (nor of 1, 3, 4)
        v2[b, :, L + 5] -= 50.0
        k2[b, :, L + 8:] = 1e3  # past the tree: never visible
        v2[b, :, L + 8:] = -1e3
    out = tree_attention(case.q, k2, v2, case.bits, case.prefix_lens, backend=backend)
    unaffected = [0, 1, 2, 3, 4, 6]
    torch.testing.assert_close(out[:, :, unaffected], base[:, :, unaffected], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(out[:, :, [5, 7]], base[:, :, [5, 7]])  # its own subtree does change


def _swap_children_preorder(parents: list[int], node: int) -> list[int]:
    """DFS preorder (a topological order) with ``node``'s children visited in reverse."""
    children: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        children[p].append(i)
    order, stack = [], [0]
    while stack:
        i = stack.pop()
        order.append(i)
        kids = children[i][::-1] if i == node else children[i]
        stack.extend(reversed(kids))
    return order


@pytest.mark.parametrize("backend", ALL)
def test_sibling_permutation_permutes_outputs(attn_cases, backend):
    """Relabelling a tree (swapping two sibling subtrees) permutes the outputs the same way."""
    parents = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 6, 3]
    case = attn_cases.make(B=1, Hq=2, Hkv=1, T=len(parents), prefix_lens=(13,), parents=parents, extra=0,
                           device=DEVICE)
    out = run(case, backend)
    order = _swap_children_preorder(parents, node=0)  # root's subtrees now come as 3, 2, 1
    assert order != list(range(len(parents))) and order[1] == 3
    inv = {old: new for new, old in enumerate(order)}
    new_parents = [-1] + [inv[parents[old]] for old in order[1:]]
    L = 13
    idx = torch.tensor(order, device=DEVICE)
    k2, v2 = case.k.clone(), case.v.clone()
    k2[:, :, L:] = case.k[:, :, L + idx]
    v2[:, :, L:] = case.v[:, :, L + idx]
    bits2 = Tree.from_parents(new_parents).ancestor_bits().to(DEVICE)
    out2 = tree_attention(case.q[:, :, idx], k2, v2, bits2, case.prefix_lens, backend=backend)
    torch.testing.assert_close(out2, out[:, :, idx], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ALL)
def test_trusted_calls_match_and_read_nothing(attn_cases, backend):
    """What a model does per layer: a precomputed tree_dense_mask (eager/sdpa) or check=False (triton).

    Same result as the validated call, and no host read (validation reads prefix_lens)."""
    from treedec.attention import tree_dense_mask
    from treedec.attention.layout import unpack_bits
    from treedec.profiling import count_ops

    case = attn_cases.make(B=3, Hq=4, Hkv=2, T=9, prefix_lens=(0, 6, 13), per_row=True, extra=0, device=DEVICE)
    want = run(case, backend)
    mask = None if backend == "triton" else tree_dense_mask(unpack_bits(case.bits, case.T), case.prefix_lens,
                                                            case.k.shape[2])
    with count_ops() as c:
        got = run(case, backend, mask=mask, check=False)
    assert c.host_reads == 0
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with count_ops() as c:
        run(case, backend)
    assert c.host_reads > 0  # the validated call does read (so the count above means something)


# ------------------------------------------------------------------------------- validation
def _inputs(B=1, Hq=4, Hkv=2, T=5, S=12, D=16):
    return (torch.randn(B, Hq, T, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D),
            Tree.chain(T).ancestor_bits(), torch.full((B,), 3, dtype=torch.long))


def _bad(kind):
    q, k, v, bits, pl = _inputs()
    if kind == "kv shape":
        v = torch.randn(1, 2, 11, 16)
    elif kind == "head dim":
        k, v = torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    elif kind == "gqa":
        q = torch.randn(1, 3, 5, 16)
    elif kind == "narrow bits":
        q, k, v = torch.randn(1, 4, 65, 16), torch.randn(1, 2, 80, 16), torch.randn(1, 2, 80, 16)
        bits = torch.zeros(65, 1, dtype=torch.long)
    elif kind == "bits rows":
        bits = Tree.chain(4).ancestor_bits()
    elif kind == "bits batch":
        bits = torch.stack([bits] * 3)
    elif kind == "bits dtype":
        bits = bits.int()
    elif kind == "too few keys":
        pl = torch.tensor([8])
    elif kind == "prefix count":
        pl = torch.tensor([1, 2])
    elif kind == "negative prefix":
        pl = torch.tensor([-1])
    elif kind == "rank":
        q = q[0]
    return q, k, v, bits, pl


@pytest.mark.parametrize(
    "kind,message",
    [
        ("kv shape", "k and v shapes differ"),
        ("head dim", "do not match q"),
        ("gqa", "multiple of key/value heads"),
        ("narrow bits", "too narrow for T=65"),
        ("bits rows", "ancestor_bits must be"),
        ("bits batch", "per-row ancestor_bits has batch 3"),
        ("bits dtype", "must be int64"),
        ("too few keys", "exceeds the 12 keys"),
        ("prefix count", "prefix_lens has 2 entries"),
        ("negative prefix", "must be >= 0"),
        ("rank", "must be 4-D"),
    ],
)
@pytest.mark.parametrize("backend", ALL)
def test_bad_inputs_raise(kind, message, backend):
    with pytest.raises(ValueError, match=message):
        tree_attention(*_bad(kind), backend=backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match=r"unknown tree-attention backend 'flash'.*eager, sdpa, triton"):
        tree_attention(*_inputs(), backend="flash")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ALL)
def test_bf16_cuda(attn_cases, backend):
    case = attn_cases.make(B=2, Hq=8, Hkv=2, T=60, D=128, prefix_lens=(500, 77), dtype=torch.bfloat16,
                           per_row=True, device="cuda")
    attn_cases.check(run(case, backend), case, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_query_decode_folds_at_every_batch(dtype):
    """A decoding step (one query per row, no mask) folds its query heads whatever the batch, and computes the
    attention enable_gqa computes (to rounding): the folded kernel is the fast one at one query."""
    from treedec.attention import query_fold
    from treedec.attention.dispatch import sdpa_plain

    assert query_fold(1, 8, 2, 1) == 4 and query_fold(1, 8, 2, 2) == 1 and query_fold(1, 4, 4, 1) == 1
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 1, 16, generator=g).to(dtype)
    k, v = (torch.randn(3, 2, 37, 16, generator=g).to(dtype) for _ in range(2))
    out = sdpa_plain(q, k, v, causal=False)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(4, 1),
                                                           v.double().repeat_interleave(4, 1))
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
