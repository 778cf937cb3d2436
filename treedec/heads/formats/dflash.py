"""DFlash drafters as z-lab publishes them (``DFlashDraftModel``, e.g. ``z-lab/Qwen3-8B-DFlash-b16``) -> a treedec
``dflash`` head.

config.json: a Qwen3 (or Llama) layer config with ``num_hidden_layers`` drafter layers, ``block_size`` B (the block
holds the root too: B - 1 drafted depths; top level, or in ``dflash_config``), ``dflash_config.mask_token_id`` and
``dflash_config.target_layer_ids`` (DFlash counts *outputs* of target layers: id i is treedec's input of layer i + 1;
absent: DFlash's default for ``num_target_layers``). Tensors: ``fc.weight`` [H, n·H], ``hidden_norm.weight``,
``norm.weight``, ``layers.{i}.*`` (q/k norms for Qwen3); no embedding and no LM head: the drafter's mask input is the
target's embedding row of the mask token and its LM head is the target's, so such a head loads with its target
(an ``embed_tokens`` / ``lm_head`` in the file is used where present). Sliding-window layers are refused: treedec's
drafter attends to the whole context.
"""
from __future__ import annotations

from pathlib import Path

import torch

from treedec.heads.config import DraftConfig, dflash_layers
from treedec.heads.formats.fields import as_int, check_shapes, layer_config
from treedec.heads.formats.peagle import MASK_KEYS
from treedec.models.llama import Transformer

LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def is_dflash(raw: dict, keys=()) -> bool:
    """z-lab's ``DFlashDraftModel`` (by architecture, auto_map or a ``dflash_config`` without a P-EAGLE mask key: newer
    vLLM P-EAGLE configs carry a ``dflash_config`` too), speculators' ``dflash``, or tensors laid out as one (a
    top-level ``hidden_norm`` and no ``lm_head``)."""
    archs = [a for a in raw.get("architectures") or [] if isinstance(a, str)]
    auto = " ".join(str(v) for v in (raw.get("auto_map") or {}).values()) if isinstance(raw.get("auto_map"), dict) else ""
    return str(raw.get("speculators_model_type", "")).lower().startswith("dflash") or \
        any("dflash" in a.lower() for a in archs) or "dflash" in auto.lower() or \
        ("dflash_config" in raw and not any(k in raw for k in MASK_KEYS)) or \
        ("hidden_norm.weight" in keys and "lm_head.weight" not in keys)


def _dflash_config(raw: dict, path: Path) -> dict:
    if "speculators_model_type" in raw:
        raise ValueError(f"{path / 'config.json'}: a speculators DFlash drafter (speculators_model_type "
                         f"{raw['speculators_model_type']!r}); treedec reads z-lab's DFlash layout (DFlashDraftModel, "
                         "a dflash_config key): convert it to that layout")
    dc = raw.get("dflash_config") or {}
    if not isinstance(dc, dict):
        raise ValueError(f"{path / 'config.json'}: dflash_config must be an object, got {dc!r}")
    return dc


def block_size(raw: dict, path: Path) -> int:
    """The depths a block drafts: DFlash's ``block_size`` (top level or in ``dflash_config``) minus its root."""
    dc = _dflash_config(raw, path)
    B = raw.get("block_size", dc.get("block_size"))
    if B is None:
        raise ValueError(f"{path / 'config.json'}: a DFlash drafter's config names its block_size (e.g. 16); none found")
    B = as_int(B, "block_size", path)
    if B < 2:
        raise ValueError(f"{path / 'config.json'}: block_size {B}: a DFlash block holds the root and at least one "
                         "drafted position")
    return B - 1


def feature_layers(raw: dict, n_draft: int, path: Path, target: Transformer | None) -> list[int] | None:
    """treedec's feature-layer ids (inputs of target layers) of DFlash's ``target_layer_ids`` (outputs); None where the
    config names neither them nor ``num_target_layers`` and no target is given."""
    dc = _dflash_config(raw, path)
    ids = dc.get("target_layer_ids")
    if ids is None:
        n = raw.get("num_target_layers") or (target.config.num_hidden_layers if target is not None else None)
        return None if n is None else dflash_layers(as_int(n, "num_target_layers", path), n_draft)
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{path / 'config.json'}: dflash_config.target_layer_ids must be a list of layer ids, "
                         f"got {ids!r}")
    return [as_int(i, f"dflash_config.target_layer_ids {ids!r}: layer ids", path) + 1 for i in ids]


def read(raw: dict, src: dict[str, torch.Tensor], target: Transformer | None,
         path: Path) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """(treedec DraftConfig, state dict) of a z-lab DFlash drafter's config and tensors (published names)."""
    cfg_file = path / "config.json"
    if not is_dflash(raw):
        raise ValueError(f"{cfg_file}: the tensors are a DFlash drafter's (hidden_norm.weight, no lm_head.weight), but "
                         "the config is not (no DFlashDraftModel architecture, no dflash_config): use the config.json "
                         "published with these weights")
    dc = _dflash_config(raw, path)
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
        raise ValueError(f"{cfg_file}: this DFlash drafter has sliding-window layers (use_sliding_window / "
                         "layer_types); treedec's DFlash layers attend to the whole context, so it cannot serve them")
    src = {k.removeprefix("model."): v for k, v in src.items()}
    n = as_int(raw.get("num_hidden_layers", 1), "num_hidden_layers", path)
    found = {int(k.split(".")[1]) for k in src if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if found != set(range(n)):
        raise ValueError(f"{cfg_file}: num_hidden_layers is {n}, but the weights hold layers {sorted(found)}: the "
                         "config and the weights disagree")
    lc = layer_config({k: v for k, v in raw.items() if k != "dflash_config"}, path)
    if "rope_theta" not in raw and isinstance(raw.get("rope_parameters"), dict):
        lc.rope_theta = float(raw["rope_parameters"].get("rope_theta", lc.rope_theta))
    lc.qk_norm = "layers.0.self_attn.q_norm.weight" in src
    check_shapes(lc, None, src, "layers.0.", cfg_file)
    if target is None:
        raise ValueError(f"{path} is a DFlash drafter: its mask input and LM head are its target's, so load it with "
                         "its target (load_head(path, target=model), or draft.path= in a command)")
    layers = feature_layers(raw, n, path, target)
    L, H = target.config.num_hidden_layers, lc.hidden_size
    if any(not 0 <= i <= L for i in layers):
        raise ValueError(f"{cfg_file}: dflash_config.target_layer_ids {[i - 1 for i in layers]} reach past the "
                         f"target's {L} layers (ids 0..{L - 1}): the drafter was trained for a deeper model")
    fc = src.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (H, len(layers) * H):
        raise ValueError(f"{cfg_file}: dflash_config.target_layer_ids names {len(layers)} layers, so fc.weight should "
                         f"be {(H, len(layers) * H)}, but it is {tuple(fc.shape)}: the config and the weights disagree")
    mask_id = dc.get("mask_token_id")
    if mask_id is None:
        raise ValueError(f"{cfg_file}: a DFlash drafter's dflash_config names its mask_token_id; none found")
    mask_id = as_int(mask_id, "dflash_config.mask_token_id", path)
    if not 0 <= mask_id < lc.vocab_size:
        raise ValueError(f"{cfg_file}: dflash_config.mask_token_id {mask_id} is outside the vocabulary of "
                         f"{lc.vocab_size} tokens")
    embed = src.pop("embed_tokens.weight", None)
    lm = src.pop("lm_head.weight", None)
    state = {"mask_embed": (target.model.embed_tokens.weight if embed is None else embed)[mask_id].detach().clone(),
             "lm_head.weight": (target.lm_head.weight if lm is None else lm).detach().clone()}
    want = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
        f"layers.{i}.{t}" for i in range(n) for t in LAYER_TENSORS + (
            ("self_attn.q_norm.weight", "self_attn.k_norm.weight") if lc.qk_norm else ())]
    if lc.qkv_bias:
        want += [f"layers.{i}.self_attn.{p}_proj.bias" for i in range(n) for p in "qkv"]
    if lc.o_bias:
        want += [f"layers.{i}.self_attn.o_proj.bias" for i in range(n)]
    missing = [k for k in want if k not in src]
    if missing:
        raise ValueError(f"{path} (DFlash layout): missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    state.update({k: src.pop(k) for k in want})
    if src:
        raise ValueError(f"{path} (DFlash layout): unexpected tensors {sorted(src)[:8]}"
                         f"{' ...' if len(src) > 8 else ''}; they have no place in a DFlash drafter")
    cfg = DraftConfig(hidden_size=H, intermediate_size=lc.intermediate_size,
                      num_attention_heads=lc.num_attention_heads, num_key_value_heads=lc.num_key_value_heads,
                      head_dim=lc.head_dim, vocab_size=lc.vocab_size, max_position_embeddings=lc.max_position_embeddings,
                      rms_norm_eps=lc.rms_norm_eps, rope_theta=lc.rope_theta, rope_scaling=lc.rope_scaling,
                      kind="dflash", feature_layers=layers, target=str(path), qkv_bias=lc.qkv_bias, o_bias=lc.o_bias,
                      qk_norm=lc.qk_norm, block_size=block_size(raw, path), draft_layers=n)
    return cfg, state


__all__ = ["block_size", "feature_layers", "is_dflash", "read"]
