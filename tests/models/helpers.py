"""Small random Llama-family models for the model tests."""
from __future__ import annotations

import torch

from treedec.models import LlamaConfig, Transformer


def tiny_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    base.update(kw)
    return LlamaConfig(**base)


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.08) -> torch.nn.Module:
    """Weights large enough that logits are well separated; norms and biases non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model


def tiny_model(seed: int = 0, backend: str = "sdpa", fuse: bool = True, **kw) -> Transformer:
    """Random weights (drawn unfused, so a seed gives the same model either way), fused like ``load_model``'s."""
    torch.manual_seed(seed)
    model = randomize_(Transformer(tiny_config(**kw), attn_backend=backend), seed).eval()
    return model.fuse() if fuse else model


@torch.inference_mode()
def full_logits(model: Transformer, ids, position_offset: int = 0) -> torch.Tensor:
    """Logits [B, T, V] of one plain forward over ``ids`` from an empty cache."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    pos = None
    if position_offset:
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1) + position_offset
    return model(ids, cache, position_ids=pos).logits
