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

A drafter of N > 1 decoder layers (``num_hidden_layers``, the speculators layer config's; published ones have 4, e.g.
amazon/GPT-OSS-20B-P-EAGLE) holds layer 0 as above (the EAGLE-3 midlayer, q/k/v over 2H) and layers 1..N-1 as plain
Llama layers ``layers.{i}.*`` (``input_layernorm``, ``self_attn`` over H, ``post_attention_layernorm``, ``mlp``; a
``hidden_norm`` there is vLLM's unused one, dropped): treedec's ``layers_after.{i-1}.*``.

Written (``python -m treedec.export_head format=peagle``, :func:`finish_export`) as vLLM's flat dialect, which its
``method: eagle3`` with ``parallel_drafting: true`` loads: the EAGLE-3 export plus ``mask_token_id``,
``num_speculative_tokens``, ``mask_hidden`` [1, 3H] (fc's input that fc maps to treedec's mask feature) and the
target's embedding table with the mask token's row set to treedec's ``mask_embed``.

Refused, each with a one-line error: layers that disagree with ``num_hidden_layers`` or skip an index, a later layer
that reads 2H, no mask token id, no K, and ``norm_before_fc`` / ``fc_norm`` heads (DFlash drafters:
:mod:`treedec.heads.formats.dflash`).
"""
from __future__ import annotations

from pathlib import Path

import torch

from treedec.heads.formats.fields import check_shapes, config_int
from treedec.models.config import LlamaConfig
from treedec.models.llama import DecoderLayer

MASK_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")  # + dflash_config.mask_token_id (newer vLLM reads it)
K_KEYS = ("num_speculative_tokens", "num_depths", "para_depths")
_ARCH = ("peagle", "ptd")  # (case-insensitive) in an architecture name: PEagleDraftModel, PeagleLlamaForCausalLM


def is_peagle(raw: dict) -> bool:
    """Whether a head's config.json describes a P-EAGLE head (either dialect)."""
    if "speculators_model_type" in raw:
        return raw["speculators_model_type"] == "peagle"
    archs = [a.lower() for a in raw.get("architectures") or [] if isinstance(a, str)]
    return any(k in raw for k in MASK_KEYS) or any(s in a for a in archs for s in _ARCH)


def layer_raw(raw: dict, path: Path, keys=()) -> tuple[dict, int]:
    """(the decoder layers' config: speculators' ``transformer_layer_config``, else the config itself; their number N),
    N from ``num_hidden_layers``, or from the tensors ``keys`` where the config names none, and checked against them:
    layer 0 under ``midlayer.`` or ``layers.0.``, then ``layers.1.`` .. ``layers.{N-1}.``, none missing or extra."""
    lr, cfg_file = raw, path / "config.json"
    if "speculators_model_type" in raw:
        if not isinstance(raw.get("transformer_layer_config"), dict):
            raise ValueError(f"{cfg_file}: a speculators config needs transformer_layer_config")
        lr = {**raw["transformer_layer_config"], **{k: raw[k] for k in ("draft_vocab_size",) if k in raw}}
    found = {int(k.split(".")[1]) for k in keys if k.startswith("layers.") and k.split(".")[1].isdigit()}
    mid = any(k.startswith("midlayer.") for k in keys)
    held = sorted(found | ({0} if mid else set()))
    n_held = held[-1] + 1 if held else 0
    field = ("transformer_layer_config." if lr is not raw else "") + "num_hidden_layers"
    n = config_int(lr, "num_hidden_layers", cfg_file, field,
                   f"{n_held} layer{'s' if n_held != 1 else ''}" if held else None)
    if n is not None and n < 1:
        raise ValueError(f"{cfg_file}: \"{field}\" is {n}; a P-EAGLE drafter has at least its EAGLE-3 midlayer (1)")
    says = f"\"{field}\" is {n}, but" if n is not None else f"\"{field}\" is absent and"
    n = (n_held or 1) if n is None else n
    if held and held != list(range(n)):
        names = ", ".join("midlayer.*" if i == 0 and mid else f"layers.{i}.*" for i in held)
        gaps = ", ".join(f"layers.{i}.*" for i in range(max(n, n_held)) if i not in held)
        raise ValueError(f"{cfg_file}: {says} the weights hold {names}{f' (no {gaps})' if gaps else ''}: a P-EAGLE "
                         "drafter's layers are 0 (midlayer.* or layers.0.*) to N-1 (layers.{N-1}.*); correct "
                         "config.json, or fetch the whole checkpoint")
    return lr, n


def later_layers(src: dict[str, torch.Tensor], lc: LlamaConfig, n: int, cfg_file: Path,
                 scope: str = "") -> dict[str, torch.Tensor]:
    """Layers 1..``n``-1 (plain Llama layers over H), popped from ``src``, under treedec's names
    (``layers_after.{i-1}.*``); a ``hidden_norm`` there (vLLM builds one per layer and uses layer 0's) is dropped,
    anything else beyond a Llama layer's tensors is left in ``src`` (the caller lists it as unexpected).
    ``scope``: where the layer fields sit in config.json (as :func:`~treedec.heads.formats.fields.check_shapes`)."""
    with torch.device("meta"):  # (the names of this config's layer: biases, q/k norms; no memory)
        names = list(DecoderLayer(lc).state_dict())
    state = {}
    for i in range(1, n):
        p = f"layers.{i}."
        src.pop(p + "hidden_norm.weight", None)
        check_shapes(lc, None, src, p, cfg_file, scope)
        q = src.get(p + "self_attn.q_proj.weight")
        if q is not None and q.dim() == 2 and q.shape[1] != lc.hidden_size:
            raise ValueError(f"{cfg_file.parent}: {p}self_attn.q_proj.weight has shape {tuple(q.shape)}: a P-EAGLE "
                             f"layer after the first reads the hidden state ({lc.hidden_size} wide), not "
                             f"{q.shape[1]}; treedec serves drafters whose layers 1.. are plain Llama layers")
        missing = [p + k for k in names if p + k not in src]
        if missing:
            raise ValueError(f"{cfg_file.parent} (peagle layout): missing tensors {missing[:6]}"
                             f"{' ...' if len(missing) > 6 else ''}; layer {i} of a P-EAGLE drafter is a whole Llama "
                             "decoder layer: fetch the whole checkpoint")
        state.update({f"layers_after.{i - 1}.{k}": src.pop(p + k) for k in names})
    return state


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


def finish_export(cfg: dict, out: dict[str, torch.Tensor], block: int, mask: dict[str, torch.Tensor],
                  embed: torch.Tensor, mask_id: int) -> None:
    """The P-EAGLE part of an export (after EAGLE-3's): the mask token and K in ``cfg``; ``mask_hidden`` as fc's input
    (the least-norm solution of fc(m) = treedec's mask feature: fc [H, 3H] has full row rank) and ``embed`` with the
    mask token's row set to ``mask["mask_embed"]`` in ``out``."""
    fc = out["fc.weight"].double()
    h = mask["mask_hidden"].double().reshape(-1, 1)
    m = torch.linalg.lstsq(fc, h, driver="gelsd").solution if fc.shape[0] < fc.shape[1] else None
    if m is None or float((fc @ m - h).norm()) > 1e-6 * float(h.norm()) + 1e-9:
        raise ValueError(f"the head's fc ({tuple(fc.shape)}) cannot map any input onto its mask feature, so vLLM's "
                         "P-EAGLE layout (mask_hidden before fc) cannot hold it; keep the head in treedec's format")
    table = embed.detach().float().cpu().clone()
    table[mask_id] = mask["mask_embed"].float().cpu()
    out.update({"mask_hidden": m.reshape(1, 1, -1).float(), "embed_tokens.weight": table})
    cfg.update(mask_token_id=mask_id, num_speculative_tokens=block)


__all__ = ["MASK_KEYS", "block_size", "finish_export", "is_peagle", "later_layers", "layer_raw", "mask_tensors",
           "mask_token_id"]
