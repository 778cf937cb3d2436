"""The error every layer raises for a wrong option, so that raising it imports nothing above the raiser."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config that does not match its schema (unknown key, wrong type, bad value)."""


# Errors whose message is written for the user (ConfigError, CheckpointError, TreeError are ValueErrors).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, IsADirectoryError,
                                                NotADirectoryError, PermissionError)


# Keys the config layout renamed: an old command or config fails with the new name, never silently.
# old key -> (its new name, the entry points where it was renamed; () = all of them)
RENAMED: dict[str, tuple[str, tuple[str, ...]]] = {
    "target": ("model.path (train's target is the model group, as in generate: model=hf model.path=DIR)", ("train",)),
    "target_dtype": ("model.dtype", ("train",)),
    "draft": ("draft_arch (the head to train; draft is a head to load, as in generate)", ("train",)),
    "head": ("draft.path (the head to export: draft.path=DIR, or the bundled draft=tiny_code)", ("export_head",)),
    "kernel.backend": ("model.attn_backend (or kernel=NAME)", ()),
}


def renamed(key: str, entry: str) -> str | None:
    """The message for a key (``a.b`` or a group ``a``) that ``entry``'s configs renamed; None if it is current."""
    for old, (new, entries) in RENAMED.items():
        if (key == old or key.startswith(old + ".")) and (not entries or entry in entries):
            return f"{old} is now {new}: pass that instead"
    return None


__all__ = ["ConfigError", "RENAMED", "USER_ERRORS", "renamed"]
