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
    for name in ("treedec", "conf"):  # conf/ (top level) ships as the package treedec.conf
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    (src / "conf" / "local" / "default.yaml").write_text("# a maintainer's git-ignored overrides\n")  # never ships
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist",
          "."], cwd=src)
    wheel = next((tmp_path / "dist").glob("treedec-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        shipped = set(z.namelist())
    package_data = {p.relative_to(src).as_posix() for p in (src / "treedec" / "assets").rglob("*") if p.is_file()}
    package_data |= {"treedec/conf/" + p.relative_to(src / "conf").as_posix() for p in (src / "conf").rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts and "local" not in p.relative_to(src / "conf").parts}
    assert {"treedec/conf/generate.yaml", "treedec/conf/experiment/which_tree.yaml"} <= package_data
    assert package_data - shipped == set()  # every config and asset file is in the wheel
    assert not [n for n in shipped if n.startswith(("treedec/conf/local/", "conf/"))]  # conf/local/ never ships
    venv.create(tmp_path / "venv", system_site_packages=True, with_pip=False)
    py = tmp_path / "venv" / "bin" / "python"
    if sys.prefix != sys.base_prefix:  # run from a venv: the scratch venv sees its torch/hydra too (after its own
        # site-packages; a path added by a .pth is no site dir, so the repo's editable finder is not loaded there)
        site = next((tmp_path / "venv" / "lib").glob("python*/site-packages"))
        (site / "_parent_venv.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
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


def test_the_package_list_is_every_treedec_package_plus_the_configs():
    """pyproject lists its packages (setuptools takes a list or packages.find, and treedec.conf comes from conf/ by
    package-dir): a new subpackage of treedec/ must be added there, or the wheel would lack it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from setuptools import find_packages

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {"treedec.conf": "conf"} and (ROOT / "conf" / "__init__.py").is_file()
    assert sorted(setup["packages"]) == sorted(find_packages(str(ROOT), include=["treedec*"]) + ["treedec.conf"])
