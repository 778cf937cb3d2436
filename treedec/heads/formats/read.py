"""Published draft-head directories -> treedec's (DraftConfig, state dict): :func:`convert`, which ``load_head``
builds a head from; :func:`published_summary`, what a config check needs of one without reading its weights.

A directory with a ``config.json`` and no ``draft_config.json`` is a head trained elsewhere; its layout is told by
the config (:func:`detect`), each read by its file of this package: ``eagle`` (:mod:`~treedec.heads.formats.eagle`),
``eagle3`` (:mod:`~treedec.heads.formats.eagle3`), ``speculators`` (:mod:`~treedec.heads.formats.speculators`),
``peagle`` (:mod:`~treedec.heads.formats.peagle`), ``dflash`` (:mod:`~treedec.heads.formats.dflash`).
Weights come from :mod:`~treedec.heads.formats.weights`. A head that does not fit its target, or whose tensors do not
match its layout, is an error naming both.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from treedec.heads.config import DraftConfig
from treedec.heads.formats import dflash, eagle, eagle3, peagle, speculators
from treedec.heads.formats.fields import as_int, check_shapes, layer_config
from treedec.heads.formats.weights import read_weights
from treedec.models.checkpoint import WEIGHTS, _keys, read_json_object
from treedec.models.config import LlamaConfig
from treedec.models.llama import Transformer

LAYOUTS = ("eagle", "eagle3", "speculators", "peagle", "dflash")
# Buffers and tensors a published head may carry that treedec recomputes or takes from the target.
_SKIP = ("rotary_emb.inv_freq", "verifier_lm_head.weight", "verifier_norm.weight")


def detect(raw: dict, path: Path | str = "config.json") -> str:
    """The layout of a head's config.json (``path``, named in errors): eagle | eagle3 | speculators | peagle | dflash
    (an error otherwise, e.g. a GPT-2 config, which would otherwise read as an EAGLE-1 head of Llama's shape)."""
    if dflash.is_dflash(raw):
        return "dflash"
    if peagle.is_peagle(raw):
        return "peagle"
    kind = raw.get("speculators_model_type")
    if kind is not None:
        if kind != "eagle3":
            raise ValueError(f"{path}: speculators_model_type={kind!r}; treedec loads speculators 'eagle3' and 'peagle' "
                             "heads only")
        return "speculators"
    archs = raw.get("architectures") or ["LlamaForCausalLM"]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"{path}: architectures must be a list of class names, got {archs!r}")
    if any("Eagle3" in a for a in archs) or "draft_vocab_size" in raw:
        return "eagle3"
    eagle.check_config(raw, archs, path)
    return "eagle"


def convert(path: str | Path, target: Transformer | None = None) -> tuple[DraftConfig, dict[str, torch.Tensor], str]:
    """(treedec DraftConfig, treedec state dict, layout) of a published head directory."""
    path = Path(path)
    raw = read_json_object(path / "config.json", "restore the head's config.json from where it was published")
    layout = detect(raw, path / "config.json")
    src = {k: v for k, v in read_weights(path).items() if not k.endswith(_SKIP)}
    if layout == "dflash" or dflash.is_dflash(raw, set(src)):  # (tensors laid out as one, whatever the config says)
        cfg, state = dflash.read(raw, src, target, path)
        _check_fits(path, layer_config(raw, path), target, None)
        return cfg, state, "dflash"
    layout = "peagle" if layout == "eagle3" and "mask_hidden" in src else layout
    layer_raw, n_layers = peagle.layer_raw(raw, path, src) if layout == "peagle" else \
        (speculators.layer_raw(raw, src, path) if layout == "speculators" else raw, 1)
    lc = layer_config(layer_raw, path)
    prefix = eagle3.LAYER_PREFIX if any(k.startswith(eagle3.LAYER_PREFIX) for k in src) else eagle.LAYER_PREFIX
    K = None if layout == "eagle" else as_int(layer_raw.get("draft_vocab_size") or lc.vocab_size, "draft_vocab_size",
                                              path)
    scope = "transformer_layer_config." if "speculators_model_type" in raw else ""
    check_shapes(lc, K, src, prefix, path / "config.json", scope)
    if layout == "eagle" and not (lc.qkv_bias or lc.o_bias):
        eagle.drop_fold(src, "fc.bias" in src, path)
    masks: dict[str, torch.Tensor] = {}
    if layout == "peagle":  # its mask token's row of embed_tokens, fc(mask_hidden); the rest of the table is checked
        masks, embed = peagle.mask_tensors(src, raw, lc.vocab_size, lc.hidden_size, target, path)
    else:
        embed = src.pop("embed_tokens.weight", None)  # the target's is used; checked against it
    _check_fits(path, lc, target, embed)
    state: dict[str, torch.Tensor] = {}
    for k in list(src):  # the layer: published prefix -> treedec's "layer."
        if k.startswith(prefix):
            state["layer." + k[len(prefix):]] = src.pop(k)
    state.update(peagle.later_layers(src, lc, n_layers, path / "config.json", scope))  # a P-EAGLE's layers 1..N-1
    mine = _treedec_key(raw, path)  # what treedec's export recorded of the head's target (other engines ignore it)
    common = dict(target=mine.get("target") or str(path), target_fingerprint=mine.get("target_fingerprint", ""),
                  qkv_bias=lc.qkv_bias, o_bias=lc.o_bias, qk_norm=lc.qk_norm, draft_layers=n_layers)
    if layout == "eagle":
        cfg, names = eagle.read_config(raw, lc, common, path)
    else:
        cfg, extra, names = eagle3.read_config(raw, src, lc, K, masks, target, common, path)
        state.update(extra)
    for n in names:
        if n in src:
            state[n] = src.pop(n)
    if src:
        raise ValueError(f"{path} ({layout} layout): unexpected tensors {sorted(src)[:8]}"
                         f"{' ...' if len(src) > 8 else ''}; they have no place in treedec's head (e.g. fc.bias with "
                         f"\"bias\": false in config.json, or a layer treedec does not build)")
    return cfg, state, layout


def _treedec_key(raw: dict, path: Path) -> dict[str, str]:
    """config.json's ``"treedec"`` object (``{"target": name, "target_fingerprint": hash}``, written by
    :func:`~treedec.heads.formats.write.to_published`), {} where absent: bind warns when the head meets a target of another fingerprint."""
    mine = raw.get("treedec") or {}
    if not isinstance(mine, dict) or not all(isinstance(mine.get(k, ""), str) for k in ("target", "target_fingerprint")):
        raise ValueError(f"{path / 'config.json'}: \"treedec\" must be an object of strings "
                         f"({{\"target\": ..., \"target_fingerprint\": ...}}), got {mine!r}; drop the key or re-export")
    return mine


def _check_fits(path: Path, cfg: LlamaConfig, target: Transformer | None, embed: torch.Tensor | None) -> None:
    if target is None:
        return
    tc = target.config
    if (tc.vocab_size, tc.hidden_size) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"the draft head at {path} (vocab {cfg.vocab_size}, hidden {cfg.hidden_size}) does not fit "
                         f"the target (vocab {tc.vocab_size}, hidden {tc.hidden_size}): use the head published for "
                         "this target")
    if embed is not None:
        own = target.model.embed_tokens.weight.detach().float().cpu()
        if embed.shape != own.shape or not torch.allclose(embed.float(), own, atol=1e-2, rtol=1e-2):
            warnings.warn(f"the draft head at {path} carries an embedding that differs from the target's; treedec "
                          "uses the target's (output stays exact, acceptance may drop)", stacklevel=3)


def published_summary(path: str | Path) -> dict:
    """``{"kind", "block_size", "feature_layers"}`` of the published head at ``path`` (``feature_layers`` None where
    the config names none: EAGLE-3's default for the target), from its ``config.json`` and tensor names alone (no
    weights read), so that a config check (``train init_from=``, ``calibrate draft.path=``) can refuse a head of the
    wrong kind before any model loads. Errors are :func:`detect`'s, as :func:`convert`'s."""
    path = Path(path)
    raw = read_json_object(path / "config.json", "restore the head's config.json from where it was published")
    layout = detect(raw, path / "config.json")
    if layout == "eagle":
        return {"kind": "eagle", "block_size": 0, "feature_layers": [-1]}
    if layout == "dflash":
        n = as_int(raw.get("num_hidden_layers", 1), "num_hidden_layers", path)
        return {"kind": "dflash", "block_size": dflash.block_size(raw, path),
                "feature_layers": dflash.feature_layers(raw, n, path, None)}
    if layout == "eagle3" and (path / WEIGHTS).is_file() and "mask_hidden" in _keys(path / WEIGHTS):
        layout = "peagle"  # an EAGLE-3 config over P-EAGLE tensors (convert() decides the same way)
    layers = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if layout == "peagle":
        return {"kind": "parallel", "block_size": peagle.block_size(raw, path), "feature_layers": layers}
    return {"kind": "eagle3", "block_size": 0, "feature_layers": layers}


__all__ = ["LAYOUTS", "convert", "detect", "published_summary"]
