"""treedec: tree speculative decoding (see README.md).

The front door of the Python API: ``import treedec`` names the loaders (a target, a draft head, a tokenizer, by
name or path), the decoders, the tree policies and :class:`SamplingParams`, each from the package that defines it.

Each name is imported when first used (PEP 562's module ``__getattr__`` over :data:`_EXPORTS`): every command
imports this package before its own module (``python -m treedec.generate``), and a mistyped option must end in its
one-line error without first paying for torch and the models. This is the one place treedec defers an import.
"""
from __future__ import annotations

import importlib

_EXPORTS: dict[str, str] = {  # name -> the module that defines it
    "load_model": "treedec.models",
    "load_head": "treedec.heads",
    "load_tokenizer": "treedec.models.tokenizer",
    "SpeculativeDecoder": "treedec.decoding.speculative",
    "VanillaDecoder": "treedec.decoding.vanilla",
    "AutoPolicy": "treedec.tree.policies",
    "BestFirstPolicy": "treedec.tree.policies",
    "ChainPolicy": "treedec.tree.policies",
    "DynamicPolicy": "treedec.tree.policies",
    "LearnedPolicy": "treedec.tree.policies",
    "LookupPolicy": "treedec.tree.policies",
    "StaticPolicy": "treedec.tree.policies",
    "SamplingParams": "treedec.sampling",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """``treedec.<name>`` for a name of :data:`_EXPORTS`, imported on first use and kept."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treedec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
