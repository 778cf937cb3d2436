"""Benchmarks: the speculative-decoding harness, peers, the kernel micro-benchmark and reports."""

# The peers a bench can run (bench/peers.py), here so that the config check (treedec/config_checks.py) reads the
# names without importing the benchmark.
PEERS = ("hf_greedy", "hf_prompt_lookup", "hf_assisted", "hf_sample")
