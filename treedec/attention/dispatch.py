"""How a model forward attends: the backend and the mask, decided once per forward, used by every layer.

A model forward calls :func:`check_tree` on its tree (host-side shapes only), :func:`forward_mask` once (which
backend, and the mask in that backend's form), then :func:`attend` in each layer with what it returned. The
tree arrives as a bool ancestry matrix ``tree_mask`` [(B,) T, T] or its packed ``ancestor_bits``
[(B,) T, W] (:mod:`treedec.attention.layout`), or neither: a chain, plain causal attention.

The forms, cheapest first:

- ``"full"`` / ``"causal"``: sdpa, a chain over rows that all hold the same length: a decode step (T == 1)
  sees every key, a prefill from an empty cache is causal; SDPA takes no mask at all.
- ancestor bits (triton): the kernel tests each key's bit itself.
- a dense [B, 1, T, S] mask (eager; sdpa as an additive mask, folded for grouped queries): every other case.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from treedec.attention import tree_attention
from treedec.attention.layout import chain_bits, pack_bits, unpack_bits
from treedec.attention.reference import _SDPA_GQA, fold_query_groups, folded_sdpa, query_fold, tree_dense_mask


def check_tree(tree_mask: torch.Tensor | None, bits: torch.Tensor | None, B: int, T: int) -> None:
    """Shape and dtype checks of a forward's tree (host-side metadata only, never the values)."""
    if tree_mask is not None and bits is not None:
        raise ValueError("give tree_mask or ancestor_bits, not both")
    t, name, dtype = (tree_mask, "tree_mask", torch.bool) if tree_mask is not None else (bits, "ancestor_bits", torch.long)
    if t is None:
        return
    cols = t.shape[-1] == T if tree_mask is not None else t.shape[-1] * 64 >= T
    ok = t.dim() in (2, 3) and t.shape[-2] == T and cols and (t.dim() == 2 or t.shape[0] == B)
    if t.dtype != dtype or not ok:
        width = "T" if tree_mask is not None else f"W >= {(T + 63) // 64}"
        raise ValueError(f"{name} must be {dtype} [T, {width}] or [B, T, {width}] with B={B}, T={T}; "
                         f"got {t.dtype} {tuple(t.shape)}")


def forward_mask(backend: str, x: torch.Tensor, lengths: torch.Tensor, host_lengths: Sequence[int] | None,
                 max_len: int, heads: tuple[int, int], tree_mask: torch.Tensor | None = None,
                 ancestor_bits: torch.Tensor | None = None):
    """``(bits, mask, backend)`` for every layer of a forward of ``x`` [B, T, ...] after each row's cached prefix.

    ``lengths`` [B]: the prefix lengths on the device; ``host_lengths``: the same on the host, or None on the
    compile path, where attention spans the whole cache (S = ``max_len``, the mask built from the device
    lengths, no Python branch on a length) and the triton backend gives way to sdpa (a dense mask).
    ``heads``: (query heads, K/V heads), for sdpa's folding of grouped queries. Nothing is read from the device.
    """
    B, T = x.shape[:2]
    host, whole_cache = host_lengths, host_lengths is None
    if whole_cache and backend == "triton":
        backend = "sdpa"
    chain = tree_mask is None and ancestor_bits is None
    if chain and not whole_cache and backend == "sdpa" and min(host) == max(host) and (T == 1 or host[0] == 0):
        return None, "full" if T == 1 else "causal", backend
    if backend == "triton":
        if ancestor_bits is None:
            ancestor_bits = chain_bits(T, x.device) if chain else pack_bits(tree_mask)
        return ancestor_bits, None, backend
    if chain:
        tree_mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    elif tree_mask is None:
        tree_mask = unpack_bits(ancestor_bits, T)
    mask = tree_dense_mask(tree_mask, lengths, max_len if whole_cache else max(host) + T, host_lens=host)
    if backend == "sdpa":  # folded for grouped queries once per forward (sdpa_tree_attention); SDPA's CPU kernel
        #                    takes an additive mask ~15 % faster than a bool one, bit-identical
        mask = fold_query_groups(mask, query_fold(B, heads[0], heads[1], T))
        mask = torch.full_like(mask, -torch.inf, dtype=x.dtype).masked_fill_(mask, 0.0)
    return None, mask, backend


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
           bits: torch.Tensor | None, mask: torch.Tensor | str | None, backend: str) -> torch.Tensor:
    """One layer's attention, q [B, Hq, T, D] over the cache's keys/values, with :func:`forward_mask`'s
    ``(bits, mask, backend)`` (or a draft head's dense mask or ``"full"``); inputs are trusted."""
    if isinstance(mask, str):  # a plain chain over rows of equal length: SDPA needs no mask
        return sdpa_plain(q, keys, values, causal=mask == "causal")
    return tree_attention(q, keys, values, bits, lengths, backend=backend, mask=mask, check=False)


def sdpa_plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """SDPA for a chain whose keys are exactly [prefix, new tokens] in every row.

    ``causal=False``: one new token that sees every key (a decode step), its query heads folded
    into rows where :func:`query_fold` says so; ``causal=True``: T new tokens and no prefix (a
    prefill from empty). GQA without copying K/V where torch allows it.
    """
    G = q.shape[1] // k.shape[1]
    if not causal and query_fold(q.shape[0], q.shape[1], k.shape[1], q.shape[2]) > 1:
        return folded_sdpa(q, k, v)
    if G > 1 and not _SDPA_GQA:
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    elif G > 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


__all__ = ["attend", "check_tree", "forward_mask", "sdpa_plain"]
