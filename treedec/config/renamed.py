"""Keys the config layout renamed, and the command-line overrides refused before Hydra parses them: an old key
fails naming the new one (Hydra would only say "not in struct"), and a ``hydra.run.dir`` that is a file or lies
below one fails before Hydra makes it (with a traceback, before the task's own checks)."""
from __future__ import annotations

from typing import Sequence

from treedec.config.checks import check_out_path
from treedec.errors import ConfigError

# old key -> (its new name, the entry points where it was renamed; () = all of them)
RENAMED: dict[str, tuple[str, tuple[str, ...]]] = {
    "target": ("model.path (train's target is the model group, as in generate: model=hf model.path=DIR)", ("train",)),
    "target_dtype": ("model.dtype", ("train",)),
    "draft": ("draft_arch (the head to train; draft is a head to load, as in generate)", ("train",)),
    "head": ("draft.path (the head to export: draft.path=DIR, or the bundled draft=tiny_code)", ("export_head",)),
    "kernel.backend": ("model.attn_backend (or kernel=NAME)", ()),
}
RUN_DIR_KEYS = ("hydra.run.dir", "hydra.sweep.dir")  # made by Hydra before any task code runs


def renamed(key: str, entry: str) -> str | None:
    """The message for a key (``a.b`` or a group ``a``) that ``entry``'s configs renamed; None if it is current."""
    for old, (new, entries) in RENAMED.items():
        if (key == old or key.startswith(old + ".")) and (not entries or entry in entries):
            return f"{old} is now {new}: pass that instead"
    return None


def check_overrides(entry: str, overrides: Sequence[str]) -> None:
    """A :class:`~treedec.errors.ConfigError` for the first override of ``entry`` that sets a renamed key
    (``target=``, ``kernel.backend=``...) or a run dir Hydra cannot make."""
    for arg in overrides:
        key, _, value = arg.lstrip("+~").partition("=")
        if "=" in arg and not arg.startswith("hydra") and (msg := renamed(key, entry)):
            raise ConfigError(msg)
        if key in RUN_DIR_KEYS:
            check_out_path(value, key)


__all__ = ["RENAMED", "RUN_DIR_KEYS", "check_overrides", "renamed"]
