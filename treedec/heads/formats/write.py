"""treedec heads -> published layouts (``python -m treedec.export_head``): :func:`to_published` writes what every
layout shares (the layer's config, the target's fingerprint, the tensors under the layout's names) and the layout's
file (:data:`WRITERS`) adds its own part."""
from __future__ import annotations

import torch
import torch.nn as nn

from treedec.heads.config import target_fingerprint
from treedec.heads.formats import eagle, eagle3

WRITERS = {"eagle": eagle, "eagle3": eagle3}  # format -> the module writing its own part


def kind_mismatch(kind: str, fmt: str, path=None) -> str:
    """Why a head of ``kind`` (at ``path``, if known) is not exported as ``fmt``, and what to do instead."""
    where = f"draft.path={path}" if path else "the head"
    if kind == "parallel":
        return (f"{where} is a one-pass (P-EAGLE, kind parallel) head, and treedec cannot export one to an engine "
                f"layout yet (format=eagle and format=eagle3 hold autoregressive heads only): use its treedec "
                f"directory as it is (python -m treedec.generate draft=path draft.path={path or '<its directory>'})")
    return (f"{where} is kind {kind!r}, so it exports as format={kind} (not {fmt}): the layouts differ in more than "
            f"names (EAGLE-3 fuses three target layers and has its own LM head)")


def to_published(head: nn.Module, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of a treedec head in a public layout: ``eagle`` or ``eagle3`` (SpecForge/SGLang).

    The embedding (and an EAGLE-1/2 head's LM head) stay out: SGLang and vLLM share the target's. The target the
    head was trained for is recorded under config.json's ``"treedec"`` key (its name and :func:`target_fingerprint`:
    the bound target's, else the one its draft_config.json recorded), which other engines ignore, so loading the
    export against another target of the same shape warns as a treedec head does.
    """
    c = head.config
    if fmt not in WRITERS:
        raise ValueError(f"format={fmt!r}; treedec writes eagle (EAGLE-1/2) or eagle3 (EAGLE-3 / SpecForge)")
    if fmt != c.kind:
        raise ValueError(kind_mismatch(c.kind, fmt))
    lc = c.layer_config()
    if c.qk_norm:
        raise ValueError("a head with q/k norms (a Qwen3 layer) has no public EAGLE-1/2 or EAGLE-3 layout that "
                         "SGLang and vLLM read alike; keep it in treedec's format")
    if c.qkv_bias and not c.o_bias:
        lc.architecture = "Qwen2ForCausalLM"  # q/k/v biases only: how EAGLE's Qwen2 heads are described
    elif c.qkv_bias != c.o_bias:
        raise ValueError("a head with an o_proj bias but no q/k/v biases has no public layout")
    cfg = {**lc.to_hf(), "num_hidden_layers": 1, "tie_word_embeddings": False, "torch_dtype": str(head.fc.weight.dtype)[6:]}
    fp = target_fingerprint(head.target) if head._target else c.target_fingerprint
    if fp:
        cfg["treedec"] = {"target": c.target, "target_fingerprint": fp}
    sd = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    out = {k: sd.pop(k) for k in ("fc.weight", "fc.bias", "norm.weight", "lm_head.weight") if k in sd}
    ids = sd.pop("vocab_ids", None)
    layout = WRITERS[fmt]
    out.update({layout.LAYER_PREFIX + k[len("layer."):]: sd.pop(k) for k in list(sd) if k.startswith("layer.")})
    if sd:
        raise ValueError(f"the head holds tensors the {fmt} layout has no place for: {sorted(sd)}")
    layout.finish_export(cfg, out, c, ids)
    return cfg, out


__all__ = ["WRITERS", "kind_mismatch", "to_published"]
