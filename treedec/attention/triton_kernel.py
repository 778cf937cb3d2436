"""Flash-style Triton tree attention (the CUDA default backend).

One program handles one (batch row, KV head, block of rows[, prefix split]). Its rows are
tree nodes x the G query heads of one GQA group packed together (row r = node r // G,
head r % G), so each K/V block is read once for all G heads: at decode time the op is
memory-bound and K/V traffic is what costs. Per program:

1. an online-softmax loop over its slice of the verified prefix with no mask at all (every
   node sees every prefix key), then at most one bounds-masked block for the ragged end;
2. the tree tiles: keys ``prefix_len + j`` for j < T, visible iff bit j of the node's
   ``ancestor_bits`` row is set. Tiles are at most 64 wide and 64-aligned, so a tile tests
   one int64 word per row: ``(word >> (j - 64 * w)) & 1``. Nodes are topological, so a
   row block only scans tree keys up to its last node.

Softmax runs in the log2 domain (``exp2``) with fp32 accumulators; a row that sees no key
(padding rows, or bits that hide even the node itself) yields 0 rather than NaN.

Flash-decoding: when B * Hkv programs cannot fill the GPU and the prefix is long, the
prefix is cut into ``num_splits`` 64-aligned chunks per row (from the row's own
prefix_len, read on the device: no host sync); each split writes a normalised partial
output and its log-sum-exp, merged in torch. The last split also takes the tree tiles.
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise RuntimeError(
        "the 'triton' tree-attention backend needs Triton: `pip install triton` "
        "(Linux x86_64 + CUDA), or use backend='sdpa' / 'eager'"
    ) from exc

# triton.jit reads TRITON_INTERPRET when the kernel below is defined; remember that mode.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634

__all__ = ["INTERPRET", "choose_num_splits", "triton_tree_attention"]


@triton.jit
def _online_softmax_step(acc, m_i, l_i, q, k, v, valid, qk_scale,
                         MASKED: tl.constexpr, DOT_PREC: tl.constexpr):
    """Fold one K/V block into the running (acc, max, sum); scores in log2 units."""
    s = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale  # [M, N]
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _tree_attn_kernel(
    Q, K, V, BITS, PREFIX, OUT, LSE,
    s_qb, s_qh, s_qt, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_bb, s_bt, s_bw,
    s_ob, s_oh, s_ot, s_od,
    s_ls, s_lb, s_lh, s_lt,
    s_os,
    Hkv, T, D, qk_scale,
    G: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    b = (pid_bh // Hkv).to(tl.int64)  # int64 offsets: a big cache overflows int32
    kvh = pid_bh % Hkv

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    node = rows // G
    head = kvh * G + rows % G
    row_ok = node < T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    cols = tl.arange(0, BLOCK_N)

    q = tl.load(Q + b * s_qb + head[:, None] * s_qh + node[:, None] * s_qt + d[None, :] * s_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + b * s_kb + kvh * s_kh + d[:, None] * s_kd  # K block loaded as [D, N]
    v_base = V + b * s_vb + kvh * s_vh + d[None, :] * s_vd  # V block loaded as [N, D]

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # -- prefix: this split's 64-aligned chunk of [0, L); only the ragged tail is masked.
    L = tl.load(PREFIX + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(L, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, L), lo)
    hi_full = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
    for start in range(lo, hi_full, BLOCK_N):
        n = start + cols
        if EVEN_D:
            k = tl.load(k_base + n[None, :] * s_ks)
            v = tl.load(v_base + n[:, None] * s_vs)
        else:
            k = tl.load(k_base + n[None, :] * s_ks, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_base + n[:, None] * s_vs, mask=d_ok[None, :], other=0.0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, None, qk_scale, False, DOT_PREC)
    for start in range(hi_full, hi, BLOCK_N):  # runs at most once
        n = start + cols
        n_ok = n < hi
        k = tl.load(k_base + n[None, :] * s_ks, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        v = tl.load(v_base + n[:, None] * s_vs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, n_ok[None, :], qk_scale, True, DOT_PREC)

    # -- tree tiles (last split only): key L + j visible iff bit j of the node's row is set.
    last_node = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, T - 1)
    tree_hi = tl.where(split == NUM_SPLITS - 1, last_node + 1, 0)
    bits_row = BITS + b * s_bb + tl.minimum(node, T - 1) * s_bt
    for j0 in range(0, tree_hi, BLOCK_N):
        j = j0 + cols
        j_ok = j < T
        w = j0 // 64  # BLOCK_N divides 64: one word per row per tile
        word = tl.load(bits_row + w * s_bw, mask=row_ok, other=0)
        shift = tl.minimum(tl.maximum(j - w * 64, 0), 63).to(tl.int64)
        visible = (((word[:, None] >> shift[None, :]) & 1) != 0) & j_ok[None, :] & row_ok[:, None]
        n = L + j
        k = tl.load(k_base + n[None, :] * s_ks, mask=d_ok[:, None] & j_ok[None, :], other=0.0)
        v = tl.load(v_base + n[:, None] * s_vs, mask=j_ok[:, None] & d_ok[None, :], other=0.0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, visible, qk_scale, True, DOT_PREC)

    # -- epilogue: normalise; a row that saw nothing gets 0 (and lse -inf), never NaN.
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = OUT + split * s_os + b * s_ob + head[:, None] * s_oh + node[:, None] * s_ot + d[None, :] * s_od
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(LSE + split * s_ls + b * s_lb + head * s_lh + node * s_lt, lse, mask=row_ok)


_SM_COUNT: dict[int, int] = {}


def choose_num_splits(batch: int, kv_heads: int, m_blocks: int, prefix_bound: int, device: torch.device) -> int:
    """Flash-decoding split count: enough programs to fill the SMs, >= 256 prefix keys each."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    programs = batch * kv_heads * m_blocks
    if programs >= _SM_COUNT[idx] or prefix_bound < 512:
        return 1
    return int(max(1, min(32, triton.cdiv(_SM_COUNT[idx], programs), prefix_bound // 256)))


def triton_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ancestor_bits: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Tree attention [B, Hq, T, D] with the Triton kernel (inputs validated by ``tree_attention``).

    ``num_splits`` cuts the prefix for flash-decoding; ``None`` picks it from the SM count.
    """
    if q.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(
            f"the triton backend runs on CUDA tensors (got {q.device}); set TRITON_INTERPRET=1 before "
            "importing treedec to run it on CPU (slow, for tests), or use backend='sdpa'"
        )
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out_dtype = q.dtype
    if INTERPRET and q.dtype == torch.bfloat16:  # the interpreter mis-computes bf16 arithmetic
        q, k, v = q.float(), k.float(), v.float()
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    out = torch.empty(B, Hq, T, D, device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out.to(out_dtype)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    bits = ancestor_bits.to(q.device)
    bits = bits.unsqueeze(0).expand(B, -1, -1) if bits.dim() == 2 else bits  # stride 0 when shared
    prefix_lens = prefix_lens.to(device=q.device, dtype=torch.long).contiguous()

    rows = T * G
    BLOCK_M = min(64, max(16, triton.next_power_of_2(rows)))
    BLOCK_D = max(16, triton.next_power_of_2(D))
    BLOCK_N = 64 if BLOCK_D <= 128 else 32  # must divide 64 (one bits word per tree tile)
    m_blocks = triton.cdiv(rows, BLOCK_M)
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, m_blocks, S - T, q.device)
    num_splits = max(1, int(num_splits))

    if num_splits == 1:
        o_buf, lse = out, out.new_empty(1, dtype=torch.float32)  # lse unused
        s_ls = s_lb = s_lh = s_lt = s_os = 0
    else:
        o_buf = torch.empty(num_splits, B, Hq, T, D, device=q.device, dtype=torch.float32)
        lse = torch.empty(num_splits, B, Hq, T, device=q.device, dtype=torch.float32)
        s_ls, s_lb, s_lh, s_lt = lse.stride()
        s_os = o_buf.stride(0)
    o_view = o_buf if num_splits == 1 else o_buf[0]

    grid = (B * Hkv, m_blocks, num_splits)
    _tree_attn_kernel[grid](
        q, k, v, bits, prefix_lens, o_buf, lse,
        *q.stride(), *k.stride(), *v.stride(), *bits.stride(), *o_view.stride(),
        s_ls, s_lb, s_lh, s_lt, s_os,
        Hkv, T, D, scale * LOG2E,
        G=G, NUM_SPLITS=num_splits, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        EVEN_D=BLOCK_D == D, DOT_PREC="ieee" if q.dtype == torch.float32 else None,  # fp32 stays exact, not TF32
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:  # log-sum-exp merge of the splits (log2 units)
        top = lse.amax(0)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        w = torch.exp2(lse - top)  # [splits, B, Hq, T]; empty splits weigh 0
        total = w.sum(0)
        merged = (w.unsqueeze(-1) * o_buf).sum(0) / torch.where(total > 0, total, 1.0).unsqueeze(-1)
        out.copy_(merged)
    return out.to(out_dtype)
