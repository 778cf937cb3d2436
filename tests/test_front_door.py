"""The front door: ``import treedec`` names what the README's Python API uses (loaders, decoders, policies, sampling
parameters) without importing torch, and the README's Python API block runs as written."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import treedec

ROOT = Path(__file__).resolve().parents[1]


def api_section() -> str:
    """README.md's "## Python API" section, up to the next heading."""
    text = (ROOT / "README.md").read_text()
    return text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]


def api_block() -> str:
    return re.search(r"```python\n(.*?)```", api_section(), re.S).group(1)


def test_import_treedec_imports_no_torch():
    """Every command imports the package first: its one-line errors must not wait for torch."""
    probe = "import sys, treedec; print(sorted(m for m in ('torch', 'lightning', 'hydra') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_every_name_of_the_front_door_is_its_home_modules_object():
    for name in treedec.__all__:
        obj = getattr(treedec, name)
        assert obj.__name__ == name and obj.__module__.startswith("treedec.")
    assert set(treedec.__all__) <= set(dir(treedec))
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        _ = treedec.no_such_name


def test_the_readme_api_imports_only_from_the_front_door():
    block, section = api_block(), api_section()
    imports = [line for line in block.splitlines() if line.startswith(("import ", "from "))]
    assert imports and all(line == "import torch" or line.startswith("from treedec import ") for line in imports)
    named = set(re.findall(r"\b([A-Z]\w*(?:Policy|Decoder)|SamplingParams)\b", section))
    assert named and named <= set(treedec.__all__), named - set(treedec.__all__)


def test_the_readme_api_block_runs_as_written(capsys):
    exec(compile(api_block(), "README.md (Python API)", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) >= 2 and "'tau'" in out[-1]  # the text and τ, then the stats dict
