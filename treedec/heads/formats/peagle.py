"""Published P-EAGLE heads -> treedec ``ParallelHead`` (kind "parallel").

:mod:`treedec.heads.formats.read` calls these for a ``config.json`` that :func:`is_peagle` recognises. Two dialects:

* vLLM's flat EAGLE-3 config (``LlamaForCausalLMEagle3`` / ``Eagle3LlamaForCausalLM`` / ``PEagleDraftModel`` /
  ``PeagleLlamaForCausalLM``, a LlamaConfig at top level): the mask token id in ``ptd_token_id`` (older vLLM) or
  ``pard_token`` (newer); ``norm_before_residual`` false when absent.
* speculators (``speculators_model_type: peagle``): the layer's config under ``transformer_layer_config``, the mask
  token id in ``mask_token_id`` (``ptd_token_id`` in some versions), ``norm_before_residual`` true when absent (as
  vLLM reads a speculators config), K in ``speculators_config.proposal_methods[].speculative_tokens``.

Tensors are EAGLE-3's (``fc``, ``midlayer.*`` / ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``/``t2d``) plus
``mask_hidden`` [1, 1, 3H] (the pre-``fc`` feature of every mask position: treedec keeps ``fc(mask_hidden)``, the same
thing since ``fc`` has no bias) and usually ``embed_tokens.weight`` (P-EAGLE trains it; treedec's ``mask_embed`` is
its row of the mask token, the other rows are the target's as for any EAGLE-3 head; without the table the row is
the target's). K (``block_size``) is ``num_speculative_tokens``, the speculators proposal's ``speculative_tokens``,
``num_depths`` or ``para_depths``, in that order.

Refused, each with a one-line error: several decoder layers (treedec's heads have one), no mask token id, no K,
and ``norm_before_fc`` / ``fc_norm`` heads (DFlash drafters: :mod:`treedec.heads.formats.dflash`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from treedec.heads.formats.fields import config_int

MASK_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")  # + dflash_config.mask_token_id (newer vLLM reads it)
K_KEYS = ("num_speculative_tokens", "num_depths", "para_depths")
_ARCH = ("peagle", "ptd")  # (case-insensitive) in an architecture name: PEagleDraftModel, PeagleLlamaForCausalLM


def is_peagle(raw: dict) -> bool:
    """Whether a head's config.json describes a P-EAGLE head (either dialect)."""
    if "speculators_model_type" in raw:
        return raw["speculators_model_type"] == "peagle"
    archs = [a.lower() for a in raw.get("architectures") or [] if isinstance(a, str)]
    return any(k in raw for k in MASK_KEYS) or any(s in a for a in archs for s in _ARCH)


def layer_raw(raw: dict, path: Path, keys=()) -> dict:
    """The decoder layer's config (speculators: ``transformer_layer_config``; flat: the config itself), refusing a
    head of several layers (by the config, or by tensors ``layers.<i>.*`` with i > 0 in ``keys``)."""
    lr = raw
    if "speculators_model_type" in raw:
        if not isinstance(raw.get("transformer_layer_config"), dict):
            raise ValueError(f"{path / 'config.json'}: a speculators config needs transformer_layer_config")
        lr = {**raw["transformer_layer_config"], **{k: raw[k] for k in ("draft_vocab_size",) if k in raw}}
    found = [int(k.split(".")[1]) + 1 for k in keys if k.startswith("layers.") and k.split(".")[1].isdigit()]
    held = max(found, default=1 if any(k.startswith("midlayer.") for k in keys) else 0)
    field = ("transformer_layer_config." if lr is not raw else "") + "num_hidden_layers"
    n = config_int(lr, "num_hidden_layers", path / "config.json", field,
                   f"{held} layer{'s' if held != 1 else ''}" if held else None)
    n = max([1 if n is None else n, *found])
    if n != 1:
        raise ValueError(f"{path / 'config.json'}: num_hidden_layers={n}: a {n}-layer P-EAGLE drafter; treedec's draft "
                         "heads have one layer (one EAGLE-3 midlayer), so it cannot be loaded")
    return lr


def _int(value, what: str, path: Path) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path / 'config.json'}: {what} must be an integer, got {value!r}")
    return value


def mask_token_id(raw: dict, vocab: int, path: Path) -> int:
    """The id whose embedding every mask position reads (the keys of :data:`MASK_KEYS`, which must agree)."""
    found = {k: raw[k] for k in MASK_KEYS if raw.get(k) is not None}
    dc = raw.get("dflash_config")
    if isinstance(dc, dict) and dc.get("mask_token_id") is not None:
        found["dflash_config.mask_token_id"] = dc["mask_token_id"]
    if not found:
        raise ValueError(f"{path / 'config.json'}: a P-EAGLE head's mask positions read the embedding of its mask token, "
                         f"and the config names none ({', '.join(MASK_KEYS)}); add the id it was trained with")
    if len(set(map(str, found.values()))) > 1:
        raise ValueError(f"{path / 'config.json'}: the mask token ids disagree ({found}); keep the one it was trained with")
    key, mid = next(iter(found.items()))
    mid = _int(mid, f"{key} (the mask token id)", path)
    if not 0 <= mid < vocab:
        raise ValueError(f"{path / 'config.json'}: {key}={mid} is outside the vocabulary (0..{vocab - 1})")
    return mid


def block_size(raw: dict, path: Path) -> int:
    """K: positions one pass drafts (depth 1 from the root, 2..K from mask positions)."""
    k = next((raw[key] for key in K_KEYS[:1] if raw.get(key) is not None), None)
    sc = raw.get("speculators_config")
    if k is None and isinstance(sc, dict) and isinstance(sc.get("proposal_methods"), list):
        methods = [m for m in sc["proposal_methods"] if isinstance(m, dict) and "speculative_tokens" in m]
        default = [m for m in methods if m.get("proposal_type") == sc.get("default_proposal_method")]
        k = (default or methods or [{}])[0].get("speculative_tokens")
    k = next((raw[key] for key in K_KEYS[1:] if raw.get(key) is not None), None) if k is None else k
    if k is None:
        raise ValueError(f"{path / 'config.json'}: a P-EAGLE head drafts K positions per pass and the config names no K "
                         "(num_speculative_tokens, speculators_config.proposal_methods[].speculative_tokens, num_depths "
                         "or para_depths); add \"num_speculative_tokens\": K, at most the depths it was trained for")
    k = _int(k, "the number of positions drafted per pass (num_speculative_tokens)", path)
    if k < 1:
        raise ValueError(f"{path / 'config.json'}: num_speculative_tokens={k}; a P-EAGLE head drafts at least 1")
    return k


def mask_tensors(src: dict[str, torch.Tensor], raw: dict, vocab: int, hidden: int, target,
                 path: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(treedec's ``mask_embed`` [H] and ``mask_hidden`` [H], the head's embedding table with the mask row set to the
    target's for the embedding check, or None), popping ``mask_hidden`` and ``embed_tokens.weight`` from ``src``."""
    if raw.get("norm_before_fc") or raw.get("fc_norm") or "input_norm.weight" in src or \
            any(k.startswith("fc_norm.") for k in src):
        raise ValueError(f"{path}: norm_before_fc / fc_norm heads (an RMSNorm before or after fc) are not supported")
    mid = mask_token_id(raw, vocab, path)
    mh = src.pop("mask_hidden", None)
    if mh is None:
        raise ValueError(f"{path}: a P-EAGLE head needs mask_hidden (the feature of its mask positions); the weights "
                         "have none")
    mh = mh.reshape(-1).float()
    fc = src.get("fc.weight")
    if mh.numel() == hidden:
        hidden_h = mh
    elif fc is not None and mh.numel() == fc.shape[1]:
        hidden_h = fc.float() @ mh  # fc has no bias: fc(mask_hidden) is what every mask position's midlayer reads
    else:
        raise ValueError(f"{path}: mask_hidden has {mh.numel()} values; it must be fc's input width "
                         f"({None if fc is None else fc.shape[1]}) or the hidden size ({hidden})")
    embed = src.pop("embed_tokens.weight", None)
    if embed is not None:
        if tuple(embed.shape) != (vocab, hidden):
            raise ValueError(f"{path}: embed_tokens.weight has shape {tuple(embed.shape)}, not ({vocab}, {hidden})")
        mask_embed = embed[mid].float().clone()
        if target is not None:  # the other rows are the target's in treedec: compare those
            embed = embed.clone()
            embed[mid] = target.model.embed_tokens.weight[mid].detach().to(embed.device, embed.dtype)
    elif target is not None:
        mask_embed = target.model.embed_tokens.weight[mid].detach().float().cpu().clone()
    else:
        raise ValueError(f"{path}: a P-EAGLE head without embed_tokens.weight reads its mask token's ({mid}) embedding "
                         "from the target's table: load it with its target (load_head(path, target=model))")
    return {"mask_embed": mask_embed, "mask_hidden": hidden_h}, embed


__all__ = ["MASK_KEYS", "block_size", "is_peagle", "layer_raw", "mask_tensors", "mask_token_id"]
