"""Static, preallocated KV cache that understands trees.

Every forward writes its T new keys/values at ``[lengths[b], lengths[b] + T)`` of each batch
row without moving ``lengths``; the caller then either ``advance``s (prefill, plain decoding)
or ``commit``s an accepted tree path, which copies that path's K/V to contiguous slots, the
way EAGLE and Medusa do it. Rows may hold different lengths.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.max_len = max_len

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def check_room(self, T: int) -> None:
        need = int(self.lengths.max()) + T
        if need > self.max_len:
            raise ValueError(
                f"KV cache overflow: {need} tokens needed, room for {self.max_len}; "
                "shorten the prompt or max_new_tokens, or raise the cache length / context size"
            )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, T, D] after each row's length; return the layer's keys up to the furthest new slot."""
        T = k.shape[2]
        end = int(self.lengths.max()) + T
        if self.batch == 1 or bool((self.lengths == self.lengths[0]).all()):
            start = int(self.lengths[0])
            self.k[layer, :, :, start:start + T] = k
            self.v[layer, :, :, start:start + T] = v
        else:
            idx = (self.lengths[:, None] + torch.arange(T, device=k.device))[:, None, :, None].expand_as(k)
            self.k[layer].scatter_(2, idx, k)
            self.v[layer].scatter_(2, idx, v)
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int | torch.Tensor) -> None:
        """Accept the last-written n tokens as they are (prefill, plain decoding)."""
        self.lengths += n

    def commit(self, path: torch.Tensor, n_accept: torch.Tensor | int | None = None) -> None:
        """Keep a root-to-node path of the last tree: ``path`` [B, n] (tree-relative indices).

        Row b keeps ``path[b, :n_accept[b]]``; its K/V move to ``[len_b, len_b + n_accept[b])``
        in every layer and the length advances by ``n_accept[b]``.
        """
        if path.dim() == 1:
            path = path[None].expand(self.batch, -1)
        n = path.shape[1]
        if n_accept is None:
            n_accept = torch.full((self.batch,), n, dtype=torch.long, device=path.device)
        elif isinstance(n_accept, int):
            n_accept = torch.full((self.batch,), n_accept, dtype=torch.long, device=path.device)
        n_accept = n_accept.to(self.lengths.device)
        src = self.lengths[:, None] + path.clamp(min=0).to(self.lengths.device)  # [B, n]
        dst = self.lengths[:, None] + torch.arange(n, device=self.lengths.device)
        keep = torch.arange(n, device=src.device)[None] < n_accept[:, None]
        src = torch.where(keep, src, dst)  # rows that keep fewer tokens copy their own slots: a no-op
        if not bool((src == dst).all()):
            L, B, H, _, D = self.k.shape
            gi = src[None, :, None, :, None].expand(L, B, H, n, D)
            si = dst[None, :, None, :, None].expand(L, B, H, n, D)
            for buf in (self.k, self.v):
                buf.scatter_(3, si, torch.gather(buf, 3, gi))
        self.lengths += n_accept

    def rollback(self, length: int | torch.Tensor) -> None:
        """Forget everything past ``length`` (per row or for all rows)."""
        if torch.is_tensor(length):
            self.lengths.copy_(length.to(self.lengths))
        else:
            self.lengths.fill_(length)

    def reset(self) -> None:
        self.lengths.zero_()
