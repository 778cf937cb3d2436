"""The EAGLE-3 draft head (kind "eagle3"): fused low/mid/high target features, a 2H-input midlayer, its own LM head.

Input at draft position t is the pair (token x_{t+1}, feature h_t). For verified positions
``h_t = fc(concat(inputs of target layers l, m, h at t))`` (3H -> H, no bias); inside a draft
tree it is the head's own output at the parent (pre-norm, width H). The midlayer's attention
reads ``concat(input_layernorm(embed(x_{t+1})), hidden_norm(h_t))`` (2H) with ``h_t`` as the
residual, then an MLP with a residual, as in a Llama layer. Logits are ``lm_head(norm(out))``
over the head's own (usually reduced) draft vocabulary; ``vocab_ids`` maps it to target ids.
The embedding is the bound target's, never saved with the head.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from treedec.heads.config import DraftConfig
from treedec.heads.head import DraftHead
from treedec.heads.ttt import ttt_attend, ttt_mask
from treedec.models.cache import KVCache
from treedec.models.config import LlamaConfig
from treedec.models.llama import MLP, Attention, ModelOutput, RMSNorm, one_row_matmuls, rope_cos_sin


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer (SafeAILab names): q/k/v read 2H, the residual stream is the feature."""

    def __init__(self, cfg: LlamaConfig, norm_before_residual: bool = False):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual  # the residual is hidden_norm(h) (speculators heads)
        self.input_layernorm, self.hidden_norm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.self_attn, self.mlp = Attention(cfg, in_features=2 * H), MLP(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)

    def attn_input(self, emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.input_layernorm(emb), self.hidden_norm(h)), dim=-1)

    def finish(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual around attention, then the MLP block."""
        x = (self.hidden_norm(h) if self.norm_before_residual else h) + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, emb, h, cos, sin, cache: KVCache, mask, backend: str) -> torch.Tensor:
        return self.finish(h, self.self_attn(self.attn_input(emb, h), cos, sin, cache, 0, None, mask, backend))

    def fuse(self) -> "Eagle3Layer":
        self.self_attn.fuse()
        self.mlp.fuse()
        return self


class Eagle3Head(DraftHead):
    """EAGLE-3: ``fc`` over three target layers' inputs, the 2H-input midlayer, its own norm and LM head."""

    def _build(self, cfg: DraftConfig) -> None:
        if cfg.kind == "eagle3" and cfg.draft_layers != 1:
            raise ValueError(f"an EAGLE-3 head has one decoder layer (its midlayer); got draft_layers="
                             f"{cfg.draft_layers}: set draft_layers=1, or kind=parallel for a multi-layer P-EAGLE head")
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.feature_layers) * H, H, bias=False)
        self.layer = Eagle3Layer(cfg.layer_config(), cfg.norm_before_residual)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size or cfg.vocab_size, bias=False)

    def _check_feature_layers(self, n_layers: int) -> None:
        fl = list(self.config.feature_layers)
        bad = [i for i in fl if not 0 <= i < n_layers]
        if bad or not fl:
            raise ValueError(f"EAGLE-3 draft head reads the inputs of target layers {fl}, but the target has "
                             f"{n_layers} layers (valid ids: 0..{n_layers - 1}); retrain the head for this target "
                             f"or set draft.feature_layers (null = [2, L//2, L-3])")

    def restrict_vocab(self, token_ids: torch.Tensor) -> "Eagle3Head":
        """Name the target ids of the K rows of the head's own LM head (it has exactly K)."""
        n = torch.as_tensor(token_ids).numel()
        if n != self.lm_head.out_features:
            raise ValueError(f"an EAGLE-3 head's draft vocabulary is its LM head's {self.lm_head.out_features} rows; "
                             f"got {n} token ids (set draft.draft_vocab_size={n} before training)")
        return super().restrict_vocab(token_ids)

    @torch.no_grad()
    def init_from_target(self) -> "Eagle3Head":
        """Start the output layer from the target's (its final norm, its LM-head rows of the draft vocabulary)."""
        t = self.target
        self.norm.weight.copy_(t.model.norm.weight)
        rows = self.vocab_ids if self.config.draft_vocab_size else slice(None)
        self.lm_head.weight.copy_(t.lm_head.weight[rows])
        return self

    @property
    def feature_layers_needed(self) -> tuple[int, ...]:
        return tuple(self.config.feature_layers)

    def features(self, out: ModelOutput) -> torch.Tensor:
        return torch.cat([out.layer_inputs[i] for i in self.config.feature_layers], dim=-1)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.to(self.dtype))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, cache: KVCache,
                position_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] (one ahead of) head-space features [B, T, H] -> the last layer's outputs [B, T, H]."""
        t, dt = self.target, self.dtype
        mask, cos, sin = self._mask_rope(tokens.shape[1], cache, position_ids, mask)
        backend = "eager" if t.attn_backend == "eager" else "sdpa"
        emb = t.model.embed_tokens(tokens).to(dt)
        with one_row_matmuls(emb, tokens.numel() == 1):  # one row: ATen's kernel, as EagleHead.forward
            return self.run_layers(emb, features.to(dt), cos, sin, cache, mask, backend)

    def run_layers(self, emb: torch.Tensor, h: torch.Tensor, cos, sin, cache: KVCache, mask,
                   backend: str) -> torch.Tensor:
        """The head's decoder layers over (embeddings, head-space features) after the cached prefix: EAGLE-3's one
        midlayer (cache layer 0); a multi-layer P-EAGLE head runs its plain layers after it."""
        return self.layer(emb, h, cos, sin, cache, mask, backend)

    def logits(self, feat: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(feat.to(self.dtype)))

    def forward_train(self, tokens: torch.Tensor, features: torch.Tensor, steps: int = 1) -> list[torch.Tensor]:
        """Training-time test: draft logits [B, T, K] of each of ``steps`` unrolled steps, no cache.

        Step 0 reads the target features (``features`` [B, T, 3H]); step i > 0 reads at position t
        the step-(i-1) output at t-1 (as a depth-i draft node reads its parent's output) and
        attends through :func:`ttt_mask`. Positions t < i of step i have no such parent: ignore them.
        """
        t = self.target
        B, T = tokens.shape
        emb = t.model.embed_tokens(tokens).to(self.dtype)
        cos, sin = rope_cos_sin(torch.arange(T, device=tokens.device)[None].expand(B, T), self.inv_freq)
        attn = self.layer.self_attn
        h, keys, values, out = self.project(features), [], [], []
        for i in range(steps):
            if i:
                h = F.pad(h[:, :-1], (0, 0, 1, 0))
            h = self.layer.finish(h, ttt_attend(attn, self.layer.attn_input(emb, h), cos, sin, keys, values, i))
            out.append(self.logits(h))
        return out


__all__ = ["Eagle3Head", "Eagle3Layer", "ttt_mask"]
