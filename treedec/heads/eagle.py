"""The EAGLE-1/2 draft head (kind "eagle"): one decoder layer that reads the target's final hidden state.

Input at draft position t is ``fc(concat(embed(token[t+1]), feature[t]))`` — the token is one
step ahead of the feature — followed by one Llama decoder layer whose first input norm is
skipped (as in EAGLE). Its output is the predicted next feature, i.e. the target LM head's
input, so ``logits = lm_head(feature)``. The embedding and LM head are the target's own,
shared and frozen, and never written into the draft checkpoint.

Besides the cached :meth:`~EagleHead.forward`, the head has a lean pass for one node per row
(:meth:`~EagleHead.forward_one`, a chain's next draft) and the training-time test
(:meth:`~EagleHead.forward_unrolled`, :mod:`treedec.heads.ttt`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from treedec.attention import folded_sdpa
from treedec.heads.config import DraftConfig
from treedec.heads.head import DraftHead
from treedec.heads.quantized import Int8Linear
from treedec.heads.ttt import ttt_attend
from treedec.models.cache import KVCache
from treedec.models.llama import (
    DecoderLayer,
    ModelOutput,
    Transformer,
    apply_rope,
    one_row_matmuls,
    rms_norm,
    rope_cos_sin,
    rope_table,
)
from treedec.models.packed import PackedLinear, packed_weight


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, without dispatching an op when it already is (a draft pass has ~80 ops: each counts)."""
    return x if x.dtype == dtype else x.to(dtype)


class EagleHead(DraftHead):
    """EAGLE-1/2: ``fc`` over (token embedding, target feature), one decoder layer, the target's LM head."""

    def _build(self, cfg: DraftConfig) -> None:
        self.fc = nn.Linear((1 + len(cfg.feature_layers)) * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layer = DecoderLayer(cfg.layer_config())
        self.layer.input_layernorm = nn.Identity()  # EAGLE skips the first input norm

    def _check_feature_layers(self, n_layers: int) -> None:
        if list(self.config.feature_layers) != [-1]:
            raise ValueError(f"an EAGLE-1/2 draft head reads the final hidden state (feature_layers=[-1]), not "
                             f"{self.config.feature_layers}; multi-layer features are kind='eagle3'")

    @property
    def feature_layers_needed(self) -> tuple[int, ...]:
        return ()

    def features(self, out: ModelOutput) -> torch.Tensor:
        return out.hidden

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE reads the target's features as they are."""
        return features

    def _bind_lm_head(self, target: Transformer) -> None:
        """The target's LM head, as this head multiplies by it: its rows of the draft vocabulary in the head's dtype,
        int8 rows for a quantized head, packed rows for a packed bf16 one."""
        w = target.lm_head.weight.detach()
        if self.config.draft_vocab_size:
            w = w[self.vocab_ids]
        if w.dtype != self.dtype or self.config.draft_vocab_size:  # a copy in the head's dtype
            self._lm_weight = w.to(self.dtype)
        if isinstance(self.fc, Int8Linear):  # a quantized head drafts over int8 rows of the LM head too (the
            #                                  largest of its matrices), for as many rows as its other linears
            self._lm_int8 = [Int8Linear(w.to(self.dtype))]  # (a list: not a submodule of the head)
        fc = self.fc.dense if isinstance(self.fc, Int8Linear) else self.fc
        if isinstance(fc, PackedLinear):  # a packed bf16 head multiplies by packed LM rows too: the target's
            #                                  own packed LM head when it shares it whole, else its rows packed
            shared = self._lm_weight is None and isinstance(target.lm_head, PackedLinear)
            self._lm_packed = target.lm_head if shared else packed_weight(
                w if self._lm_weight is None else self._lm_weight)

    def _linear_shapes(self) -> tuple[tuple[int, int], ...]:
        """The head's linears and its rows of the target's LM head."""
        c = self.config
        return (*super()._linear_shapes(), (c.hidden_size, c.draft_vocab_size or c.vocab_size))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, cache: KVCache,
                position_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] (one ahead of) features [B, T, H] -> predicted features [B, T, H].

        ``mask`` is a dense [B, 1, T, S] visibility mask over the cache (from ``prefix_tree_mask``);
        None means a chain after each row's cached prefix; "full": every key is visible (one query
        over rows of one length). The cache length does not move.
        Logits cost a vocabulary-wide matmul, so they are asked for apart: :meth:`logits`.
        """
        t = self.target
        dt = self.dtype
        x = torch.cat((as_dtype(t.model.embed_tokens(tokens), dt), as_dtype(features, dt)), dim=-1)
        mask, cos, sin = self._mask_rope(tokens.shape[1], cache, position_ids, mask)
        backend = "eager" if t.attn_backend == "eager" else "sdpa"  # one small layer: a dense mask is cheapest
        with one_row_matmuls(x, tokens.numel() == 1):  # a chain's node at batch 1: ATen's kernel, as the target's step
            return self.layer(self.fc(x), cos, sin, cache, 0, None, mask, backend)

    def forward_one(self, tokens: torch.Tensor, features: torch.Tensor, cache: KVCache, offset: int,
                    position_offset: int) -> torch.Tensor | None:
        """One node per row that sees its row's prefix and every input after it (a chain's next draft): tokens [B],
        features [B, H] -> predicted features [B, H]. Its key goes ``offset`` slots past each row's cached length (after
        the nodes drafted before it), its RoPE position is that length + ``position_offset``.

        :meth:`forward`'s maths without module calls or position tensors (and, over rows of one length, without a
        mask): a chain at batch 1 runs eight such passes a step, and on a CPU dispatch was ~40 % of each (~390 ->
        ~230 us a pass, docs/benchmarks.md). None where the layer has no such path (unfused or q/k-normed
        projections, no RoPE table): the caller runs :meth:`forward`. The cache length does not move.
        """
        L = self.layer
        A, M = L.self_attn, L.mlp
        if not (A.fused and M.fused) or A.qk_norm:
            return None
        table = rope_table(self, self._n_positions, self.dtype)
        if table is None:
            return None
        cache.check_room(offset + 1)
        dt, B, host, last = self.dtype, tokens.shape[0], cache.host_lengths, table.shape[1] - 1
        emb = self.target.model.embed_tokens
        x = torch.cat((as_dtype(F.embedding(tokens, emb.weight), dt), as_dtype(features, dt)), dim=-1)
        if min(host) == max(host):  # one position, and every key up to the new one visible: no mask
            cs, mask = table.select(1, min(host[0] + position_offset, last)), None  # [2, D]
        else:  # (positions past the table clamped, as rope_lookup does: finished rows' outputs are never read)
            cs = table[:, (cache.lengths + position_offset).clamp(max=last)].unsqueeze(2)  # [2, B, 1, D]
            keys = torch.arange(max(host) + offset + 1, device=x.device)
            mask = (keys < (cache.lengths + (offset + 1))[:, None])[:, None, None]  # [B, 1, 1, S]
        nh, nkv = A.nh, A.nkv  # (narrow and select, not Python indexing: ~1 against ~4 us an op)
        with one_row_matmuls(x, B == 1):  # (.forward: a linear's own maths, without nn.Module's call machinery)
            x = self.fc.forward(x)
            qkv = A.qkv_proj.forward(x).view(B, nh + 2 * nkv, A.hd)
            qk = apply_rope(qkv.narrow(1, 0, nh + nkv), cs.select(0, 0), cs.select(0, 1))
            keys, values = cache.write(0, qk.narrow(1, nh, nkv).unsqueeze(2), qkv.narrow(1, nh + nkv, nkv).unsqueeze(2),
                                       offset)
            attn = folded_sdpa(qk.narrow(1, 0, nh).unsqueeze(2), keys, values, mask)  # K/V heads' queries as rows
            x = x + A.o_proj.forward(attn.reshape(B, nh * A.hd))
            norm = L.post_attention_layernorm
            gate, up = M.gate_up_proj.forward(rms_norm(x, norm.weight, norm.eps)).chunk(2, dim=-1)
            return x + M.down_proj.forward(F.silu(gate) * up)

    def logits(self, feat: torch.Tensor) -> torch.Tensor:
        """Draft logits for predicted features: over the draft vocabulary (all of the target's by default)."""
        if self._lm_int8 is not None and feat.numel() // feat.shape[-1] <= self._lm_int8[0].max_rows:
            return self._lm_int8[0](as_dtype(feat, self.dtype))
        if self._lm_packed is not None:
            return self._lm_packed(as_dtype(feat, torch.bfloat16))
        w = self.target.lm_head.weight if self._lm_weight is None else self._lm_weight
        return F.linear(as_dtype(feat, w.dtype), w)

    def forward_train(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal pass from position 0 without a cache (training): same maths as :meth:`forward` on a chain."""
        t = self.target
        x = self.fc(torch.cat((t.model.embed_tokens(tokens), features.to(self.dtype)), dim=-1))
        B, T = tokens.shape
        cos, sin = rope_cos_sin(torch.arange(T, device=x.device)[None].expand(B, T), self.inv_freq)
        feat = self.layer.forward_causal(x, cos, sin)
        return feat, t.lm_head(feat.to(t.lm_head.weight.dtype))

    def forward_unrolled(self, tokens: torch.Tensor, features: torch.Tensor,
                         steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test: (features, logits) of each of ``steps`` unrolled steps.

        Step 0 is :meth:`forward_train`. At decode time a depth-i draft reads its parent's *predicted*
        feature, never the target's; step i > 0 reads at position t the step-(i-1) prediction at t-1 and
        attends through :func:`~treedec.heads.ttt.ttt_mask` (what the drafter's tree mask shows a depth-i node), so
        the head learns to continue from its own features (HASS / EAGLE-3's training-time test). Positions t < i of
        step i have no parent: ignore them.
        """
        t, attn, layer = self.target, self.layer.self_attn, self.layer
        B, T = tokens.shape
        emb = t.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(torch.arange(T, device=tokens.device)[None].expand(B, T), self.inv_freq)
        feat, keys, values, out = features.to(self.dtype), [], [], []
        for i in range(steps):
            if i:
                feat = F.pad(feat[:, :-1], (0, 0, 1, 0))
            x = self.fc(torch.cat((emb, feat), dim=-1))
            x = x + ttt_attend(attn, layer.input_layernorm(x), cos, sin, keys, values, i)
            feat = x + layer.mlp(layer.post_attention_layernorm(x))
            out.append((feat, t.lm_head(feat.to(t.lm_head.weight.dtype))))
        return out


__all__ = ["EagleHead", "as_dtype"]
