"""A published head's weight files: safetensors (one file or a sharded index), or ``pytorch_model.bin`` read with
``torch.load(weights_only=True)``. Nothing else is ever unpickled, and a pickle that names a global is refused with
the name it holds (found by disassembling its opcodes, never by running them)."""
from __future__ import annotations

import pickletools
import re
import warnings
import zipfile
from pathlib import Path

import torch

from treedec.models.checkpoint import INDEX, WEIGHTS, CheckpointError, _open, _weight_map, check_finite

PICKLE = "pytorch_model.bin"


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a head directory: safetensors, or ``pytorch_model.bin`` with ``weights_only=True``."""
    if (path / INDEX).is_file() or (path / WEIGHTS).is_file():
        files = [path / WEIGHTS] if (path / WEIGHTS).is_file() else sorted(set(_weight_map(path).values()))
        out = {}
        for f in files:
            with _open(f) as sf:
                tensors = {k: sf.get_tensor(k) for k in sf.keys()}
            check_finite(f, tensors)
            out.update(tensors)
        return out
    if (path / PICKLE).is_file():
        file = path / PICKLE
        try:
            with warnings.catch_warnings():  # (torch's note on a pickle protocol: the error below says what matters)
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                sd = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # weights_only refuses anything but tensors and plain containers
            raise _bin_error(file, e) from e
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise CheckpointError(f"{file} is not a flat state dict of tensors (got {type(sd).__name__})")
        check_finite(file, sd)
        return sd
    found = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
    raise FileNotFoundError(f"{path} has config.json but no {WEIGHTS} or {PICKLE} (found: {found}); treedec reads "
                            f"safetensors, or {PICKLE} as plain tensors, never other pickle files")


def _bin_error(file: Path, exc: Exception) -> CheckpointError:
    """Why ``torch.load(file, weights_only=True)`` failed, for the user: a pickle naming a global (a callable such as
    ``os.system``, or a class) was refused, since unpickling it could run code; anything else is a corrupt file.
    torch's own message is not passed on: it suggests ``weights_only=False``, which is how such a file runs code."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    name = found.group(1) if found else _pickle_global(file)
    if name is None:
        return CheckpointError(f"{file} is corrupt: torch cannot read it as saved weights ({type(exc).__name__}; "
                               f"truncated, or not written by torch.save): re-download it, or use the head's {WEIGHTS}")
    return CheckpointError(f"{file} was refused: its pickle refers to {name}, and unpickling it could run code "
                           f"(treedec never unpickles objects, only plain tensors); do not load this file: use a "
                           f"{WEIGHTS} of this head from a source you trust")


def _pickle_global(file: Path) -> str | None:
    """The first global (``module.name``) outside torch that ``file``'s pickle refers to, read by disassembling its
    opcodes (nothing is executed); None when it names none or does not parse (a corrupt file)."""
    try:
        if zipfile.is_zipfile(file):
            with zipfile.ZipFile(file) as z:
                data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        else:
            data = file.read_bytes()
        strings: list[str] = []
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                name = str(arg).replace(" ", ".")
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                name = ".".join(strings[-2:])
            else:
                if isinstance(arg, str):
                    strings.append(arg)
                continue
            if not name.startswith(("torch.", "collections.OrderedDict")):
                return name
    except Exception:
        return None
    return None


__all__ = ["PICKLE", "read_weights"]
