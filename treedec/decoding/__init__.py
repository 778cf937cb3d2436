"""Decoding: the vanilla baseline, verification rules and the speculative loop."""
