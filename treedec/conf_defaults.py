"""The values a shipped config file gives, for the signatures of the callables it names.

The YAML under conf/ (the package ``treedec.conf``) is the one place a default is written. A class that a config
names by ``_target_`` (the tree policies, :class:`~treedec.sampling.SamplingParams`) reads its file once, at import,
and writes ``def __init__(self, depth: int = _D["depth"])``, so the Python API gets the same values as
``tree=chain`` and ``help()`` shows them. ``tests/test_config_defaults.py`` fails on a signature default that
differs from its YAML.
"""
from __future__ import annotations

from importlib.resources import files
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_", "defaults")


def _plain(node: Any) -> Any:
    """A config value as a signature default: lists as tuples (a default is never mutable), mappings as dicts."""
    if isinstance(node, ListConfig):
        return tuple(_plain(node._get_node(i)) for i in range(len(node)))
    if isinstance(node, DictConfig):
        return {k: _plain(node._get_node(k)) for k in node.keys()}
    return None if node._is_interpolation() else node._value()


def shipped_defaults(name: str, key: str | None = None) -> dict[str, Any]:
    """The keys of ``conf/<name>.yaml`` (``tree/dynamic``), or of its node ``key`` (``probe``), and their values.

    ``_target_``, the defaults list and Hydra's other ``_..._`` keys are left out; so is a key left ``???`` (the
    caller must pass it: no default). A value that needs the composed config (an interpolation such as
    ``${oc.select:draft.path,null}``) is None.
    """
    node = OmegaConf.create(files("treedec.conf").joinpath(f"{name}.yaml").read_text())
    if key is not None:
        node = node._get_node(key)
    return {k: _plain(node._get_node(k)) for k in node.keys()
            if k not in HYDRA_KEYS and not node._get_node(k)._is_missing()}
