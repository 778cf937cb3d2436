"""The YAML files calibrate writes (learned shapes, calibration tables): one dumper and one reader for both.

Below :mod:`treedec.tree.calibration` and :mod:`treedec.tree.policies.learned`, which both read and write them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from treedec.tree.tree import TreeError


class Dumper(yaml.SafeDumper):
    """Block mappings; lists of scalars (and lists of such lists, e.g. rate tables rows) in flow style."""


def _represent_list(dumper: yaml.SafeDumper, data: list):
    flat = all(not isinstance(x, (dict, list)) or (isinstance(x, list) and
               all(not isinstance(y, (dict, list)) for y in x)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


Dumper.add_representer(list, _represent_list)


def read_yaml(path: str | Path, what: str, hint: str) -> tuple[Path, Any]:
    """(path, parsed YAML) of a file calibrate wrote; a missing or unparsable file is a TreeError naming ``what``."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise TreeError(f"{what} {str(p)!r} not found: {hint}")
    try:
        return p, yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise TreeError(f"cannot parse {what} {p}: {e}") from e
