"""Target models (Llama family), the static KV cache, EAGLE draft heads and checkpoint I/O."""
from treedec.models.cache import KVCache
from treedec.models.config import SUPPORTED_ARCHITECTURES, LlamaConfig
from treedec.models.llama import ModelOutput, Transformer
from treedec.models import eagle3  # noqa: F401,E402  (registers DraftHead's kind "eagle3")


def load_model(path, **kw):
    """Load "tiny-code" (the bundled model) or a local Hugging Face directory; see checkpoint.load_model.
    The ``_target_`` of conf/model/*.yaml (``path``, ``dtype``, ``device``, ``attn_backend``)."""
    from treedec.models.checkpoint import load_model as _load

    return _load(path, **kw)


__all__ = ["KVCache", "LlamaConfig", "ModelOutput", "SUPPORTED_ARCHITECTURES", "Transformer", "load_model"]
