"""The one-pass draft head (P-EAGLE, kind "parallel"): an EAGLE-3 head that drafts ``block_size`` positions in one forward.

Verified positions are an EAGLE-3 head's: the pair (token x_{t+1}, fc(target features at t)) in the draft cache.
The root's children come from the head's output at the last verified pair, as for any EAGLE head (depth 1).
Depths 2..K come from one more forward over K - 1 *mask* positions placed after the prefix: each reads a learned
token embedding (``mask_embed``) and a learned hidden state (``mask_hidden``, in the head's H-space, i.e. after
``fc``) at RoPE position ``last verified + j``, sees the verified prefix and the mask positions before it (causal
within the block), and predicts the marginal distribution of the token at depth j + 1, whatever the drafts at
depths 1..j turn out to be. So a chain of K costs one head pass, and best-first trees (DDTree) are built from the K
marginals (:class:`~treedec.tree.policies.best_first.BestFirstPolicy`).

A head may have ``draft_layers`` N > 1 decoder layers, as published P-EAGLE drafters do (4): layer 0 is the EAGLE-3
midlayer (``layer``), layers 1..N-1 plain Llama layers over its output (``layers_after``; draft-cache layer i is
layer i). Every path runs them all; the output is the last layer's, before the final norm.

Training (:meth:`ParallelHead.forward_train`) runs every real position causally (depth 1, as EAGLE-3's step 0)
plus mask elements of blocks anchored at real positions, all in one forward through one attention mask
(:func:`block_mask`): mask element (a, j) sees real positions <= a and mask elements (a, 1..j), exactly what a mask
position sees at decode time. Which (a, j) run is P-EAGLE's conditional drop-token sampling (:func:`cod_sample`):
every anchor at depth 1, geometrically fewer deeper (a share max(0.7^j, 0.2)), each block a prefix of depths.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from treedec.heads.config import DraftConfig
from treedec.heads.eagle3 import Eagle3Head
from treedec.models.cache import KVCache
from treedec.models.llama import Attention, DecoderLayer, one_row_matmuls, rope_cos_sin


def block_mask(T: int, anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Visibility [T + M, T + M] of a training pass: T real positions (causal), then M mask elements, element i
    standing at depth ``depth[i]`` >= 1 of the block drafted after real position ``anchor[i]``. It sees real
    positions <= its anchor and its own block's mask elements of depth <= its own: what it sees at decode time."""
    dev = anchor.device
    M = anchor.numel()
    real = torch.arange(T, device=dev)
    top = torch.cat([real[None, :] <= real[:, None], torch.zeros(T, M, dtype=torch.bool, device=dev)], 1)
    see_real = real[None, :] <= anchor[:, None]
    see_mask = (anchor[None, :] == anchor[:, None]) & (depth[None, :] <= depth[:, None])
    return torch.cat([top, torch.cat([see_real, see_mask], 1)], 0)


def cod_sample(T: int, n_mask: int, uniform, ratio: float = 0.7, floor: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """P-EAGLE's conditional drop-token sampling: the (anchor, depth) of each mask element a training pass runs.

    Every real position t < T - 1 anchors a block; its mask element at depth j (1..``n_mask``) predicts the token at
    t + j + 1, so it needs t + j <= T - 1. Depth j keeps a share max(ratio^j, floor) of the anchors, drawn from those
    kept at depth j - 1, so a block's elements are always a prefix 1..j of it. ``uniform(n)``: n U(0, 1) draws (the
    caller's generator, so a resumed run draws the same). Returns (anchor, depth) [M] each, by depth then anchor.
    """
    pool = torch.arange(T - 1)
    anchors, depths = [], []
    for j in range(1, n_mask + 1):
        pool = pool[pool + j <= T - 1]
        n = min(pool.numel(), int((T - 1 - j) * max(ratio ** j, floor)))
        if n <= 0:
            break
        pool = pool[uniform(pool.numel()).argsort()[:n]].sort().values
        anchors.append(pool)
        depths.append(torch.full_like(pool, j))
    if not anchors:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(anchors), torch.cat(depths)


def masked_attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """``attn`` over ``x`` [B, T, in] alone (no cache) through a dense visibility ``mask`` [T, T]: the training pass's
    attention, where mask elements see what they see at decode time (:func:`block_mask`), not a causal prefix."""
    B, T, _ = x.shape
    q, k, v = attn._qkv(x, cos, sin)
    if attn.nkv != attn.nh:
        k, v = k.repeat_interleave(attn.nh // attn.nkv, 1), v.repeat_interleave(attn.nh // attn.nkv, 1)
    a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attn.o_proj(a.transpose(1, 2).reshape(B, T, attn.nh * attn.hd))


class ParallelHead(Eagle3Head):
    """P-EAGLE: an EAGLE-3 head with learned mask inputs (``mask_embed``, ``mask_hidden``) for depths 2..K, and
    ``draft_layers`` - 1 plain decoder layers after its midlayer."""

    one_pass = True

    def _build(self, cfg: DraftConfig) -> None:
        if cfg.block_size < 1:
            raise ValueError(f"a parallel draft head drafts block_size >= 1 positions per pass; got {cfg.block_size}")
        if cfg.draft_layers < 1:
            raise ValueError(f"a parallel draft head has draft_layers >= 1 decoder layers; got {cfg.draft_layers}")
        super()._build(cfg)
        H = cfg.hidden_size
        self.mask_embed = nn.Parameter(torch.randn(H) * 0.02)  # the token input of every mask position
        self.mask_hidden = nn.Parameter(torch.zeros(H))  # the feature input of every mask position (after fc)
        self.layers_after = nn.ModuleList(DecoderLayer(cfg.layer_config()) for _ in range(cfg.draft_layers - 1))

    @classmethod
    def from_eagle3(cls, head: Eagle3Head, block_size: int) -> "ParallelHead":
        """A parallel head starting from an EAGLE-3 head's weights (its mask inputs fresh), in its dtype and device,
        bound to its target if it is bound: ``train init_from=<an EAGLE-3 head> draft_arch=parallel``."""
        if head.config.kind != "eagle3":
            raise ValueError(f"a parallel head starts from an EAGLE-3 head (kind eagle3), not a {head.config.kind!r} one")
        new = ParallelHead(replace(head.config, kind="parallel", block_size=int(block_size)))
        missing, unexpected = new.load_state_dict(head.state_dict(), strict=False)
        if unexpected or set(missing) - {"mask_embed", "mask_hidden"}:
            raise ValueError(f"cannot start a parallel head from this EAGLE-3 head: missing {missing}, "
                             f"unexpected {unexpected}")
        new = new.to(device=head.device, dtype=head.dtype)
        return new.bind(head.target) if head._target else new

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def fuse(self) -> None:
        super().fuse()
        for layer in self.layers_after:
            layer.fuse()

    def run_layers(self, emb: torch.Tensor, h: torch.Tensor, cos, sin, cache: KVCache, mask,
                   backend: str) -> torch.Tensor:
        x = self.layer(emb, h, cos, sin, cache, mask, backend)
        for i, layer in enumerate(self.layers_after, 1):
            x = layer(x, cos, sin, cache, i, None, mask, backend)
        return x

    def forward_mask(self, n: int, cache: KVCache, position_ids: torch.Tensor,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block's ``n`` mask positions after each row's cached prefix -> their outputs [B, n, H] (the marginals of
        depths 2..n+1 are :meth:`logits` of them). ``mask`` None: causal within the block after each row's prefix. The
        cache length does not move."""
        return self.forward_block(None, None, n, cache, position_ids, mask)

    def forward_block(self, tokens: torch.Tensor | None, features: torch.Tensor | None, n: int, cache: KVCache,
                      position_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Verified pairs (``tokens`` [B, w] one ahead of head-space ``features`` [B, w, H], or None) followed by ``n``
        mask positions, in one forward -> outputs [B, w + n, H]: a step's catch-up and its whole draft in one head
        pass. ``position_ids`` [B, w + n]; ``mask`` the dense visibility (None: causal after each row's prefix)."""
        B, dt = cache.batch, self.dtype
        emb, h = self.mask_embed.to(dt).expand(B, n, -1), self.mask_hidden.to(dt).expand(B, n, -1)
        if tokens is not None:
            emb = torch.cat([self.target.model.embed_tokens(tokens).to(dt), emb], 1)
            h = torch.cat([features.to(dt), h], 1)
        mask, cos, sin = self._mask_rope(emb.shape[1], cache, position_ids, mask)
        backend = "eager" if self.target.attn_backend == "eager" else "sdpa"
        with one_row_matmuls(emb, emb.shape[0] * emb.shape[1] == 1):
            return self.run_layers(emb, h, cos, sin, cache, mask, backend)

    def forward_train(self, tokens: torch.Tensor, features: torch.Tensor, anchor: torch.Tensor,
                      depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One training pass: (logits [B, T, K] of depth 1 at every position, logits [B, M, K] of the M mask elements
        (``anchor``, ``depth``) of :func:`cod_sample`). Mask element i is the marginal of the token ``depth[i]`` + 1
        drafts ahead of real position ``anchor[i]``: its target is the target's distribution at ``anchor[i] +
        depth[i]``. Through :func:`block_mask` it sees exactly what :meth:`forward_mask` sees at decode time."""
        t, dt = self.target, self.dtype
        B, T = tokens.shape
        dev = tokens.device
        anchor, depth = anchor.to(dev), depth.to(dev)
        M = anchor.numel()
        emb = torch.cat([t.model.embed_tokens(tokens).to(dt), self.mask_embed.to(dt).expand(B, M, -1)], 1)
        h = torch.cat([self.project(features), self.mask_hidden.to(dt).expand(B, M, -1)], 1)
        pos = torch.cat([torch.arange(T, device=dev), anchor + depth])
        cos, sin = rope_cos_sin(pos[None].expand(B, -1), self.inv_freq)
        see = block_mask(T, anchor, depth)
        x = self.layer.finish(h, masked_attention(self.layer.self_attn, self.layer.attn_input(emb, h), cos, sin, see))
        for layer in self.layers_after:
            x = x + masked_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, see)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.logits(x)
        return logits[:, :T], logits[:, T:]


__all__ = ["ParallelHead", "block_mask", "cod_sample", "masked_attention"]
