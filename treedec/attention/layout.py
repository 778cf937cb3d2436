"""The tree mask's wire format: ancestry matrices and their packed int64 bit form.

``ancestor_bits`` packs the boolean ancestry matrix 64 columns per int64 word, so a
kernel can test "may node i see tree key j" with ``(bits[i, j // 64] >> (j % 64)) & 1``.
"""
from __future__ import annotations

import torch


def ancestor_matrix(parents: torch.Tensor, depth: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [..., T, T]: ``[i, j]`` iff j == i or j is an ancestor of i.

    Works level by level (one vectorised step per depth), so batched parent arrays
    [B, T] are handled at once; a root's parent is -1.
    """
    parents = parents.long()
    T = parents.shape[-1]
    batch = parents.shape[:-1]
    eye = torch.eye(T, dtype=torch.bool, device=parents.device).expand(*batch, T, T)
    anc = eye.clone()
    safe = parents.clamp(min=0)
    # Each pass ORs in the parent's row; after max-depth passes every row holds its full ancestry.
    n_pass = int(depth.max()) if depth is not None and depth.numel() else T - 1
    idx = safe.unsqueeze(-1).expand(*batch, T, T)
    has_parent = (parents >= 0).unsqueeze(-1)
    for _ in range(n_pass):
        new = eye | (torch.gather(anc, -2, idx) & has_parent)
        if torch.equal(new, anc):
            break
        anc = new
    return anc


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool [..., T, N] -> int64 [..., T, ceil(N/64)] with bit j%64 of word j//64 = mask[..., j]."""
    *lead, N = mask.shape
    W = max(1, (N + 63) // 64)
    padded = torch.zeros(*lead, W * 64, dtype=torch.long, device=mask.device)
    padded[..., :N] = mask.long()
    shifts = torch.arange(64, device=mask.device, dtype=torch.long)
    # Distinct powers of two never carry, so the sum is an exact OR (bit 63 wraps to the sign bit).
    return (padded.view(*lead, W, 64) << shifts).sum(-1)


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """Int64 [..., W] -> bool [..., n]: the inverse of :func:`pack_bits`."""
    j = torch.arange(n, device=bits.device)
    words = bits[..., j // 64]
    return ((words >> (j % 64)) & 1).bool()


def chain_bits(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Ancestor bits of a chain (plain causal attention over T new tokens)."""
    return pack_bits(torch.ones(T, T, dtype=torch.bool, device=device).tril())
