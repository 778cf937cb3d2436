"""The machine a benchmark ran on (CPU model and flags, threads, GPU, git commit), recorded in metrics.json."""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from treedec.heads.quantized import is_quantized


# --------------------------------------------------------------------------- machine
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return sorted(have & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"})
    except OSError:
        pass
    return []


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info(target, draft=None) -> dict:
    """Where a benchmark ran; ``draft_dtype`` is the head's dtype as loaded (``draft.dtype=auto`` measures it),
    ``draft_int8`` whether its weights are int8 (``draft.quantize=auto`` measures that) and ``draft_wide_rows`` the batch
    from which its bf16 twin drafts (None: it has none; ``draft.dtype=auto`` measures that too)."""
    dev = target.device
    info = {
        "cpu": _cpu_model(), "cpu_flags": _cpu_flags(), "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "device": str(dev), "dtype": str(target.dtype).removeprefix("torch."),
        "attn_backend": target.backend(),
        "git_commit": _git_commit(),
    }
    if draft is not None:
        info["draft_dtype"] = str(draft.dtype).removeprefix("torch.")
        info["draft_int8"] = is_quantized(draft)
        info["draft_wide_rows"] = draft.wide_rows  # a bf16 twin drafts batches of this many rows and more
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["cuda"] = torch.version.cuda
    try:  # the installed version, read without importing transformers (seconds)
        info["transformers"] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        info["transformers"] = None
    return info
