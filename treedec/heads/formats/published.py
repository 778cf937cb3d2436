"""Published draft-head layouts -> treedec heads (``DraftHead.load`` calls :func:`load_published`).

A directory with a ``config.json`` and no ``draft_config.json`` is a head trained elsewhere.
Its layout is told by the config:

* ``eagle``: EAGLE-1/2 as published (e.g. EAGLE-LLaMA3-Instruct-8B): a 1-layer
  ``LlamaForCausalLM``/``Qwen2ForCausalLM`` config (``"bias"``: whether ``fc`` has one, default
  true as in EAGLE), keys ``fc.*`` ([H, 2H], embedding first), ``layers.0.*`` without an input norm.
  The LM head is the target's.
* ``eagle3``: EAGLE-3 as published and SpecForge exports (``LlamaForCausalLMEagle3``, or a config
  with ``draft_vocab_size``): ``fc.weight`` [H, 3H], ``midlayer.*`` (or ``layers.0.*``),
  ``norm``, ``lm_head`` [K, H], ``d2t``/``t2d``. RoPE is the head's own (EAGLE's default theta
  10000 when the config names none, never the target's); feature layers default to EAGLE-3's
  [2, L//2, L-3] of the target.
* ``speculators``: vLLM speculators EAGLE-3 (``speculators_model_type: eagle3``): the layer's
  config under ``transformer_layer_config``, layer ids in ``eagle_aux_hidden_state_layer_ids``,
  ``norm_before_residual`` (true when absent, as vLLM reads it).
* ``peagle``: a one-layer P-EAGLE head (vLLM's flat EAGLE-3 config with ``ptd_token_id`` / ``pard_token``, or
  ``speculators_model_type: peagle`` with ``mask_token_id``) -> a ``ParallelHead``: :mod:`head_formats_peagle`,
  which also refuses DFlash drafters and P-EAGLE heads of several layers.

Weights come from ``model.safetensors`` (or a sharded index), or ``pytorch_model.bin`` through
``torch.load(weights_only=True)``; nothing else is ever unpickled. A head that does not fit its
target, or whose tensors do not match its layout, is an error naming both.
"""
from __future__ import annotations

import pickletools
import re
import warnings
import zipfile
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

import treedec.heads.formats.fields as fields
import treedec.heads.formats.peagle as peagle
from treedec.models.checkpoint import (INDEX, WEIGHTS, CheckpointError, _open, _weight_map, check_finite,
                                       read_json_object)
from treedec.models.config import MODEL_TYPES, SUPPORTED_ARCHITECTURES, LlamaConfig
from treedec.heads.config import DraftConfig, target_fingerprint
from treedec.models.llama import Transformer

PICKLE = "pytorch_model.bin"
LAYOUTS = ("eagle", "eagle3", "speculators", "peagle")
# Buffers and tensors a published head may carry that treedec recomputes or takes from the target.
_SKIP = ("rotary_emb.inv_freq", "verifier_lm_head.weight", "verifier_norm.weight")


def detect(raw: dict, path: Path | str = "config.json") -> str:
    """The layout of a head's config.json (``path``, named in errors): eagle | eagle3 | speculators | peagle (an error
    otherwise, e.g. a DFlash drafter, or a GPT-2 config, which would otherwise read as an EAGLE-1 head of Llama's shape)."""
    peagle.refuse_dflash(raw, set(), Path(path).parent)
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
    other = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if other or raw.get("model_type", "llama") not in MODEL_TYPES.values():
        raise ValueError(f"{path}: architectures {archs} (model_type {raw.get('model_type')!r}) is no EAGLE head "
                         f"layout treedec reads: an EAGLE-1/2 head is a 1-layer {' / '.join(SUPPORTED_ARCHITECTURES)}, "
                         "an EAGLE-3 head a LlamaForCausalLMEagle3 or a speculators eagle3 config")
    n = fields.config_int(raw, "num_hidden_layers", Path(path))
    if n not in (None, 1):
        raise ValueError(f"{path} describes a {n}-layer model, not a 1-layer EAGLE head "
                         "(a target model directory? pass it as model.path, and the head as draft.path)")
    return "eagle"


def _flag(raw: dict, key: str, default: bool, path: Path) -> bool:
    """A true/false key of a head's config.json: a string such as "false" is an error, never truthy."""
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{path / 'config.json'}: \"{key}\" must be true or false (JSON booleans), got {value!r}")
    return value


def _as_int(value, what: str, path: Path) -> int:
    """``value`` as an int where it is one (a JSON integer): a float or a string is an error, never truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{path / 'config.json'}: {what} must be integers, got {value!r}")
    return value


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a head directory: safetensors, or ``pytorch_model.bin`` with ``weights_only=True``."""
    if (path / INDEX).is_file() or (path / WEIGHTS).is_file():
        files = [path / WEIGHTS] if (path / WEIGHTS).is_file() else sorted(set(_weight_map(path).values()))
        out = {}
        for f in files:
            with _open(f) as sf:
                tensors = {k: sf.get_tensor(k) for k in sf.keys()}
            check_finite(f, tensors)
            out.update(tensors)
        return out
    if (path / PICKLE).is_file():
        file = path / PICKLE
        try:
            with warnings.catch_warnings():  # (torch's note on a pickle protocol: the error below says what matters)
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                sd = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # weights_only refuses anything but tensors and plain containers
            raise _bin_error(file, e) from e
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise CheckpointError(f"{file} is not a flat state dict of tensors (got {type(sd).__name__})")
        check_finite(file, sd)
        return sd
    found = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
    raise FileNotFoundError(f"{path} has config.json but no {WEIGHTS} or {PICKLE} (found: {found}); treedec reads "
                            f"safetensors, or {PICKLE} as plain tensors, never other pickle files")


def _bin_error(file: Path, exc: Exception) -> CheckpointError:
    """Why ``torch.load(file, weights_only=True)`` failed, for the user: a pickle naming a global (a callable such as
    ``os.system``, or a class) was refused, since unpickling it could run code; anything else is a corrupt file.
    torch's own message is not passed on: it suggests ``weights_only=False``, which is how such a file runs code."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    name = found.group(1) if found else _pickle_global(file)
    if name is None:
        return CheckpointError(f"{file} is corrupt: torch cannot read it as saved weights ({type(exc).__name__}; "
                               f"truncated, or not written by torch.save): re-download it, or use the head's {WEIGHTS}")
    return CheckpointError(f"{file} was refused: its pickle refers to {name}, and unpickling it could run code "
                           f"(treedec never unpickles objects, only plain tensors); do not load this file: use a "
                           f"{WEIGHTS} of this head from a source you trust")


def _pickle_global(file: Path) -> str | None:
    """The first global (``module.name``) outside torch that ``file``'s pickle refers to, read by disassembling its
    opcodes (nothing is executed); None when it names none or does not parse (a corrupt file)."""
    try:
        if zipfile.is_zipfile(file):
            with zipfile.ZipFile(file) as z:
                data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        else:
            data = file.read_bytes()
        strings: list[str] = []
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                name = str(arg).replace(" ", ".")
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                name = ".".join(strings[-2:])
            else:
                if isinstance(arg, str):
                    strings.append(arg)
                continue
            if not name.startswith(("torch.", "collections.OrderedDict")):
                return name
    except Exception:  # noqa: BLE001 - not a pickle: corrupt
        return None
    return None


def _layer_config(raw: dict, path: Path) -> LlamaConfig:
    """The head layer's LlamaConfig (Qwen2 layers: q/k/v biases; Qwen3 layers: q/k norms); the head's own RoPE."""
    archs, model_type = " ".join(raw.get("architectures") or []), raw.get("model_type")
    arch = "Qwen3ForCausalLM" if "Qwen3" in archs or model_type == "qwen3" else \
        "Qwen2ForCausalLM" if "Qwen2" in archs or model_type == "qwen2" else "LlamaForCausalLM"
    d = {k: v for k, v in raw.items() if k not in ("architectures", "num_hidden_layers")}
    d.setdefault("rope_theta", 10000.0)  # EAGLE's rotary default: never the target's theta
    try:
        cfg = LlamaConfig.from_hf({**d, "architectures": [arch], "num_hidden_layers": 1})
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from e
    if raw.get("qkv_bias") is not None:  # some EAGLE Qwen2 heads say so explicitly
        cfg.qkv_bias = _flag(raw, "qkv_bias", cfg.qkv_bias, path)
    return cfg


def _feature_layers(raw: dict, target: Transformer | None, path: Path) -> list[int]:
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids is None:
        if target is None:
            raise ValueError(f"{path} is an EAGLE-3 head whose config does not name its feature layers: load it with "
                             "its target (DraftHead.load(path, target=model)) to use EAGLE-3's [2, L//2, L-3]")
        L = target.config.num_hidden_layers
        ids = [2, L // 2, L - 3]
    if not isinstance(ids, list) or len(ids) != 3:
        raise ValueError(f"{path}: an EAGLE-3 head fuses 3 target layers, its config names {ids!r}")
    ids = [_as_int(i, f"the feature layer ids {ids!r} (eagle_aux_hidden_state_layer_ids): layer ids", path)
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


def convert(path: str | Path, target: Transformer | None = None) -> tuple[DraftConfig, dict[str, torch.Tensor], str]:
    """(treedec DraftConfig, treedec state dict, layout) of a published head directory."""
    path = Path(path)
    raw = read_json_object(path / "config.json", "restore the head's config.json from where it was published")
    layout = detect(raw, path / "config.json")
    src = {k: v for k, v in read_weights(path).items() if not k.endswith(_SKIP)}
    peagle.refuse_dflash(raw, set(src), path)  # (a DFlash drafter whose config does not say so)
    layout = "peagle" if layout == "eagle3" and "mask_hidden" in src else layout
    layer_raw = peagle.layer_raw(raw, path, src) if layout == "peagle" else raw
    if layout == "speculators":
        layer_raw = {**raw.get("transformer_layer_config", {}), **{k: raw[k] for k in ("draft_vocab_size",) if k in raw}}
        if not raw.get("transformer_layer_config"):
            raise ValueError(f"{path / 'config.json'}: a speculators config needs transformer_layer_config")
        n = fields.config_int(layer_raw, "num_hidden_layers", path / "config.json",
                              "transformer_layer_config.num_hidden_layers")
        if n not in (None, 1):
            raise ValueError(f"{path}: a {n}-layer speculators head; treedec loads 1-layer heads")
        if raw.get("norm_before_fc") or "input_norm.weight" in src:
            raise ValueError(f"{path}: norm_before_fc heads (an RMSNorm before fc) are not supported")
    lc = _layer_config(layer_raw, path)
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in src) else "layers.0."  # EAGLE-3/SGLang name it so
    K = None if layout == "eagle" else _as_int(layer_raw.get("draft_vocab_size") or lc.vocab_size, "draft_vocab_size",
                                               path)
    fields.check_shapes(lc, K, src, prefix, path / "config.json",
                        "transformer_layer_config." if "speculators_model_type" in raw else "")
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
    mine = _treedec_key(raw, path)  # what treedec's export recorded of the head's target (other engines ignore it)
    common = dict(target=mine.get("target") or str(path), target_fingerprint=mine.get("target_fingerprint", ""),
                  qkv_bias=lc.qkv_bias, o_bias=lc.o_bias, qk_norm=lc.qk_norm)
    if layout == "eagle":
        bias = _flag(raw, "bias", True, path)  # EAGLE's loader: config "bias", default true
        cfg = DraftConfig.for_target(lc, fc_bias=bias, **common)
        names = ["fc.weight"] + (["fc.bias"] if bias else [])
    else:
        if raw.get("target_hidden_size") not in (None, lc.hidden_size):
            raise ValueError(f"{path}: target_hidden_size {raw['target_hidden_size']} != the head's hidden_size "
                             f"{lc.hidden_size}; treedec's EAGLE-3 head reads features of its own width")
        ids = _vocab_ids(src, K, lc.vocab_size, path)
        # the residual around attention is hidden_norm(h): vLLM's default for speculators configs without the key
        nbr = _flag(raw, "norm_before_residual", "speculators_model_type" in raw, path)
        kind = dict(kind="parallel", block_size=peagle.block_size(raw, path)) if masks else dict(kind="eagle3")
        cfg = DraftConfig.for_target(lc, feature_layers=_feature_layers(raw, target, path),
                                     draft_vocab_size=0 if ids is None else K, norm_before_residual=nbr, **kind, **common)
        if ids is not None:
            state["vocab_ids"] = ids
        state.update(masks)
        names = ["fc.weight", "norm.weight", "lm_head.weight"]
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
    :func:`to_published`), {} where absent: bind warns when the head meets a target of another fingerprint."""
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


def load_published(path: str | Path, build: Callable[[DraftConfig], nn.Module], target: Transformer | None = None,
                   dtype=None, device=None, quantize: str | None = None) -> nn.Module:
    """A published head as a treedec head (``build(cfg)``: ``DraftHead``, which picks the class of the kind; passed
    in so this module stays below the head classes), fused, bound to ``target`` when given."""
    cfg, state, layout = convert(path, target)
    head = build(cfg)
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor whose shape does not fit the config
        raise ValueError(f"{path} ({layout} layout): the weights do not fit its config.json: {e}") from e
    if missing or unexpected:
        raise ValueError(f"{path} ({layout} layout) does not hold a whole head: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    return head.to(device=device or "cpu", dtype=dtype or state["fc.weight"].dtype).eval().prepare(target, quantize)



# ------------------------------------------------------------------ treedec -> published (export_head)
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
    if fmt not in ("eagle", "eagle3"):
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
    prefix = "midlayer." if fmt == "eagle3" else "layers.0."
    out.update({prefix + k[len("layer."):]: sd.pop(k) for k in list(sd) if k.startswith("layer.")})
    if sd:
        raise ValueError(f"the head holds tensors the {fmt} layout has no place for: {sorted(sd)}")
    if fmt == "eagle":
        cfg["bias"] = c.fc_bias
        if ids is not None:
            warnings.warn(f"the EAGLE-1/2 layout has no draft vocabulary: the exported head drafts over all "
                          f"{c.vocab_size} tokens instead of its {c.draft_vocab_size} (same output, a wider LM head)",
                          stacklevel=2)
        return cfg, out
    K = c.draft_vocab_size or c.vocab_size
    ids = torch.arange(K) if ids is None else ids.long()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    out.update(d2t=ids - torch.arange(K), t2d=t2d)
    layers = [int(i) for i in c.feature_layers]
    cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=K, eagle_aux_hidden_state_layer_ids=layers,
               eagle_config={"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
               norm_before_residual=c.norm_before_residual)  # vLLM reads it; EAGLE-3's own code has it false
    return cfg, out


__all__ = ["LAYOUTS", "convert", "detect", "kind_mismatch", "load_published", "read_weights", "to_published"]
