"""The configuration layer, between the library (models, heads, trees, data) and the entry points: the structured
schemas (:mod:`.schema`, :mod:`.job_schema`) and the checks every entry point runs once, as
``validate(cfg, "<command>")``, before any model loads (:mod:`.validation`). A policy or a loader keeps only the
rules a Python caller could break, and the config layer calls that rule (never a second copy of it)."""
from treedec.config.checks import instantiate_checked
from treedec.config.validation import validate
from treedec.errors import ConfigError

__all__ = ["ConfigError", "instantiate_checked", "validate"]
