"""A draft head's fast pass for one node per row (a chain's next draft), without module calls: :func:`forward_one`.

``DraftHead.forward_one`` calls it; ``DraftHead.forward`` is the same maths through the layer's modules.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from treedec.attention import folded_sdpa
from treedec.models.cache import KVCache
from treedec.models.llama import apply_rope, one_row_matmuls, rms_norm, rope_table


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, without dispatching an op when it already is (a draft pass has ~80 ops: each counts)."""
    return x if x.dtype == dtype else x.to(dtype)


def forward_one(head, tokens: torch.Tensor, features: torch.Tensor, cache: KVCache, offset: int,
                position_offset: int) -> torch.Tensor | None:
    """One node per row that sees its row's prefix and every input after it (a chain's next draft): tokens [B],
    features [B, H] -> predicted features [B, H]. Its key goes ``offset`` slots past each row's cached length (after
    the nodes drafted before it), its RoPE position is that length + ``position_offset``.

    ``head.forward``'s maths without module calls or position tensors (and, over rows of one length, without a
    mask): a chain at batch 1 runs eight such passes a step, and on a CPU dispatch was ~40 % of each (~390 ->
    ~230 us a pass, docs/benchmarks.md). None where this head has no such path (another kind, unfused or
    q/k-normed projections, no RoPE table): the caller runs ``head.forward``. The cache length does not move.
    """
    L = head.layer
    A, M = L.self_attn, L.mlp
    if not (A.fused and M.fused) or A.qk_norm:
        return None
    table = rope_table(head, head._n_positions, head.dtype)
    if table is None:
        return None
    cache.check_room(offset + 1)
    dt, B, host, last = head.dtype, tokens.shape[0], cache.host_lengths, table.shape[1] - 1
    emb = head.target.model.embed_tokens
    x = torch.cat((as_dtype(F.embedding(tokens, emb.weight), dt), as_dtype(features, dt)), dim=-1)
    if min(host) == max(host):  # one position, and every key up to the new one visible: no mask
        cs, mask = table.select(1, min(host[0] + position_offset, last)), None  # [2, D]
    else:  # (positions past the table clamped, as rope_lookup does: finished rows' outputs are never read)
        cs = table[:, (cache.lengths + position_offset).clamp(max=last)].unsqueeze(2)  # [2, B, 1, D]
        keys = torch.arange(max(host) + offset + 1, device=x.device)
        mask = (keys < (cache.lengths + (offset + 1))[:, None])[:, None, None]  # [B, 1, 1, S]
    nh, nkv = A.nh, A.nkv  # (narrow and select, not Python indexing: ~1 against ~4 us an op)
    with one_row_matmuls(x, B == 1):  # (.forward: a linear's own maths, without nn.Module's call machinery)
        x = head.fc.forward(x)
        qkv = A.qkv_proj.forward(x).view(B, nh + 2 * nkv, A.hd)
        qk = apply_rope(qkv.narrow(1, 0, nh + nkv), cs.select(0, 0), cs.select(0, 1))
        keys, values = cache.write(0, qk.narrow(1, nh, nkv).unsqueeze(2), qkv.narrow(1, nh + nkv, nkv).unsqueeze(2),
                                   offset)
        attn = folded_sdpa(qk.narrow(1, 0, nh).unsqueeze(2), keys, values, mask)  # K/V heads' queries as rows
        x = x + A.o_proj.forward(attn.reshape(B, nh * A.hd))
        norm = L.post_attention_layernorm
        gate, up = M.gate_up_proj.forward(rms_norm(x, norm.weight, norm.eps)).chunk(2, dim=-1)
        return x + M.down_proj.forward(F.silu(gate) * up)


__all__ = ["as_dtype", "forward_one"]
