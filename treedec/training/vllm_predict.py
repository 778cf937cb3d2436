"""``regenerate engine=vllm``: the regeneration job's rounds decoded by vLLM (:class:`~treedec.engines.vllm.VllmServer`,
one engine in a child process for the whole job, batching each round's prompts continuously) instead of treedec's
decoder. Everything else is the Lightning job's: shards, manifest, resume, SIGTERM, parts.

vLLM decodes with its own vanilla loop (greedy output is the target's whatever the engine: in fp32 the shards equal
``engine=lightning``'s byte for byte on the bundled target). Sampled rows are seeded per row by the same
(``seed``, record, turn) rule, through vLLM's per-request seed: reproducible run to run, but not the Lightning
engine's samples (another generator)."""
from __future__ import annotations

from collections.abc import Sequence

from treedec.decoding.stats import DecodeStats
from treedec.engines.vllm import VllmServer
from treedec.sampling import SamplingParams
from treedec.training.predict import GenerationModule


class VllmGenerationModule(GenerationModule):
    """Each round as one request to ``server``; its stats count one target pass per token (vLLM's vanilla)."""

    def __init__(self, server: VllmServer, context_length: int, sampling: SamplingParams, max_new_tokens: int,
                 eos_ids: Sequence[int] | None, seed: int = 0):
        super().__init__(max_new_tokens, seed, context_length)
        self.server, self.sampling, self.eos_ids = server, sampling, list(eos_ids or [])

    def decode_round(self, prompts: list[list[int]], seeds: list[int], seed: int) -> tuple[list[list[int]], DecodeStats]:
        s = self.sampling
        temperature = 0.0 if s.greedy else float(s.temperature)
        tokens = self.server.generate(prompts, self.max_new_tokens, [sd % (1 << 31) for sd in seeds], self.eos_ids,
                                      temperature, float(s.top_p), int(s.top_k))
        new = sum(len(t) for t in tokens)
        steps = sum(max(len(t) - 1, 0) for t in tokens)  # the prefill gives each row's first token
        stats = DecodeStats(batch=len(prompts), new_tokens=new, row_steps=steps, step_tokens=steps,
                            prefills=len(prompts))
        return tokens, stats


__all__ = ["VllmGenerationModule"]
