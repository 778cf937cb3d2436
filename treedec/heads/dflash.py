"""The DFlash drafter (kind "dflash", arXiv 2602.06036): a few decoder layers that draft a whole block in one forward.

The target's features at verified positions (the inputs of ``feature_layers``, concatenated) are fused once:
``ctx = hidden_norm(fc(features))``. They are never run through the layers as queries: every layer projects
them with its own ``k_proj`` / ``v_proj`` (and ``k_norm``, RoPE at their positions) into extra keys and values,
which stay in the draft cache, one entry per verified position. A step's block is the root token (the newest
verified token, at the position after the last feature) followed by ``block_size`` mask positions (a learned
input embedding, ``mask_embed``); the block runs through the layers as queries, attending to the cached context
and to the whole block (non-causal within it). The output at mask position j is the marginal of the token at
depth j below the root (``lm_head(norm(out_j))`` over the draft vocabulary), whatever the drafts above it are.
So one head pass gives every depth's marginal, as the one-pass head's does, and ``chain``, ``best_first``,
``lookup`` and ``auto`` read them through ``Drafter.marginals``.

Where the one-pass (P-EAGLE) head is one EAGLE-3 layer whose mask positions see the prefix through the one layer's
own keys, here the target's features enter *every* layer, so depth no longer caps what the draft reads of the
target: DFlash's observation that a shallow drafter saturates τ.

Training (:meth:`DFlashHead.forward_train`) runs blocks anchored at sampled positions of a sequence in one forward:
block a sees the features of positions < a (what the cache holds when x_a is the root) and its own block.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from treedec.attention.dispatch import attend
from treedec.heads.config import DraftConfig
from treedec.heads.eagle3 import Eagle3Head
from treedec.models.cache import KVCache
from treedec.models.config import LlamaConfig
from treedec.models.llama import MLP, Attention, RMSNorm, rope_cos_sin, rope_lookup


class DFlashLayer(nn.Module):
    """A Llama/Qwen3 decoder layer whose attention reads the fused context as extra keys and values (z-lab names)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.self_attn, self.mlp = Attention(cfg), MLP(cfg)

    def qkv(self, ctx: torch.Tensor | None, x: torch.Tensor, cos, sin):
        """(queries of the block ``x`` [B, n, H], keys and values of the context ``ctx`` [B, w, H] then the block),
        one projection over both; ``cos``/``sin`` cover the w + n positions."""
        h = self.input_layernorm(x)
        rows = h if ctx is None else torch.cat([ctx.to(h.dtype), h], 1)
        q, k, v = self.self_attn._qkv(rows, cos, sin)
        return (q if ctx is None else q[:, :, ctx.shape[1]:]), k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """o_proj and the residual around attention, then the MLP block. ``attn`` [B, heads, n, D]."""
        a = self.self_attn
        B, _, n, _ = attn.shape
        x = x + a.o_proj(attn.transpose(1, 2).reshape(B, n, a.nh * a.hd))
        return x + self.mlp(self.post_attention_layernorm(x))

    def fuse(self) -> "DFlashLayer":
        self.self_attn.fuse()
        self.mlp.fuse()
        return self


class DFlashHead(Eagle3Head):
    """DFlash: ``fc`` + ``hidden_norm`` over several target layers' inputs, ``draft_layers`` layers that read them as
    keys and values, a block of ``block_size`` mask positions after the root, its own norm and LM head."""

    one_pass = True
    context_only = True  # the draft cache holds the target's fused features, never the head's own outputs

    def _build(self, cfg: DraftConfig) -> None:
        if cfg.block_size < 1 or cfg.draft_layers < 1:
            raise ValueError(f"a DFlash drafter needs block_size >= 1 and draft_layers >= 1; got "
                             f"{cfg.block_size} and {cfg.draft_layers}")
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.feature_layers) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg.layer_config()) for _ in range(cfg.draft_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
        self.mask_embed = nn.Parameter(torch.randn(H) * 0.02)  # the input of every mask position

    def _check_feature_layers(self, n_layers: int) -> None:
        fl = list(self.config.feature_layers)
        if not fl or any(not 0 <= i <= n_layers for i in fl):
            raise ValueError(f"this DFlash drafter reads the inputs of target layers {fl} (id L: the last layer's "
                             f"output), but the target has {n_layers} layers (valid ids: 0..{n_layers}); retrain the "
                             f"drafter for this target")

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def fuse(self) -> None:
        for layer in self.layers:
            layer.fuse()

    def forward(self, *args, **kwargs):
        """An EAGLE head's node-by-node pass has no meaning here: every depth comes from the block."""
        raise TypeError("a DFlash drafter drafts whole blocks (Drafter.marginals -> forward_block), not node by node")

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features -> the fused context every layer reads (``hidden_norm(fc(features))``)."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def block_inputs(self, root: torch.Tensor, n: int) -> torch.Tensor:
        """The block's inputs [B, 1 + n, H]: the root token's embedding, then ``n`` mask positions."""
        emb = self.target.model.embed_tokens(root[:, None]).to(self.dtype)
        return torch.cat([emb, self.mask_embed.to(self.dtype).expand(root.shape[0], n, -1)], 1)

    def forward_block(self, root: torch.Tensor | None, ctx: torch.Tensor | None, n: int, cache: KVCache,
                      position_ids: torch.Tensor, mask: torch.Tensor | str | None) -> torch.Tensor | None:
        """Write the context ``ctx`` [B, w, H] (projected features, or None) into the cache after each row's prefix and,
        with ``root`` [B], run the block (the root and ``n`` mask positions after the context) -> the mask positions'
        outputs [B, n, H]; None without a root. ``position_ids`` [B, w (+ 1 + n)]; ``mask`` [B, 1, 1 + n, S] the
        block's visibility, or "full" (rows of one length, no context: the block sees every key). The cache length
        does not move: the caller advances it by each row's valid context."""
        dt = self.dtype
        w = 0 if ctx is None else ctx.shape[1]
        T = w + (0 if root is None else 1 + n)
        cache.check_room(T)
        cos, sin = rope_lookup(self, position_ids, self._n_positions, dt)
        if root is None:  # the context alone: each layer's keys and values of it, no queries
            for i, layer in enumerate(self.layers):
                _, k, v = layer.self_attn._qkv(ctx.to(dt), cos, sin)
                cache.write(i, k, v)
            return None
        x = self.block_inputs(root, n)
        backend = "eager" if self.target.attn_backend == "eager" else "sdpa"
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(ctx, x, cos, sin)
            keys, values = cache.write(i, k, v)
            x = layer.finish(x, attend(q, keys, values, cache.lengths, None, mask, backend))
        return x[:, 1:]

    def forward_train(self, tokens: torch.Tensor, features: torch.Tensor, anchor: torch.Tensor,
                      n: int) -> torch.Tensor:
        """One training pass over blocks anchored at ``anchor`` [A] (positions >= 1 of ``tokens`` [B, T]): block a is
        the root x_a at position a and ``n`` mask positions after it, and sees the fused features of positions < a
        (``features`` [B, T, F], the target's) and its whole block. Returns the logits [B, A, n, K] of its mask
        positions: (a, j) drafts the token x_{a+j}, so its target is the target's distribution at a + j - 1."""
        B, T = tokens.shape
        dev = tokens.device
        anchor = anchor.to(dev)
        A, blk = anchor.numel(), n + 1
        ctx = self.project(features)
        x = self.block_inputs(tokens[:, anchor].reshape(B * A), n).view(B, A * blk, -1)
        offs = torch.arange(blk, device=dev)
        pos = torch.cat([torch.arange(T, device=dev), (anchor[:, None] + offs).flatten()])
        cos, sin = rope_cos_sin(pos[None].expand(B, -1), self.inv_freq)
        which = torch.arange(A, device=dev).repeat_interleave(blk)  # block row -> its anchor's index
        see_ctx = torch.arange(T, device=dev)[None, :] < anchor[which][:, None]  # [A·blk, T]
        see = torch.cat([see_ctx, which[None, :] == which[:, None]], 1)
        for layer in self.layers:
            q, k, v = layer.qkv(ctx, x, cos, sin)
            attn = layer.self_attn
            if attn.nkv != attn.nh:
                k, v = k.repeat_interleave(attn.nh // attn.nkv, 1), v.repeat_interleave(attn.nh // attn.nkv, 1)
            x = layer.finish(x, F.scaled_dot_product_attention(q, k, v, attn_mask=see))
        return self.logits(x.view(B, A, blk, -1)[:, :, 1:])


__all__ = ["DFlashHead", "DFlashLayer"]
