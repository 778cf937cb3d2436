"""The error every layer raises for a wrong option, so that raising it imports nothing above the raiser."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config that does not match its schema (unknown key, wrong type, bad value)."""


# Errors whose message is written for the user (ConfigError, CheckpointError, TreeError are ValueErrors).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, IsADirectoryError,
                                                NotADirectoryError, PermissionError)


__all__ = ["ConfigError", "USER_ERRORS"]
