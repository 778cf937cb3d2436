"""A plain (non-editable) install works from any directory: configs and bundled assets ship in the wheel.

The wheel is built from a copy of the package (a stale ``build/`` in the repo cannot leak into it),
installed into a scratch venv that sees the system's torch/hydra (``--system-site-packages``) but not
the repo, and ``python -m treedec.generate`` runs from an empty directory with that venv's python.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


@pytest.mark.slow
def test_wheel_installs_and_generates_from_any_directory(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "treedec", src / "treedec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
          "."], cwd=src)
    wheel = next((tmp_path / "dist").glob("treedec-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        shipped = set(z.namelist())
    package_data = {p.relative_to(src).as_posix() for d in ("conf", "assets") for p in (src / "treedec" / d).rglob("*")
                    if p.is_file()}
    assert package_data - shipped == set()  # every config and asset file is in the wheel
    venv.create(tmp_path / "venv", system_site_packages=True, with_pip=False)
    py = tmp_path / "venv" / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "-q", wheel], cwd=tmp_path)

    work = tmp_path / "work"
    work.mkdir()
    where = _run([py, "-c", "import treedec, treedec.models.paths as p; print(treedec.__file__); print(p.CONF)"], work)
    pkg, conf = where.stdout.split()
    site = str(tmp_path / "venv" / "lib")
    assert pkg.startswith(site) and conf.startswith(site), where.stdout  # the venv's copy, not the repo's
    assert (Path(conf) / "generate.yaml").is_file() and (Path(pkg).parent / "assets" / "tiny-code").is_dir()

    done = _run([py, "-m", "treedec.generate", "max_new_tokens=4", "stream=false"], work)
    assert "tokens" in done.stdout
    runs = list((work / "outputs" / "generate").glob("*/*/metrics.json"))  # the run dir is under the cwd
    assert len(runs) == 1 and json.loads(runs[0].read_text())["new_tokens"] > 0
    installed = Path(pkg).parent
    assert not list(installed.rglob("outputs")) and not list(installed.rglob("metrics.json"))  # nothing written there
