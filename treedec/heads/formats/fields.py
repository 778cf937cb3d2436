"""config.json fields against the weights, for every published head reader (:mod:`treedec.heads.formats.published`,
:mod:`treedec.heads.formats.peagle`): a field that fixes a tensor's shape is checked against that tensor before
anything is built from either, so a mistake in one names the field, what it says and what the weights say (never a
later complaint about a derived tensor, nor torch's several-line size mismatch)."""
from __future__ import annotations

from pathlib import Path

import torch

from treedec.models.config import LlamaConfig


def config_int(raw: dict, key: str, cfg_file: Path, field: str | None = None, weights: str | None = None) -> int | None:
    """``raw[key]`` where it is a JSON integer (None when absent); a string, float or bool is an error naming the
    field (``field``, default ``key``), what it says and, where known, what the ``weights`` hold."""
    value = raw.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    held = f", and the weights hold {weights}" if weights else ""
    fix = f"the JSON integer {value.strip()}" if isinstance(value, str) and value.strip().isdigit() else "a JSON integer"
    raise ValueError(f"{cfg_file}: \"{field or key}\" is {value!r}, not an integer{held}: write it as {fix}")


def check_shapes(lc: LlamaConfig, draft_vocab: int | None, src: dict[str, torch.Tensor], prefix: str, cfg_file: Path,
                 scope: str = "") -> None:
    """Each config field that fixes a tensor's size against that tensor of ``src`` (the published names, the layer's
    under ``prefix``); ``draft_vocab``: the LM head's rows (EAGLE-3 layouts; None: no own LM head to check);
    ``scope``: where the layer's fields sit in config.json (``transformer_layer_config.`` for speculators)."""
    hd = lc.head_dim
    rules = [  # (field, what the config says, tensor, dim)
        ("hidden_size", lc.hidden_size, "fc.weight", 0),
        ("hidden_size", lc.hidden_size, "norm.weight", 0),
        ("hidden_size", lc.hidden_size, "embed_tokens.weight", 1),
        ("hidden_size", lc.hidden_size, "lm_head.weight", 1),
        ("vocab_size", lc.vocab_size, "embed_tokens.weight", 0),
        ("intermediate_size", lc.intermediate_size, prefix + "mlp.gate_proj.weight", 0),
        (f"num_attention_heads x head_dim ({lc.num_attention_heads} x {hd})", lc.num_attention_heads * hd,
         prefix + "self_attn.q_proj.weight", 0),
        (f"num_key_value_heads x head_dim ({lc.num_key_value_heads} x {hd})", lc.num_key_value_heads * hd,
         prefix + "self_attn.k_proj.weight", 0),
    ]
    if draft_vocab is not None:
        rules.append(("draft_vocab_size", draft_vocab, "lm_head.weight", 0))
    for field, says, name, dim in rules:
        t = src.get(name)
        if t is None or t.dim() <= dim or t.shape[dim] == says:
            continue
        where = "" if field == "draft_vocab_size" else scope  # (top level in every dialect)
        raise ValueError(f"{cfg_file}: {where}{field} is {says}, but the weights say {t.shape[dim]} ({name} has shape "
                         f"{tuple(t.shape)}): the config and the weights disagree; correct config.json (or use the "
                         f"config.json published with these weights)")


__all__ = ["check_shapes", "config_int"]
