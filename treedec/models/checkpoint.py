"""Hugging Face checkpoint I/O: local directories in, Hugging Face directories out.

``load_model`` reads a local HF directory (``config.json`` + ``model.safetensors``, or a
sharded ``model.safetensors.index.json``) of a Llama, Mistral, Qwen2 or Qwen3 causal LM, or
``"tiny-code"``, the model bundled at ``treedec/assets/tiny-code/``. ``save_pretrained``
writes a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Only safetensors is read or written: no pickle, no ``torch.load``. Nothing is downloaded.
Loading builds the model on the meta device and materialises one tensor at a time, so the
peak memory is about one copy of the weights (in the target dtype) plus one tensor.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from treedec.atomic import follow_umask
from treedec.models.config import SUPPORTED_ARCHITECTURES, LlamaConfig
from treedec.models.llama import Transformer, rope_inv_freq
from treedec.models.packed import should_pack
from treedec.models.paths import BUNDLED, resolve_path  # noqa: F401 - BUNDLED: tests patch checkpoint.BUNDLED
from treedec.models.tokenizer import save_tokenizer

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

# HF checkpoints may carry buffers that treedec recomputes (older Llama saves rotary inv_freq).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|(^|\.)masked_bias$|(^|\.)attn\.bias$")

# A target's tensors checked for NaN / Inf at load (cheap; a head's are all checked): every token passes through them.
_CHECKED_FINITE = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file and the fix."""


def resolve_dtype(dtype: torch.dtype | str | None, config: dict | None = None) -> torch.dtype:
    """``torch.float32`` or a name (fp32 | bf16 | fp16 | float32 | ...); "auto" uses the checkpoint's dtype."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name == "auto":
        saved = (config or {}).get("dtype") or (config or {}).get("torch_dtype") or "float32"
        return resolve_dtype(saved)
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))} or 'auto'")
    return _DTYPES[name]


def resolve_device(device: torch.device | str | None = "auto") -> torch.device:
    """``"auto"`` (or None): CUDA when available, else the CPU; else a torch device name, checked to exist here.

    The one place a device name is resolved, so that a config's default works on a CPU-only machine.
    """
    if isinstance(device, torch.device):
        dev = device
    else:
        name = "auto" if device is None else str(device).strip().lower()
        if name == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} needs CUDA, which is not available here (torch "
                             f"{torch.__version__}); use device 'cpu' or 'auto'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def read_json_object(file: Path, fix: str) -> dict:
    """The JSON object (a dict) in ``file``: a file that is not JSON, or JSON of another type (a list), is a
    CheckpointError naming the file and ``fix``, never a KeyError or AttributeError later."""
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON ({exc}); {fix}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} holds a JSON {type(raw).__name__}, not a JSON object ({{...}}); {fix}")
    return raw


def check_finite(file: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse NaN or Inf in floating-point ``tensors`` (read from ``file``): such weights load and run without a
    word, and a head of them drafts nothing (tau 1.00) while calibrate fits a tree to it. One pass per tensor."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{file}: tensor {name!r} holds NaN or Inf values; the weights are corrupt (or "
                                  f"their training diverged): re-download, re-export or retrain them")


def read_config(path: str | os.PathLike) -> tuple[LlamaConfig, dict]:
    """The parsed ``LlamaConfig`` and the raw ``config.json`` dict of a checkpoint directory."""
    path = resolve_path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{path} has no config.json: a Hugging Face model directory needs config.json next to its "
            f"model.safetensors (save it with `save_pretrained`, or copy it from the model's repository)"
        )
    raw = read_json_object(cfg_file, "restore the file from the model's repository")
    try:
        cfg = LlamaConfig.from_hf(raw)
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{cfg_file}: {exc}") from exc
    return cfg, raw


def _weight_map(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, for a single file or a sharded index."""
    single, index = path / WEIGHTS, path / INDEX
    if index.is_file():
        fix = "restore it, or re-save the checkpoint"
        wm = read_json_object(index, fix).get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{index} is not a valid safetensors index: it needs a 'weight_map' object of "
                                  f"tensor name -> shard file (got {type(wm).__name__}); {fix}")
        return {name: path / shard for name, shard in wm.items()}
    if single.is_file():
        return {name: single for name in _keys(single)}
    found = sorted(p.name for p in path.iterdir())
    hint = ""
    if any(n.endswith((".bin", ".pt", ".pth", ".ckpt")) for n in found):
        hint = (" It holds pickle weights, which treedec never loads (unsafe): convert them once with "
                "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`.")
    raise FileNotFoundError(f"{path} has neither {WEIGHTS} nor {INDEX} (found: {', '.join(found) or 'nothing'}).{hint}")


def _open(file: Path):
    if not file.is_file():
        raise FileNotFoundError(f"weight file {file} is missing (listed in {INDEX}); re-download or re-save the checkpoint")
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as exc:  # safetensors raises its own SafetensorError (and OSError) on a bad file
        raise CheckpointError(
            f"cannot read {file}: it is truncated or corrupt ({exc}); re-download it or re-save the model "
            f"with `save_pretrained`"
        ) from exc


def _keys(file: Path) -> list[str]:
    with _open(file) as f:
        return list(f.keys())


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if isinstance(getattr(mod, attr), nn.Parameter):
        setattr(mod, attr, nn.Parameter(value, requires_grad=False))
    else:
        mod.register_buffer(attr, value)


def expected_tensors(model: Transformer) -> dict[str, torch.Size]:
    """Names and shapes a checkpoint must provide (tied embeddings: no separate lm_head)."""
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _describe(cfg: LlamaConfig) -> str:
    return (f"hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, vocab_size={cfg.vocab_size}, "
            f"heads={cfg.num_attention_heads}/{cfg.num_key_value_heads} kv, head_dim={cfg.head_dim}")


def load_model(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",  # or "auto": CUDA when available
    attn_backend: str = "auto",
    trainable: bool = False,
    fuse: bool = True,
) -> Transformer:
    """Load ``"tiny-code"`` or a local HF directory as a :class:`Transformer` in eval mode.

    ``dtype``: a torch dtype or fp32 | bf16 | fp16 | "auto" (the checkpoint's own dtype).
    Prefer fp32 or bf16 on CPU: fp16 matmuls are extremely slow there.
    """
    path = resolve_path(name_or_path)
    cfg, raw = read_config(path)
    dtype = resolve_dtype(dtype, raw)
    device = resolve_device(device)
    if dtype == torch.float16 and device.type == "cpu":
        warnings.warn("fp16 on CPU is very slow; use dtype='bf16' or 'fp32' for CPU inference", stacklevel=2)
    wmap = _weight_map(path)

    with torch.device("meta"):
        model = Transformer(cfg, attn_backend=attn_backend)
    expected = expected_tensors(model)

    missing = [k for k in expected if k not in wmap]
    if missing:
        files = sorted({p.name for p in wmap.values()})
        raise CheckpointError(
            f"{path}: weight {missing[0]!r} is missing from {', '.join(files)}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + f"; the checkpoint does not match its config.json ({cfg.architecture}, "
              f"{cfg.num_hidden_layers} layers, qkv_bias={cfg.qkv_bias}). Re-save it, or fix config.json"
        )
    skip = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = [k for k in wmap if k not in expected and k not in skip and not _IGNORED.search(k)]
    if unexpected:
        raise CheckpointError(
            f"{path}: tensor {unexpected[0]!r}"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + f" is not part of the {cfg.architecture} model that config.json describes "
              f"({cfg.num_hidden_layers} layers, qkv_bias={cfg.qkv_bias}, mlp_bias={cfg.mlp_bias}); "
              f"the config and the weights disagree: fix config.json or re-save the checkpoint"
        )

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(wmap[name], []).append(name)
    for file, names in by_file.items():
        with _open(file) as f:
            for name in names:
                try:
                    sl = f.get_slice(name)
                    shape = tuple(sl.get_shape())
                except Exception as exc:
                    raise CheckpointError(f"cannot read tensor {name!r} from {file}: {exc}; the file is corrupt") from exc
                if shape != tuple(expected[name]):
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has shape {shape}, but config.json ({_describe(cfg)}) "
                        f"expects {tuple(expected[name])}; the weights belong to a different config"
                    )
                try:
                    t = f.get_tensor(name)
                except Exception as exc:
                    raise CheckpointError(
                        f"cannot read tensor {name!r} from {file}: it is truncated or corrupt ({exc}); "
                        f"re-download it or re-save the model"
                    ) from exc
                t = t.to(device=device, dtype=dtype)
                if name in _CHECKED_FINITE:  # NaN there: every logit is NaN, and decoding emits garbage silently
                    check_finite(file, {name: t})
                _set_tensor(model, name, t)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)
    model = model.fuse() if fuse else model  # one q/k/v and one gate/up matmul per layer; state-dict names stay HF's
    model.requires_grad_(trainable)
    if not trainable and should_pack(model):  # bf16 on a CPU: oneDNN weights packed once, same outputs
        model.pack()
    return model.eval()


def _tensors_for_save(model: Transformer, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # shared with model.embed_tokens.weight; safetensors refuses shared storage
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.to("cpu").contiguous()
    return out


def save_pretrained(model: Transformer, path: str | os.PathLike, tokenizer=None, dtype: torch.dtype | str | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ tokenizer files) in Hugging Face layout.

    ``tokenizer``: a :class:`treedec.models.tokenizer.Tokenizer`, a ``tokenizers.Tokenizer``
    or the path of a tokenizer.json. ``dtype`` converts the saved weights (default: as they are).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(dtype) if dtype is not None else None
    tensors = _tensors_for_save(model, dtype)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    follow_umask(path / WEIGHTS)
    if (path / INDEX).exists():  # a stale shard index would shadow the new single file
        (path / INDEX).unlink()
    cfg = model.config.to_hf()
    saved = dtype or model.dtype
    cfg["torch_dtype"] = str(saved).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, path, config=model.config)
    return path


__all__ = ["CheckpointError", "SUPPORTED_ARCHITECTURES", "load_model", "read_config", "resolve_device",
           "resolve_dtype", "resolve_path", "save_pretrained"]
