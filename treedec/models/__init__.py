"""Target models (Llama family), the static KV cache and checkpoint I/O (the draft heads: :mod:`treedec.heads`)."""
import torch

from treedec.models import checkpoint as _checkpoint
from treedec.models.cache import KVCache
from treedec.models.config import SUPPORTED_ARCHITECTURES, LlamaConfig
from treedec.models.llama import ModelOutput, Transformer


def load_model(path, **kw):
    """Load "tiny-code" (the bundled model) or a local Hugging Face directory; see checkpoint.load_model.
    The ``_target_`` of conf/model/*.yaml (``path``, ``dtype``, ``device``, ``attn_backend``). A ``dtype`` a
    model cannot compute in (``torch.int8``) is a ValueError naming the allowed ones, before anything is read."""
    dtype = kw.get("dtype")
    if isinstance(dtype, torch.dtype) and dtype not in _checkpoint._DTYPES.values():
        allowed = sorted({str(d) for d in _checkpoint._DTYPES.values()})
        raise ValueError(f"load_model(dtype={dtype}): a model loads in {', '.join(allowed)} (or by name: fp32, "
                         f"bf16, fp16, or auto: the checkpoint's own)")
    return _checkpoint.load_model(path, **kw)


__all__ = ["KVCache", "LlamaConfig", "ModelOutput", "SUPPORTED_ARCHITECTURES", "Transformer", "load_model"]
