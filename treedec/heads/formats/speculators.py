"""vLLM speculators' EAGLE-3 layout (``speculators_model_type: eagle3``), read: the layer's config under
``transformer_layer_config``, layer ids in ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual`` (true when
absent, as vLLM reads it); the tensors are EAGLE-3's (:mod:`treedec.heads.formats.eagle3`)."""
from __future__ import annotations

from pathlib import Path

import torch

from treedec.heads.formats.fields import config_int


def layer_raw(raw: dict, src: dict[str, torch.Tensor], path: Path) -> dict:
    """The decoder layer's config (with the top level's ``draft_vocab_size``), refusing a head of several layers and
    ``norm_before_fc`` heads."""
    lr = {**raw.get("transformer_layer_config", {}), **{k: raw[k] for k in ("draft_vocab_size",) if k in raw}}
    if not raw.get("transformer_layer_config"):
        raise ValueError(f"{path / 'config.json'}: a speculators config needs transformer_layer_config")
    n = config_int(lr, "num_hidden_layers", path / "config.json", "transformer_layer_config.num_hidden_layers")
    if n not in (None, 1):
        raise ValueError(f"{path}: a {n}-layer speculators EAGLE-3 head; an EAGLE-3 head has one layer (its midlayer), "
                         "and only P-EAGLE heads (speculators_model_type peagle) load with several")
    if raw.get("norm_before_fc") or "input_norm.weight" in src:
        raise ValueError(f"{path}: norm_before_fc heads (an RMSNorm before fc) are not supported")
    return lr


__all__ = ["layer_raw"]
