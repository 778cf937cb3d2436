"""Model configuration for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3), mapped from HF config.json."""
from __future__ import annotations

import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings")  # must be >= 1 where given


def _matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's type hint (JSON has no int/bool distinction to lean on: check both)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is Any:
        return True
    return isinstance(value, origin or hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0]).removeprefix('an ').removeprefix('a ')}s"
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string", dict: "an object",
             type(None): "null"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_types(cls, d: dict[str, Any]) -> None:
    """A config.json field of the wrong JSON type (``"hidden_size": "256"``) is an error naming the field."""
    hints = typing.get_type_hints(cls)
    for key, value in d.items():
        if key in ("architecture", "extra") or key not in hints:
            continue
        if not _matches(value, hints[key]):
            fix = f" (write {value} without quotes)" if isinstance(value, str) and _is_number(value) else ""
            raise ValueError(f'"{key}" must be {_describe(hints[key])}, got {value!r}{fix}')
    check_sizes(d)


def check_sizes(d: dict[str, Any]) -> None:
    """Each of :data:`SIZES` that ``d`` gives is >= 1 (a config.json's fields, or pretrain's ``model_arch``)."""
    for key in SIZES:
        value = d.get(key)
        if isinstance(value, int) and value < 1:
            raise ValueError(f'"{key}" must be >= 1, got {value}')


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qkv_bias: bool = False  # Qwen2 (and Llama's attention_bias)
    o_bias: bool = False  # Llama's attention_bias also biases o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k (weight [head_dim]) before RoPE
    tie_word_embeddings: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict)  # other HF keys, written back on save

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def context_length(self) -> int:
        """Longest sequence the model handles exactly: the position limit, or a smaller sliding window."""
        window = self.extra.get("sliding_window")
        return min(self.max_position_embeddings, window) if window else self.max_position_embeddings

    @property
    def eos_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Map a Hugging Face config.json dict; unknown architectures and mistyped fields are clear errors."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f'"architectures" must be a list of names like ["LlamaForCausalLM"], got {archs!r}')
        _check_types(cls, d)
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; treedec supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["architecture"] = arch
        if arch == "Qwen2ForCausalLM":
            kw["qkv_bias"] = True
        elif d.get("attention_bias"):  # Llama and Qwen3: q, k, v and o biased alike
            kw["qkv_bias"] = kw["o_bias"] = True
        kw["mlp_bias"] = bool(d.get("mlp_bias", False))
        kw["qk_norm"] = arch == "Qwen3ForCausalLM"
        rp = d.get("rope_parameters")  # transformers >= 5 folds rope_theta and rope_scaling into one dict
        if isinstance(rp, dict) and "rope_theta" not in d:
            rp = dict(rp)
            if "rope_theta" in rp:
                kw["rope_theta"] = rp.pop("rope_theta")
            if rp.get("rope_type", rp.get("type", "default")) != "default" and d.get("rope_scaling") is None:
                kw["rope_scaling"] = rp
        rs = kw.get("rope_scaling")
        if rs is not None:
            kind = rs.get("rope_type", rs.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}; treedec supports 'llama3' and 'linear'")
        ignore = {"architectures", "attention_bias", "mlp_bias", "model_type", "torch_dtype", "dtype",
                  "transformers_version", "hidden_act", "use_cache", "attention_dropout", "initializer_range",
                  "pretraining_tp", "sliding_window", "use_sliding_window", "max_window_layers", "pad_token_id",
                  "rope_parameters", "layer_types"}
        kw["extra"] = {k: v for k, v in d.items() if k not in known and k not in ignore}
        # A sliding window is exact full attention as long as the sequence fits in it: keep it as a context limit.
        window = d.get("sliding_window")
        uses_window = d.get("use_sliding_window", arch == "MistralForCausalLM")
        qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
        if uses_window and window and (not qwen or d.get("max_window_layers", 0) < d.get("num_hidden_layers", 0)):
            kw["extra"]["sliding_window"] = window
            if qwen:
                kw["extra"].update(use_sliding_window=True, max_window_layers=d.get("max_window_layers"))
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r}; the Llama family uses 'silu'")
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that `transformers` loads as the same architecture."""
        d = {k: v for k, v in asdict(self).items()
             if k not in ("qkv_bias", "o_bias", "mlp_bias", "qk_norm", "architecture", "extra")}
        d.update(architectures=[self.architecture], model_type=MODEL_TYPES[self.architecture], hidden_act="silu")
        if self.architecture in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
            d.update(attention_bias=self.qkv_bias)
        if self.architecture == "LlamaForCausalLM":
            d.update(mlp_bias=self.mlp_bias)
        if self.architecture in ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            d.update(sliding_window=None, use_sliding_window=False)
        d.update(self.extra)
        return d
