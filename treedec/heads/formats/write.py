"""treedec heads -> published layouts (``python -m treedec.export_head``): :func:`to_published` writes what every
layout shares (the layer's config, the target's fingerprint, the tensors under the layout's names) and the layout's
file (:data:`WRITERS`) adds its own part. Each head kind has one layout (:data:`FORMAT_OF_KIND`)."""
from __future__ import annotations

import torch
import torch.nn as nn

from treedec.heads.config import target_fingerprint
from treedec.heads.formats import eagle, eagle3, peagle

WRITERS = {"eagle": eagle, "eagle3": eagle3, "peagle": eagle3}  # format -> the module writing its own part
FORMAT_OF_KIND = {"eagle": "eagle", "eagle3": "eagle3", "parallel": "peagle"}  # (P-EAGLE adds to EAGLE-3's part)


def kind_mismatch(kind: str, fmt: str, path=None) -> str:
    """Why a head of ``kind`` (at ``path``, if known) is not exported as ``fmt``, and what to do instead."""
    where = f"draft.path={path}" if path else "the head"
    if kind not in FORMAT_OF_KIND:
        return (f"{where} is kind {kind!r}, which no engine layout treedec writes holds (vLLM's DFlash drafter is a "
                f"Qwen3 layer with q/k norms): use its treedec directory as it is "
                f"(python -m treedec.generate draft=path draft.path={path or '<its directory>'})")
    return (f"{where} is kind {kind!r}, so it exports as format={FORMAT_OF_KIND[kind]} (not {fmt}): the layouts differ "
            f"in more than names (EAGLE-3 fuses three target layers and has its own LM head; P-EAGLE adds mask inputs)")


def to_published(head: nn.Module, fmt: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of a treedec head in a public layout: ``eagle``, ``eagle3`` (SpecForge/SGLang) or
    ``peagle`` (vLLM's P-EAGLE).

    The embedding (and an EAGLE-1/2 head's LM head) stay out: SGLang and vLLM share the target's. A P-EAGLE head
    carries the target's table with its mask token's row (the target's end-of-text token), so it must be bound. The target the
    head was trained for is recorded under config.json's ``"treedec"`` key (its name and :func:`target_fingerprint`:
    the bound target's, else the one its draft_config.json recorded), which other engines ignore, so loading the
    export against another target of the same shape warns as a treedec head does.
    """
    c = head.config
    if fmt not in WRITERS:
        raise ValueError(f"format={fmt!r}; treedec writes eagle (EAGLE-1/2), eagle3 (EAGLE-3 / SpecForge) or peagle "
                         "(P-EAGLE)")
    if fmt != FORMAT_OF_KIND.get(c.kind):
        raise ValueError(kind_mismatch(c.kind, fmt))
    if fmt == "peagle" and not head._target:
        raise ValueError("a P-EAGLE export carries the target's embedding table: bind the head to its target first")
    lc = c.layer_config()
    if c.qk_norm:
        raise ValueError("a head with q/k norms (a Qwen3 layer) has no public EAGLE-1/2 or EAGLE-3 layout that "
                         "SGLang and vLLM read alike; keep it in treedec's format")
    if c.qkv_bias and not c.o_bias:
        lc.architecture = "Qwen2ForCausalLM"  # q/k/v biases only: how EAGLE's Qwen2 heads are described
    elif c.qkv_bias != c.o_bias:
        raise ValueError("a head with an o_proj bias but no q/k/v biases has no public layout")
    cfg = {**lc.to_hf(), "num_hidden_layers": c.draft_layers, "tie_word_embeddings": False, "torch_dtype": str(head.fc.weight.dtype)[6:]}
    fp = target_fingerprint(head.target) if head._target else c.target_fingerprint
    if fp:
        cfg["treedec"] = {"target": c.target, "target_fingerprint": fp}
    sd = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    out = {k: sd.pop(k) for k in ("fc.weight", "fc.bias", "norm.weight", "lm_head.weight") if k in sd}
    ids = sd.pop("vocab_ids", None)
    layout = WRITERS[fmt]
    mask = {k: sd.pop(k) for k in ("mask_embed", "mask_hidden") if k in sd}
    out.update({layout.LAYER_PREFIX + k[len("layer."):]: sd.pop(k) for k in list(sd) if k.startswith("layer.")})
    for k in [k for k in sd if k.startswith("layers_after.")]:  # a multi-layer P-EAGLE drafter's layers 1..N-1
        i, rest = k[len("layers_after."):].split(".", 1)
        out[f"layers.{int(i) + 1}.{rest}"] = sd.pop(k)
    if sd:
        raise ValueError(f"the head holds tensors the {fmt} layout has no place for: {sorted(sd)}")
    layout.finish_export(cfg, out, c, ids)
    if fmt == "peagle":
        tc = head.target.config
        peagle.finish_export(cfg, out, c.block_size, mask, head.target.model.embed_tokens.weight,
                             (tc.eos_ids or [0])[0])
    return cfg, out


__all__ = ["FORMAT_OF_KIND", "WRITERS", "kind_mismatch", "to_published"]
