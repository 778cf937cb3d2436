"""The EAGLE-3 layout as published and as SpecForge exports it, read and written: ``LlamaForCausalLMEagle3`` (or a
config with ``draft_vocab_size``), ``fc.weight`` [H, 3H], ``midlayer.*`` (or ``layers.0.*``), ``norm``, ``lm_head``
[K, H], ``d2t``/``t2d``. RoPE is the head's own (EAGLE's default theta 10000 when the config names none, never the
target's); feature layers default to EAGLE-3's [2, L//2, L-3] of the target.

vLLM speculators' EAGLE-3 and P-EAGLE heads (:mod:`~treedec.heads.formats.speculators`,
:mod:`~treedec.heads.formats.peagle`) hold the same tensors: their config is read here too once their layer's is found.
"""
from __future__ import annotations

from pathlib import Path

import torch

from treedec.heads.config import DraftConfig
from treedec.heads.formats.fields import as_int, flag
from treedec.heads.formats.peagle import block_size
from treedec.models.config import LlamaConfig
from treedec.models.llama import Transformer

LAYER_PREFIX = "midlayer."  # the decoder layer's tensors (SGLang's name; some exports say layers.0.)


def _feature_layers(raw: dict, target: Transformer | None, path: Path) -> list[int]:
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if target is None:
            raise ValueError(f"{path} is an EAGLE-3 head whose config does not name its feature layers: load it with "
                             "its target (load_head(path, target=model)) to use EAGLE-3's [2, L//2, L-3]")
        L = target.config.num_hidden_layers
        ids = [2, L // 2, L - 3]
    if not isinstance(ids, list) or len(ids) != 3:
        raise ValueError(f"{path}: an EAGLE-3 head fuses 3 target layers, its config names {ids!r}")
    ids = [as_int(i, f"the feature layer ids {ids!r} (eagle_aux_hidden_state_layer_ids): layer ids", path)
           for i in ids]
    if target is not None and not all(0 <= i < target.config.num_hidden_layers for i in ids):
        raise ValueError(f"{path} reads target layers {ids}, but the target has {target.config.num_hidden_layers} "
                         f"layers (0..{target.config.num_hidden_layers - 1}): the head was trained for a deeper model")
    return ids


def _vocab_ids(state: dict, K: int, V: int, path: Path) -> torch.Tensor | None:
    """d2t (draft index -> target id offset) as target ids; t2d, where given, must mark the same set."""
    d2t = state.pop("d2t", None)
    t2d = state.pop("t2d", None)
    if d2t is not None and (tuple(d2t.shape) != (K,) or d2t.is_floating_point()):
        raise ValueError(f"{path}: d2t has shape {tuple(d2t.shape)} ({d2t.dtype}), but a draft vocabulary of "
                         f"draft_vocab_size {K} needs integer offsets of shape ({K},); the file is corrupt or belongs "
                         "to another config.json")
    ids = torch.arange(K) if d2t is None else torch.arange(K) + d2t.long()
    if ids.numel() != K or int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != K:
        raise ValueError(f"{path}: d2t maps the {K}-token draft vocabulary outside the target's {V} tokens "
                         "(or twice onto one token); the head belongs to another tokenizer")
    if t2d is not None:
        mark = torch.zeros(V, dtype=torch.bool)
        mark[ids] = True
        if t2d.shape != (V,) or not torch.equal(t2d.bool(), mark):
            raise ValueError(f"{path}: t2d {tuple(t2d.shape)} does not mark the tokens d2t maps to; the file is corrupt")
    return None if K == V and torch.equal(ids, torch.arange(K)) else ids


def read_config(raw: dict, src: dict[str, torch.Tensor], lc: LlamaConfig, K: int, masks: dict, target: Transformer | None,
                common: dict, path: Path) -> tuple[DraftConfig, dict[str, torch.Tensor], list[str]]:
    """(the head's DraftConfig, its state beyond the layer's: ``vocab_ids`` and a P-EAGLE head's ``masks``, the names
    of its tensors outside the layer); pops ``d2t``/``t2d`` from ``src``."""
    if raw.get("target_hidden_size") not in (None, lc.hidden_size):
        raise ValueError(f"{path}: target_hidden_size {raw['target_hidden_size']} != the head's hidden_size "
                         f"{lc.hidden_size}; treedec's EAGLE-3 head reads features of its own width")
    ids = _vocab_ids(src, K, lc.vocab_size, path)
    # the residual around attention is hidden_norm(h): vLLM's default for speculators configs without the key
    nbr = flag(raw, "norm_before_residual", "speculators_model_type" in raw, path)
    kind = dict(kind="parallel", block_size=block_size(raw, path)) if masks else dict(kind="eagle3")
    cfg = DraftConfig.for_target(lc, feature_layers=_feature_layers(raw, target, path),
                                 draft_vocab_size=0 if ids is None else K, norm_before_residual=nbr, **kind, **common)
    state = {} if ids is None else {"vocab_ids": ids}
    state.update(masks)
    return cfg, state, ["fc.weight", "norm.weight", "lm_head.weight"]


def finish_export(cfg: dict, out: dict[str, torch.Tensor], c: DraftConfig, ids: torch.Tensor | None) -> None:
    """The layout's own part of an export: a draft vocabulary as ``d2t``/``t2d``, the feature layers, the norm."""
    K = c.draft_vocab_size or c.vocab_size
    if ids is not None:  # (vLLM refuses a d2t where the draft vocabulary is the target's: it has no place for it)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[ids.long()] = True
        out.update(d2t=ids.long() - torch.arange(K), t2d=t2d)
    layers = [int(i) for i in c.feature_layers]
    cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=K, eagle_aux_hidden_state_layer_ids=layers,
               eagle_config={"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
               norm_before_residual=c.norm_before_residual)  # vLLM reads it; EAGLE-3's own code has it false


__all__ = ["LAYER_PREFIX", "finish_export", "read_config"]
