"""PyTorch tree attention: the readable ``eager`` reference and the ``sdpa`` backend.

Both expand the packed ancestor bits into a dense boolean mask over all S keys: key s of
batch row b is visible to tree node i iff s < prefix_lens[b] (the verified prefix), or
s - prefix_lens[b] is i itself or one of its ancestors.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from treedec.attention.layout import unpack_bits

_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa=


def dense_mask(ancestor_bits: torch.Tensor, prefix_lens: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """Bool [B, T, S] visibility mask from packed bits ([T, W] or [B, T, W]) and prefix lengths [B]."""
    return prefix_tree_mask(unpack_bits(ancestor_bits, T), prefix_lens, S)


def prefix_tree_mask(tree: torch.Tensor, prefix_lens: torch.Tensor, S: int,
                     host_lens: Sequence[int] | None = None) -> torch.Tensor:
    """Bool [B, Tq, S] from a tree-visibility matrix tree [(B,) Tq, Tk] whose Tk keys follow each row's prefix.

    Tq may be smaller than Tk: a draft head expanding one depth queries only its newest nodes.
    ``host_lens`` (the prefix lengths on the host, optional) lets rows of one common length take
    a plain concatenation; otherwise each row reads its tree columns with one gather.
    """
    B = prefix_lens.shape[0]
    Tq, Tk = tree.shape[-2:]
    if host_lens is not None and min(host_lens) == max(host_lens) and S >= host_lens[0] + Tk:
        L, tree = host_lens[0], tree.expand(B, Tq, Tk)
        parts = [tree.new_ones(B, Tq, L), tree] + ([tree.new_zeros(B, Tq, S - L - Tk)] if S > L + Tk else [])
        return torch.cat(parts, -1)
    rel = torch.arange(S, device=prefix_lens.device) - prefix_lens.view(B, 1, 1)  # [B, 1, S]: key index in the tree
    picked = tree.expand(B, Tq, Tk).gather(2, rel.clamp(0, Tk - 1).expand(B, Tq, S))
    return (rel < 0) | ((rel < Tk) & picked)


def tree_dense_mask(tree_mask: torch.Tensor, prefix_lens: torch.Tensor, S: int,
                    host_lens: Sequence[int] | None = None) -> torch.Tensor:
    """The [B, 1, T, S] mask eager/sdpa attention takes, straight from a bool ancestry matrix [(B,) T, T].

    Built once per forward and shared by every layer; no bit packing on the way.
    """
    return prefix_tree_mask(tree_mask, prefix_lens, S, host_lens)[:, None]


def eager_tree_attention(q, k, v, ancestor_bits, prefix_lens, scale: float | None = None, mask=None) -> torch.Tensor:
    """Explicit masked softmax in fp32; slow and obviously right."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kf = k.float().repeat_interleave(G, dim=1)
    vf = v.float().repeat_interleave(G, dim=1)
    scores = torch.einsum("bhtd,bhsd->bhts", q.float(), kf) * scale
    if mask is None:
        mask = dense_mask(ancestor_bits, prefix_lens, T, S)[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row gives zeros
    return torch.einsum("bhts,bhsd->bhtd", probs, vf).to(q.dtype)


def query_fold(B: int, Hq: int, Hkv: int, T: int) -> int:
    """How many query heads :func:`sdpa_tree_attention` folds into each K/V head's rows: G or 1.

    Folding pays from 16 (row, K/V head) pairs up: SDPA's CPU kernel then runs 7-13 % faster a
    12-layer forward at batch 16; at batch 1 a tree (T > 1) is 2-5 % slower. One query per row (a
    decoding step, T = 1) always folds: at one query the bf16 kernel with ``enable_gqa`` takes ~5x
    as long as the same attention folded (65 vs 13 us a layer over 250 keys), so a batch-1 vanilla
    step is 8-15 % faster folded (docs/benchmarks.md).
    """
    return Hq // Hkv if T == 1 or B * Hkv >= 16 else 1


def fold_query_groups(mask: torch.Tensor, groups: int) -> torch.Tensor:
    """A [B, 1, T, S] mask repeated for folded queries: [B, 1, groups·T, S] (a model folds once per forward)."""
    return mask.repeat(1, 1, groups, 1) if groups > 1 else mask


def folded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                scale: float | None = None) -> torch.Tensor:
    """SDPA with each K/V head's G query heads as G·T rows of one attention: q [B, Hq, T, D] (viewed as
    [B, Hkv, G·T, D]), ``mask`` None or folded ([B, 1, G·T, S], :func:`fold_query_groups`) -> [B, Hq, T, D]."""
    B, Hq, T, D = q.shape
    out = F.scaled_dot_product_attention(q.reshape(B, k.shape[1], Hq // k.shape[1] * T, D), k, v, attn_mask=mask,
                                         scale=scale)
    return out.reshape(B, Hq, T, D)


def sdpa_tree_attention(q, k, v, ancestor_bits, prefix_lens, scale: float | None = None, mask=None) -> torch.Tensor:
    """``scaled_dot_product_attention`` with a dense mask (the CPU default).

    GQA: where :func:`query_fold` says so, each K/V head's G query heads fold into its query rows,
    [B, Hkv, G·T, D], each row computed as before; else the group shares K/V through ``enable_gqa``.
    ``mask`` is [B, 1, T, S], or [B, 1, G·T, S] already folded with :func:`fold_query_groups`.
    """
    B, Hq, T, D = q.shape
    if mask is None:
        mask = dense_mask(ancestor_bits, prefix_lens, T, k.shape[2])[:, None]
    Hkv = k.shape[1]
    G = Hq // Hkv
    if mask.shape[-2] == T and query_fold(B, Hq, Hkv, T) > 1:
        mask = fold_query_groups(mask, G)
    if mask.shape[-2] == G * T and G > 1:
        return folded_sdpa(q, k, v, mask, scale)
    if G > 1 and not _SDPA_GQA:
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=G > 1 and _SDPA_GQA)
