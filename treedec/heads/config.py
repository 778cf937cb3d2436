"""A draft head's configuration and file names, below every head kind (:mod:`treedec.heads.kinds`) and the
published-layout readers and writers (:mod:`treedec.heads.formats`), which all read it."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from treedec.models.config import LlamaConfig
from treedec.models.paths import ASSETS

if TYPE_CHECKING:
    from treedec.models.llama import Transformer

BUNDLED_HEAD = {"eagle": "tiny-code-eagle", "eagle3": "tiny-code-eagle3", "parallel": "tiny-code-parallel",
                "dflash": "tiny-code-dflash"}  # the head of each kind shipped for tiny-code (what export_dir=bundled replaces)
BUNDLED_DRAFTS = {name: ASSETS / name for name in BUNDLED_HEAD.values()}  # the heads shipped for tiny-code
DRAFT_CONFIG = "draft_config.json"
DRAFT_WEIGHTS = "draft.safetensors"


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    kind: str = "eagle"  # "eagle" (EAGLE-1/2) | "eagle3" (fused low/mid/high layer inputs; fc: 3H -> H; own LM head)
    #                      | "parallel" (an EAGLE-3 head drafting block_size positions in one pass: heads/parallel.py)
    #                      | "dflash" (draft_layers layers reading the target's features as keys/values: heads/dflash.py)
    feature_layers: list[int] = field(default_factory=lambda: [-1])  # eagle: [-1] (final normed hidden); eagle3: layer ids
    target: str = ""  # what it was trained for (informational)
    target_fingerprint: str = ""  # target_fingerprint() of the target it was trained with ("" = unknown)
    draft_vocab_size: int = 0  # > 0: draft only over these most frequent target tokens (buffer vocab_ids); 0: all
    fc_bias: bool = True  # EAGLE-1/2's fc has a bias unless its config says "bias": false (formats/eagle.py)
    qkv_bias: bool = False  # the layer's q/k/v biases (published Qwen2 heads)
    o_bias: bool = False
    qk_norm: bool = False  # the layer's per-head q/k RMSNorms (Qwen3-layer heads)
    norm_before_residual: bool = False  # eagle3: the midlayer's residual is hidden_norm(h), not h (speculators heads)
    block_size: int = 0  # parallel, dflash: the depths one head pass drafts (DFlash's own block_size counts the root
    #                      too: it is this + 1)
    draft_layers: int = 1  # dflash: decoder layers; parallel: the EAGLE-3 midlayer, then draft_layers - 1 Llama layers

    @classmethod
    def for_target(cls, cfg: LlamaConfig, target: str = "", **overrides) -> "DraftConfig":
        """A head shaped like one layer of the target (EAGLE's choice).

        ``feature_layers=None`` (or absent) is the kind's default: [-1] for eagle, EAGLE-3's
        [2, L//2, L-3] of this target for eagle3.
        """
        d = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                 num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                 head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
                 rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, target=target)
        d.update(overrides)
        if d.get("feature_layers") is None:
            L = cfg.num_hidden_layers
            d["feature_layers"] = dflash_layers(L, d.get("draft_layers", 1)) if d.get("kind") == "dflash" else \
                [min(2, L - 1), L // 2, max(L - 3, 0)] if d.get("kind") in ("eagle3", "parallel") else [-1]
        return cls(**d)

    def layer_config(self) -> LlamaConfig:
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                           qkv_bias=self.qkv_bias, o_bias=self.o_bias, qk_norm=self.qk_norm)


def dflash_layers(n_target: int, n_draft: int) -> list[int]:
    """DFlash's default feature layers for a target of ``n_target`` layers and a drafter of ``n_draft``: as many as the
    drafter has layers, evenly spread from the output of layer 1 to that of layer L-3, in treedec's convention (the
    *input* of layer i + 1 is the output of layer i; i + 1 = L names the last layer's output)."""
    lo, hi = 1, max(n_target - 3, 1)
    if n_draft == 1:
        return [n_target // 2 + 1]
    return [round(lo + i * (hi - lo) / (n_draft - 1)) + 1 for i in range(n_draft)]


def target_fingerprint(target: "Transformer") -> str:
    """A short hash of what a head depends on: the target's shape and its embedding / LM head.

    Rows are sampled on a fixed stride and rounded to bf16, so the same checkpoint loaded in
    fp32 or bf16, on any device, gives the same fingerprint; a retrained or different target
    of the same shape does not.
    """
    c = target.config
    h = hashlib.sha256(json.dumps([c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                                   c.num_key_value_heads, c.head_dim]).encode())
    for w in (target.model.embed_tokens.weight, target.lm_head.weight):
        rows = w[:: max(1, w.shape[0] // 256)].detach().to("cpu", torch.bfloat16)
        h.update(rows.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def head_dir(path: str | os.PathLike) -> Path:
    """The directory of the draft head ``path`` names (a bundled name, or a directory holding a treedec head or a
    published EAGLE / EAGLE-3 one): what ``load_head`` reads, so a config check (``init_from=``) accepts
    exactly the heads ``draft.path`` does, before anything is loaded."""
    d = BUNDLED_DRAFTS.get(str(path), Path(path).expanduser())
    if not (d / DRAFT_CONFIG).is_file() and not (d / "config.json").is_file():
        raise FileNotFoundError(f"no draft head at {d}: expected {DRAFT_CONFIG} + {DRAFT_WEIGHTS} (a treedec head: "
                                "train one with `python -m treedec.train`) or config.json + model.safetensors (an "
                                "EAGLE / EAGLE-3 head, e.g. from `python -m treedec.export_head`)")
    return d


__all__ = ["BUNDLED_DRAFTS", "BUNDLED_HEAD", "DRAFT_CONFIG", "DRAFT_WEIGHTS", "DraftConfig", "head_dir",
           "target_fingerprint"]
