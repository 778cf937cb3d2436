"""The Triton kernel's own corners: prefix splits, padded head dims, many bit words, GQA
packing across row blocks, fully masked rows, garbage keys, strided K/V, bf16.

On CPU it runs under TRITON_INTERPRET=1 (tests/conftest.py); @cuda tests need a GPU.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import NO_TRITON

pytest.importorskip("triton", reason=NO_TRITON)

from treedec.attention import tree_attention
from treedec.attention import triton_kernel as tk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel(case, **kw):
    return tk.triton_tree_attention(case.q, case.k, case.v, case.bits, case.prefix_lens, **kw)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("per_row", [False, True])
def test_prefix_splits(attn_cases, num_splits, per_row):
    """Flash-decoding path forced on: ragged prefixes, including rows whose splits are empty."""
    case = attn_cases.make(B=5, Hq=4, Hkv=2, T=12, D=32, prefix_lens=(0, 5, 64, 200, 333), per_row=per_row,
                           seed=num_splits, device=DEVICE)
    attn_cases.check(kernel(case, num_splits=num_splits), case, torch.float32)


def test_splits_fp16_long_tree(attn_cases):
    case = attn_cases.make(B=2, Hq=2, Hkv=1, T=70, D=16, prefix_lens=(150, 0), dtype=torch.float16, device=DEVICE)
    attn_cases.check(kernel(case, num_splits=4), case, torch.float16)


@pytest.mark.parametrize("D", [8, 24, 80, 160])
def test_head_dim_padding(attn_cases, D):
    """D is padded to a power of two >= 16 with masked loads (160 -> 256 also narrows BLOCK_N to 32)."""
    case = attn_cases.make(Hq=2, Hkv=1, T=9, D=D, prefix_lens=(70,), seed=D, device=DEVICE)
    attn_cases.check(kernel(case), case, torch.float32)


@pytest.mark.parametrize("T,Hq,Hkv", [(65, 1, 1), (130, 4, 2), (200, 2, 2), (256, 1, 1), (257, 1, 1)])
def test_many_bit_words(attn_cases, T, Hq, Hkv):
    case = attn_cases.make(Hq=Hq, Hkv=Hkv, T=T, prefix_lens=(33,), seed=T, device=DEVICE)
    attn_cases.check(kernel(case), case, torch.float32)


@pytest.mark.parametrize("Hq,Hkv,T", [(3, 1, 23), (6, 2, 13), (8, 1, 9), (8, 1, 17), (4, 4, 40)])
def test_gqa_packing(attn_cases, Hq, Hkv, T):
    """Rows = node x group head; with G = 3 a node's heads straddle a BLOCK_M boundary."""
    case = attn_cases.make(B=2, Hq=Hq, Hkv=Hkv, T=T, prefix_lens=(19, 64), seed=Hq * T, device=DEVICE)
    attn_cases.check(kernel(case), case, torch.float32)


def test_fully_masked_rows_give_zero(attn_cases):
    """Bits that hide even the node itself, with no prefix: output 0, never NaN."""
    case = attn_cases.make(B=2, Hq=2, Hkv=1, T=5, prefix_lens=(0, 3), parents="chain", device=DEVICE)
    case.bits = case.bits.clone()
    case.bits[2] = 0  # node 2 sees no tree key
    out = kernel(case)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    # row 1 still sees its 3 prefix keys: compare with eager, which uses the same convention
    eager = tree_attention(case.q, case.k, case.v, case.bits, case.prefix_lens, backend="eager")
    torch.testing.assert_close(out, eager, **attn_cases.tol(torch.float32, DEVICE))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_never_reads_past_the_tree(attn_cases, num_splits):
    """NaN K/V past prefix_len + T must not leak into any output (each row reads only its own range)."""
    case = attn_cases.make(B=3, Hq=4, Hkv=2, T=10, prefix_lens=(70, 0, 129), extra=40, device=DEVICE)
    ref = attn_cases.reference(case.q, case.k, case.v, case.parents, case.prefix_lens)
    for b, L in enumerate(case.prefix_lens.tolist()):
        case.k[b, :, L + 10:] = float("nan")
        case.v[b, :, L + 10:] = float("nan")
    out = kernel(case, num_splits=num_splits)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double().cpu(), ref, **attn_cases.tol(torch.float32, DEVICE))


def test_strided_kv_cache_layout(attn_cases):
    """K/V as a [B, S, Hkv, D] cache viewed as [B, Hkv, S, D], and q from [B, T, Hq, D]: no copies needed."""
    case = attn_cases.make(B=2, Hq=4, Hkv=2, T=11, D=16, prefix_lens=(40, 7), device=DEVICE)
    case.k = case.k.transpose(1, 2).contiguous().transpose(1, 2)
    case.v = case.v.transpose(1, 2).contiguous().transpose(1, 2)
    case.q = case.q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not case.k.is_contiguous()
    attn_cases.check(kernel(case), case, torch.float32)


def test_bf16_returns_bf16(attn_cases):
    """bf16 in, bf16 out (the interpreter computes it in fp32)."""
    case = attn_cases.make(Hq=4, Hkv=2, T=12, D=32, prefix_lens=(50,), dtype=torch.bfloat16, device=DEVICE)
    attn_cases.check(kernel(case), case, torch.bfloat16)


def test_cpu_tensors_without_interpreter_raise(attn_cases, monkeypatch):
    monkeypatch.setattr(tk, "INTERPRET", False)
    case = attn_cases.make(T=3, prefix_lens=(2,))
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1.*backend='sdpa'"):
        kernel(case)


def test_num_splits_heuristic_is_off_on_cpu():
    assert tk.choose_num_splits(1, 1, 1, 100_000, torch.device("cpu")) == 1


# ------------------------------------------------------------------------------- GPU only
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("prefix", [(4000,), (1, 2500)])
def test_cuda_auto_splits(attn_cases, dtype, prefix):
    """Few programs and a long prefix: the heuristic splits, and the merge stays exact."""
    B = len(prefix)
    case = attn_cases.make(B=B, Hq=32, Hkv=8, T=60, D=128, prefix_lens=prefix, dtype=dtype, device="cuda")
    assert tk.choose_num_splits(B, 8, 4, case.k.shape[2] - 60, case.q.device) > 1  # 240 rows: 4 blocks
    attn_cases.check(kernel(case), case, dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_sdpa_large(attn_cases):
    case = attn_cases.make(B=4, Hq=32, Hkv=8, T=64, D=128, prefix_lens=(2048, 1000, 17, 0), per_row=True,
                           dtype=torch.float16, device="cuda")
    sdpa = tree_attention(case.q, case.k, case.v, case.bits, case.prefix_lens, backend="sdpa")
    torch.testing.assert_close(kernel(case), sdpa, atol=2e-3, rtol=2e-3)
