"""Tree attention: one op, several backends (``eager`` | ``sdpa`` | ``triton``).

``tree_attention(q, k, v, ancestor_bits, prefix_lens, backend=...)``: q [B, Hq, T, D];
k, v [B, Hkv, S, D] where row b holds its prefix keys at [0, prefix_lens[b]) and its T
tree keys at [prefix_lens[b], prefix_lens[b] + T); ancestor_bits [T, W] or [B, T, W];
returns [B, Hq, T, D]. Keys past prefix_lens[b] + T never affect the output (the
triton kernel does not load them; eager/sdpa mask them, so they must be finite: caches are zero-filled).

A model forward picks the backend and builds the mask once, then attends in every layer: :mod:`.dispatch`.
The tree's packed form (ancestor bits): :mod:`.layout`.

The Triton kernel is imported on its first use only: Triton is missing off Linux x86_64 (the eager and sdpa
backends work without it), and importing it costs about 0.25 s that a CPU run never needs.
"""
from __future__ import annotations

import torch

from treedec.attention.reference import (
    dense_mask,
    eager_tree_attention,
    fold_query_groups,
    folded_sdpa,
    prefix_tree_mask,
    query_fold,
    sdpa_tree_attention,
    tree_dense_mask,
)

BACKENDS = ("eager", "sdpa", "triton")


def default_backend(device: torch.device | str) -> str:
    """``kernel=auto``: the Triton kernel on CUDA, SDPA elsewhere."""
    return "triton" if torch.device(device).type == "cuda" else "sdpa"


def check_inputs(q, k, v, ancestor_bits, prefix_lens) -> torch.Tensor:
    """Validate shapes and return prefix_lens as a LongTensor [B] on q's device."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, T|S, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, Hq, T, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch or head dim")
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) for GQA")
    if ancestor_bits.dtype != torch.long:
        raise ValueError(f"ancestor_bits must be int64, got {ancestor_bits.dtype}; use Tree.ancestor_bits()")
    if ancestor_bits.dim() not in (2, 3) or ancestor_bits.shape[-2] != T:
        raise ValueError(f"ancestor_bits must be [T, W] or [B, T, W] with T={T}; got {tuple(ancestor_bits.shape)}")
    if ancestor_bits.dim() == 3 and ancestor_bits.shape[0] != B:
        raise ValueError(f"per-row ancestor_bits has batch {ancestor_bits.shape[0]}, q has {B}")
    if ancestor_bits.shape[-1] * 64 < T:
        raise ValueError(f"ancestor_bits has {ancestor_bits.shape[-1]} words: too narrow for T={T} (needs {(T + 63) // 64})")
    if isinstance(prefix_lens, int):
        prefix_lens = torch.full((B,), prefix_lens, dtype=torch.long, device=q.device)
    prefix_lens = prefix_lens.to(device=q.device, dtype=torch.long).reshape(-1)
    if prefix_lens.shape[0] != B:
        raise ValueError(f"prefix_lens has {prefix_lens.shape[0]} entries for batch {B}")
    if prefix_lens.numel() and int(prefix_lens.min()) < 0:
        raise ValueError("prefix_lens must be >= 0")
    if B and int(prefix_lens.max()) + T > k.shape[2]:
        raise ValueError(f"prefix_len {int(prefix_lens.max())} + T {T} exceeds the {k.shape[2]} keys given")
    return prefix_lens


def tree_attention(q, k, v, ancestor_bits, prefix_lens, backend: str = "sdpa", scale: float | None = None,
                   mask: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """Attention where tree node i sees the prefix, itself and its ancestors only.

    ``mask`` is an optional precomputed ``tree_dense_mask(...)`` [B, 1, T, S] for eager/sdpa: a
    model builds it once per forward and reuses it in every layer (inputs are then trusted).
    ``check=False`` trusts the inputs of the triton backend too: validation reads prefix_lens on
    the host, which a model's per-layer call must not do.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown tree-attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if mask is not None and backend != "triton":
        fn = eager_tree_attention if backend == "eager" else sdpa_tree_attention
        return fn(q, k, v, ancestor_bits, prefix_lens, scale, mask=mask)
    if check:
        prefix_lens = check_inputs(q, k, v, ancestor_bits, prefix_lens)
    if backend == "eager":
        return eager_tree_attention(q, k, v, ancestor_bits, prefix_lens, scale)
    if backend == "sdpa":
        return sdpa_tree_attention(q, k, v, ancestor_bits, prefix_lens, scale)
    from treedec.attention.triton_kernel import triton_tree_attention

    return triton_tree_attention(q, k, v, ancestor_bits, prefix_lens, scale)


__all__ = ["BACKENDS", "default_backend", "dense_mask", "fold_query_groups", "folded_sdpa", "prefix_tree_mask",
           "query_fold", "tree_attention", "tree_dense_mask"]
