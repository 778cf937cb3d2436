"""config.json fields every published layout shares (the head layer's config, integers and flags), and the fields
against the weights: a field that fixes a tensor's shape is checked against that tensor before anything is built from
either, so a mistake in one names the field, what it says and what the weights say (never a later complaint about a
derived tensor, nor torch's several-line size mismatch). A layout's own fields are checked in its file."""
from __future__ import annotations

from pathlib import Path

import torch

from treedec.models.config import LlamaConfig


def flag(raw: dict, key: str, default: bool, path: Path) -> bool:
    """A true/false key of a head's config.json: a string such as "false" is an error, never truthy."""
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{path / 'config.json'}: \"{key}\" must be true or false (JSON booleans), got {value!r}")
    return value


def as_int(value, what: str, path: Path) -> int:
    """``value`` as an int where it is one (a JSON integer): a float or a string is an error, never truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path / 'config.json'}: {what} must be integers, got {value!r}")
    return value


def layer_config(raw: dict, path: Path) -> LlamaConfig:
    """The head layer's LlamaConfig (Qwen2 layers: q/k/v biases; Qwen3 layers: q/k norms); the head's own RoPE."""
    archs, model_type = " ".join(raw.get("architectures") or []), raw.get("model_type")
    arch = "Qwen3ForCausalLM" if "Qwen3" in archs or model_type == "qwen3" else \
        "Qwen2ForCausalLM" if "Qwen2" in archs or model_type == "qwen2" else "LlamaForCausalLM"
    d = {k: v for k, v in raw.items() if k not in ("architectures", "num_hidden_layers")}
    d.setdefault("rope_theta", 10000.0)  # EAGLE's rotary default: never the target's theta
    try:
        cfg = LlamaConfig.from_hf({**d, "architectures": [arch], "num_hidden_layers": 1})
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from e
    if raw.get("qkv_bias") is not None:  # some EAGLE Qwen2 heads say so explicitly
        cfg.qkv_bias = flag(raw, "qkv_bias", cfg.qkv_bias, path)
    return cfg


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


__all__ = ["as_int", "check_shapes", "config_int", "flag", "layer_config"]
