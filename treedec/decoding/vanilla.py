"""Vanilla autoregressive decoding: the baseline every speedup is measured against.

One prefill pass, then one target forward per token, over a static KV cache allocated
once. Token choice goes through :func:`treedec.sampling.next_token`, the same
distribution the speculative verifier uses, so "lossless" has one definition. The loop, the
prompt checks, EOS / budget rules, stats and hooks are :class:`treedec.decoding.loop.Decoder`'s.

Rows may have prompts of different lengths: the batch is right-padded, prefilled once, and
each row's cache length is then set to its own prompt length. Finished rows ride along frozen
(their tokens are dropped, their caches not advanced) so the batch stays rectangular, unless
``serve(..., compact=True)`` cuts them out.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from treedec.decoding.loop import Decoder
from treedec.decoding.prompt_checks import check_context, normalize_eos, normalize_prompts, pad_prompts, static_room
from treedec.decoding.stats import GenerateResult, StepInfo, Timer
from treedec.models.cache import KVCache
from treedec.models.compile import compile_forward
from treedec.sampling import RowStreams, SamplingParams, draw_from, next_token, read_settled, settle

GREEDY = SamplingParams()


def pick(logits: torch.Tensor, params: SamplingParams, streams: RowStreams | None,
         active: Sequence[bool]) -> tuple[torch.Tensor, list[int]]:
    """One decoding step's token per row from ``logits`` [B, V] -> (tokens on the device, on the host).

    ``next_token``'s draw with its rare top-p misses read along with the tokens: one host read
    (two when an ``active`` row missed and is drawn exactly). Speculative plain steps use it too.
    """
    d = draw_from(logits, params, streams)
    toks, redo = read_settled(d, active)  # the one host read of the step
    if not redo:
        return d.token, toks
    token = settle(d, params, streams, redo)  # rare: every top-p candidate of a row missed the nucleus
    return token, token.tolist()


class VanillaDecoder(Decoder):
    """One target forward per token; ``cache`` may be reused across calls (it is reset)."""

    def __init__(self, target, sampling: SamplingParams = GREEDY, eos_ids: Sequence[int] | int | None = None,
                 cache: KVCache | None = None, compile: bool = False):
        self.target, self.sampling = target, sampling
        self.eos = normalize_eos(eos_ids, target.config.eos_ids)
        self.cache, self.compile = cache, compile
        self._given = cache is not None  # a user's cache must fit; our own is re-made as needed
        self._fwd = None

    def _prefill(self, rows: list[list[int]], max_new_tokens: int, generator, longest: int = 0) -> list[int]:
        tgt = self.target
        B, need = len(rows), max(longest, *map(len, rows)) + max_new_tokens
        if self.compile and not self._given:
            need = static_room(need, tgt.config.context_length)  # few cache shapes: few graphs
        if self.cache is None or self.cache.batch != B or self.cache.max_len < need:
            if self._given:
                raise ValueError(f"the cache given holds batch {self.cache.batch} x {self.cache.max_len} slots; "
                                 f"this call needs batch {B} x {need}")
            self.cache = tgt.new_cache(B, need)
        self.cache.reset()
        self._tok, self._streams = self._fill(rows, self.cache, generator)
        self._index = 0
        if self.compile and self._fwd is None:
            self._fwd = compile_forward(tgt)
        return self._tok.tolist()

    def _fill(self, rows: list[list[int]], cache: KVCache, generator) -> tuple[torch.Tensor, RowStreams | None]:
        """Prefill ``rows`` into an empty ``cache`` -> (each row's first token, the rows' random streams)."""
        ids, lens = pad_prompts(rows, self.target.device)
        logits = self.target(ids, cache, logits=(lens - 1)[:, None]).logits[:, 0]
        cache.rollback([len(r) for r in rows])
        streams = None if self.sampling.greedy else RowStreams(generator, len(rows), self.target.device)  # one per row
        return next_token(logits, self.sampling, streams), streams

    def _admit(self, slots: list[int], rows: list[list[int]], generator) -> list[int]:
        """New prompts take finished rows' slots: prefilled in a cache of their own, then moved in."""
        cache = self.target.new_cache(len(rows), max(map(len, rows)))
        tok, streams = self._fill(rows, cache, generator)
        self.cache.put_rows(slots, cache)
        self._tok = self._tok.clone()
        self._tok[torch.tensor(slots, device=tok.device)] = tok
        if streams is not None:
            self._streams.put_rows(slots, streams)
        return tok.tolist()

    def _check_serve(self, compact: bool) -> None:
        if compact and self._given:
            raise ValueError("serve(compact=True) would cut the cache you passed in to fewer rows; pass "
                             "compact=False, or no cache")

    def _keep_rows(self, order: list[int]) -> None:
        self.cache.keep_rows(order)
        self._tok = self._tok[torch.tensor(order, device=self._tok.device)]
        if self._streams is not None:
            self._streams.keep_rows(order)

    def _step(self, active: list[bool], generator, timer: Timer) -> tuple[StepInfo, int]:
        cache = self.cache
        if self._fwd is not None:
            logits = self._fwd(self._tok[:, None], cache, cache.lengths[:, None], None, "last").logits[:, -1]
        else:
            logits = self.target(self._tok[:, None], cache, logits="last").logits[:, -1]
        cache.advance(1 if all(active) else [int(a) for a in active])  # a finished row's cache stays frozen
        timer.lap("verify")
        self._tok, toks = pick(logits, self.sampling, self._streams, active)
        timer.lap("accept")
        self._index += 1
        return StepInfo(self._index, active, [[t] if a else [] for t, a in zip(toks, active)],
                        [int(a) for a in active]), 1


def generate(
    model,
    prompt_ids,
    max_new_tokens: int,
    sampling: SamplingParams = GREEDY,
    eos_ids: Sequence[int] | int | None = None,
    generator: torch.Generator | None = None,
    cache: KVCache | None = None,
    stream: Callable[[int, list[int]], None] | None = None,
    compile: bool = False,
    hook: Callable[[StepInfo], None] | None = None,
    timing: bool = False,
) -> GenerateResult:
    """Generate up to ``max_new_tokens`` per row, one target forward per token.

    ``eos_ids``: None uses the model config's EOS ids; pass ``[]`` to never stop early.
    ``cache``: an existing :class:`KVCache` to reuse (batch and length must fit; it is reset).
    ``compile``: ``torch.compile`` the decode step with static shapes (the cache sized in
    power-of-two buckets, a graph per bucket); the first call of a bucket pays the compile time.
    """
    dec = VanillaDecoder(model, sampling, eos_ids, cache=cache, compile=compile)
    return dec.generate(prompt_ids, max_new_tokens, generator=generator, stream=stream, hook=hook, timing=timing)


__all__ = ["GREEDY", "GenerateResult", "VanillaDecoder", "check_context", "generate", "normalize_prompts", "pick"]
