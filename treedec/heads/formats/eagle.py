"""The EAGLE-1/2 layout as published (e.g. EAGLE-LLaMA3-Instruct-8B), read and written: a 1-layer
``LlamaForCausalLM``/``Qwen2ForCausalLM`` config (``"bias"``: whether ``fc`` has one, default true as in EAGLE), keys
``fc.*`` ([H, 2H], embedding first), ``layers.0.*`` without an input norm. The LM head is the target's.

vLLM reads ``"bias"`` otherwise: as q/k/v and o_proj biases of the layer, and its ``fc`` has none (it drops
``fc.bias`` without a word). An export of a head with an fc bias b therefore also carries b *folded* into the
layer: q/k/v biases W_{q,k,v} b and an o_proj bias b (layer 0 has no input norm, so attention reads x + b and the
residual stream carries b past it: exactly EAGLE's function). EAGLE's own loader (non-strict) ignores the folded
biases and applies ``fc.bias``; vLLM drops ``fc.bias`` and applies the folded ones; treedec reads ``fc.bias`` and
checks the folded ones agree with it (:func:`drop_fold`)."""
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


_FOLD = ("q_proj", "k_proj", "v_proj", "o_proj")  # the layer's biases that carry fc's bias in vLLM's reading


def _folded(out: dict[str, torch.Tensor], b: torch.Tensor) -> dict[str, torch.Tensor]:
    """The layer biases (under the published names) that apply fc's bias ``b`` where fc has none, in fp32."""
    b = b.double()
    folded = {f"{LAYER_PREFIX}self_attn.{p}.bias": out[f"{LAYER_PREFIX}self_attn.{p}.weight"].double() @ b
              for p in _FOLD[:3]}
    folded[f"{LAYER_PREFIX}self_attn.o_proj.bias"] = b
    return {k: v.float() for k, v in folded.items()}


def drop_fold(src: dict[str, torch.Tensor], has_fc_bias: bool, path: Path) -> None:
    """Pop the layer biases an export folded ``fc.bias`` into (see the module), checked against ``fc.bias``."""
    names = [f"{LAYER_PREFIX}self_attn.{p}.bias" for p in _FOLD]
    held = [n for n in names if n in src]
    if not held:
        return
    if not has_fc_bias or len(held) != len(names):
        raise ValueError(f"{path}: the layer holds {', '.join(held)}, which an EAGLE-1/2 head has only as its fc bias "
                         "folded in (q/k/v and o_proj together, beside fc.bias and \"bias\": true); re-export the head "
                         "or drop them")
    want = _folded(src, src["fc.bias"].float())
    for n in names:
        got, ref = src.pop(n).float(), want[n]
        if got.shape != ref.shape or not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()) + 1e-6):
            raise ValueError(f"{path}: {n} is not fc.bias folded into the layer (what treedec's export writes for "
                             "vLLM); the file is corrupt or was edited: re-export the head")


def finish_export(cfg: dict, out: dict[str, torch.Tensor], c: DraftConfig, ids: torch.Tensor | None) -> None:
    """The layout's own part of an export: ``"bias"``, fc's bias folded into the layer for vLLM (the module's note);
    a draft vocabulary has no place in it (a warning)."""
    cfg["bias"] = c.fc_bias
    if c.fc_bias:
        if c.qkv_bias or c.o_bias:
            warnings.warn("vLLM reads \"bias\" as the layer's attention biases, and this head has its own: vLLM "
                          "cannot hold both, so the export serves EAGLE's code and SGLang, not vLLM", stacklevel=3)
        else:
            out.update(_folded(out, out["fc.bias"].float()))
    elif c.qkv_bias:
        warnings.warn("vLLM has no EAGLE-1/2 drafter with q/k/v biases (no EagleQwen2ForCausalLM): the export serves "
                      "EAGLE's code and SGLang, not vLLM", stacklevel=3)
    if ids is not None:
        warnings.warn(f"the EAGLE-1/2 layout has no draft vocabulary: the exported head drafts over all "
                      f"{c.vocab_size} tokens instead of its {c.draft_vocab_size} (same output, a wider LM head)",
                      stacklevel=3)


__all__ = ["LAYER_PREFIX", "check_config", "drop_fold", "finish_export", "read_config"]
