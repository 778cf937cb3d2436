"""The error every layer raises for a wrong option, so that raising it imports nothing above the raiser."""
from __future__ import annotations


class ConfigError(ValueError):
    """A config that does not match its schema (unknown key, wrong type, bad value)."""


__all__ = ["ConfigError"]
