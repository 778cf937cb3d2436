"""The EAGLE-1/2 layout as published (e.g. EAGLE-LLaMA3-Instruct-8B), read and written: a 1-layer
``LlamaForCausalLM``/``Qwen2ForCausalLM`` config (``"bias"``: whether ``fc`` has one, default true as in EAGLE), keys
``fc.*`` ([H, 2H], embedding first), ``layers.0.*`` without an input norm. The LM head is the target's."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from treedec.heads.config import DraftConfig
from treedec.heads.formats.fields import config_int, flag
from treedec.models.config import MODEL_TYPES, SUPPORTED_ARCHITECTURES, LlamaConfig

LAYER_PREFIX = "layers.0."  # the decoder layer's tensors


def check_config(raw: dict, archs: list[str], path: Path) -> None:
    """A config.json that is no other layout must be a 1-layer Llama / Qwen2 model (e.g. a GPT-2 config would
    otherwise read as an EAGLE-1 head of Llama's shape, and a target model's directory as a deep one)."""
    other = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if other or raw.get("model_type", "llama") not in MODEL_TYPES.values():
        raise ValueError(f"{path}: architectures {archs} (model_type {raw.get('model_type')!r}) is no EAGLE head "
                         f"layout treedec reads: an EAGLE-1/2 head is a 1-layer {' / '.join(SUPPORTED_ARCHITECTURES)}, "
                         "an EAGLE-3 head a LlamaForCausalLMEagle3 or a speculators eagle3 config")
    n = config_int(raw, "num_hidden_layers", Path(path))
    if n not in (None, 1):
        raise ValueError(f"{path} describes a {n}-layer model, not a 1-layer EAGLE head "
                         "(a target model directory? pass it as model.path, and the head as draft.path)")


def read_config(raw: dict, lc: LlamaConfig, common: dict, path: Path) -> tuple[DraftConfig, list[str]]:
    """(the head's DraftConfig, the names of its tensors outside the layer)."""
    bias = flag(raw, "bias", True, path)  # EAGLE's loader: config "bias", default true
    cfg = DraftConfig.for_target(lc, fc_bias=bias, **common)
    return cfg, ["fc.weight"] + (["fc.bias"] if bias else [])


def finish_export(cfg: dict, out: dict[str, torch.Tensor], c: DraftConfig, ids: torch.Tensor | None) -> None:
    """The layout's own part of an export: ``"bias"``; a draft vocabulary has no place in it (a warning)."""
    cfg["bias"] = c.fc_bias
    if ids is not None:
        warnings.warn(f"the EAGLE-1/2 layout has no draft vocabulary: the exported head drafts over all "
                      f"{c.vocab_size} tokens instead of its {c.draft_vocab_size} (same output, a wider LM head)",
                      stacklevel=3)


__all__ = ["LAYER_PREFIX", "check_config", "finish_export", "read_config"]
