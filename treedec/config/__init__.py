"""The configuration layer: the structured schemas (:mod:`.schema`) and the checks every entry point runs once,
before any model loads."""
