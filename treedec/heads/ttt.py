"""Training-time test: a draft head trained on its own predicted features, as it drafts at decode time.

At decode time a depth-i draft node reads its parent's *predicted* feature, never the target's. Unrolling
``steps`` passes, step i > 0 reads at position t the step-(i-1) prediction at t-1 and attends through
:func:`ttt_mask`, the visibility the drafter's tree mask gives a depth-i node (HASS / EAGLE-3's training-time
test). The heads' unrolled passes share :func:`ttt_attend`: the EAGLE-1/2 head's ``forward_unrolled``
(:mod:`treedec.heads.eagle`), the EAGLE-3 head's ``forward_train(steps=)`` (:mod:`treedec.heads.eagle3`). No KV cache:
plain SDPA over the steps' keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Visibility [T, (step+1)·T] of training-time-test step ``step`` over the keys of steps 0..step.

    Query t of step i stands for a depth-i draft node whose chain of ancestors is the step-j
    node at t-i+j (j = 1..i-1) under a root whose true-feature entries are positions <= t-i:
    exactly what the drafter's tree mask lets a depth-i node see at decode time.
    """
    t = torch.arange(T, device=device)
    blocks = [t[None, :] <= t[:, None] - step]  # step 0: the true-feature prefix
    blocks += [t[None, :] == t[:, None] - step + j for j in range(1, step + 1)]  # one ancestor per step
    return torch.cat(blocks, dim=1)


def ttt_attend(attn, x: torch.Tensor, cos, sin, keys: list, values: list, step: int) -> torch.Tensor:
    """Training-time-test step ``step``'s attention: queries of ``x`` over the keys of steps 0..step (this step's
    appended to ``keys``/``values``), through :func:`ttt_mask`; o_proj applied."""
    B, T, _ = x.shape
    q, k, v = attn._qkv(x, cos, sin)
    keys.append(k)
    values.append(v)
    kk, vv = torch.cat(keys, 2), torch.cat(values, 2)
    if attn.nkv != attn.nh:
        kk, vv = kk.repeat_interleave(attn.nh // attn.nkv, 1), vv.repeat_interleave(attn.nh // attn.nkv, 1)
    a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=ttt_mask(T, step, x.device))
    return attn.o_proj(a.transpose(1, 2).reshape(B, T, attn.nh * attn.hd))


__all__ = ["ttt_attend", "ttt_mask"]
