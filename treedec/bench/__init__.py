"""Benchmarks: the speculative-decoding harness, peers, the kernel micro-benchmark and reports."""
