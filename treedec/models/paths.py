"""Where models live: the bundled assets and local Hugging Face directories (no torch needed to find them)."""
from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent
ASSETS = PACKAGE / "assets"  # the bundled models and heads (package data)
# The Hydra configs of every entry point: the package treedec.conf (conf/ at the repo root, mapped by pyproject's
# package-dir; a real directory in a normal or editable install), which entry points load as pkg://treedec.conf.
CONF = Path(str(files("treedec.conf")))
BUNDLED = {"tiny-code": ASSETS / "tiny-code", "tiny-code-assistant": ASSETS / "tiny-code-assistant"}
# How each bundled model is made, for the error when it is missing.
_BUNDLED_HOW = {
    "tiny-code": "python -m treedec.pretrain export_dir=bundled",
    "tiny-code-assistant": ("python -m treedec.pretrain model_arch=tiny_code_assistant paths.tokenizer=tiny-code "
                            "export_dir=bundled"),
}


def resolve_path(name_or_path: str | os.PathLike) -> Path:
    """Map a bundled name (``"tiny-code"``, ``"tiny-code-assistant"``) to its directory; check that a directory exists."""
    name = str(name_or_path)
    if name in BUNDLED:
        path = BUNDLED[name]
        if not (path / "config.json").is_file():
            how = _BUNDLED_HOW.get(name, "python -m treedec.pretrain")
            raise FileNotFoundError(
                f"the bundled model {name!r} is not at {path}: it is trained by `{how}` "
                f"(which writes it there), or pass the path of a local Hugging Face directory instead"
            )
        return path
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"no model directory at {str(path)!r}: pass 'tiny-code' (the bundled model) or a local Hugging Face "
            f"directory holding config.json and model.safetensors (treedec downloads nothing; fetch it beforehand, "
            f"e.g. `huggingface-cli download <repo> --local-dir DIR`)"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is a file; pass the directory that holds config.json and model.safetensors")
    return path


def bundled_dir(name: str) -> Path:
    """``treedec/assets/<name>``: where a model or head shipped with treedec lives."""
    return ASSETS / name


def export_path(export_dir: str | None, bundled: Path) -> Path | None:
    """``null`` -> no export; ``bundled`` -> the asset directory shipped with treedec; else the path.

    Any other path inside the package's assets is refused: replacing a shipped model is the
    explicit maintainer action ``export_dir=bundled``.
    """
    if not export_dir:
        return None
    if export_dir == "bundled":
        return bundled
    path = Path(export_dir).expanduser()
    assets = bundled.parent.resolve()
    if path.resolve() == assets or assets in path.resolve().parents:
        raise ValueError(f"export_dir={export_dir} is inside the package's assets ({assets}); to replace a shipped "
                         f"model pass export_dir=bundled (a maintainer action), else export anywhere else")
    if path.exists() and not path.is_dir():
        raise ValueError(f"export_dir={export_dir} is a file; pass a directory (it is created if missing)")
    return path


__all__ = ["ASSETS", "BUNDLED", "CONF", "PACKAGE", "bundled_dir", "export_path", "resolve_path"]
