"""Speculative decoding as a Lightning predict job: ``trainer.predict`` over batches of prompt requests.

:class:`SpeculativeGenerationModule` wraps a target, its draft head and a tree policy (the kernel is
the target's attention backend, chosen when it was loaded) and runs :class:`SpeculativeDecoder`
on each batch in ``predict_step``. It is the draft trainer's sibling: both are LightningModules
over the same model stack, so ``trainer=ddp`` (gloo / NCCL), SLURM and the progress callbacks work
the same way; the target and head are submodules here, so Lightning moves them to each rank's device.

A batch is a list of requests (:class:`Prompt`, or anything with ``key``, ``next_prompt()`` and
``take()``). A request may ask for several prompts in turn (a chat asks for one per assistant
turn, each prompt holding the replies generated before): the module decodes the batch in rounds,
one ragged :meth:`SpeculativeDecoder.generate` per round over the requests that still want one, so
a conversation with fewer turns leaves the batch after its last one. Within a round a row that
finishes early (EOS or its budget) leaves the batch too (:class:`CompactingDecoder`): the draft and
verify passes run over the live rows only. With ``slots`` the round's prompts queue for that many
rows, and a freed slot takes the next prompt at once (continuous batching); without it, freed slots
are not refilled until the next batch.

Randomness is per request: row b of a round draws from a stream seeded by (``seed``, request key,
round; a request's round is its own prompt count, as requests only ever leave) (:class:`~treedec.sampling.RowSeededGenerator`), so a sampled record decodes the
same whatever batch, position or process it lands in; greedy fp32 is batch-independent as long as
the batches are (the float sums of a batched pass depend on the batch's shape).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import lightning as L

from treedec.decoding.prompt_checks import check_slots
from treedec.decoding.speculative import CompactingDecoder, SpeculativeDecoder
from treedec.decoding.stats import DecodeStats
from treedec.heads import DraftHead
from treedec.models.llama import Transformer
from treedec.sampling import RowSeededGenerator, SamplingParams
from treedec.tree.policies.base import TreePolicy


class Request(Protocol):
    key: object  # the record's id: seeds its random stream

    def next_prompt(self) -> list[int] | None:
        """The next prompt's token ids, or None when the request is complete."""

    def take(self, tokens: list[int]) -> None:
        """The continuation of the last prompt (EOS included when the row stopped on it)."""


@dataclass
class Prompt:
    """A one-prompt request: ``tokens`` is filled by the module."""

    key: object
    ids: list[int]
    tokens: list[int] | None = field(default=None)

    def next_prompt(self) -> list[int] | None:
        return self.ids if self.tokens is None else None

    def take(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)


def row_seed(seed: int, key: object, turn: int) -> int:
    """A 63-bit seed from (job seed, record key, turn): the same on every process and in every batch."""
    digest = hashlib.sha1(f"{int(seed)}\0{key!r}\0{int(turn)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class GenerationModule(L.LightningModule):
    """What every regeneration engine shares: requests decoded in rounds (a chat asks for one prompt per turn), each
    prompt cut to the context, each row seeded by (``seed``, its request's key, the round): ``predict_step(batch)``
    -> ``{"requests": batch (filled), "stats": DecodeStats, "seconds": float}``. An engine gives :meth:`decode_round`."""

    def __init__(self, max_new_tokens: int, seed: int, context_length: int):
        super().__init__()
        self.max_new_tokens, self.seed, self.context_length = int(max_new_tokens), int(seed), int(context_length)

    def fit_prompt(self, ids: list[int]) -> list[int]:
        """The prompt's last ``context - max_new_tokens`` tokens: a long conversation keeps its recent turns."""
        room = self.context_length - self.max_new_tokens
        if room < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} leaves no room for a prompt in the target's "
                             f"context of {self.context_length} tokens")
        return list(ids[-room:])

    def decode_round(self, prompts: list[list[int]], seeds: list[int], seed: int) -> tuple[list[list[int]], DecodeStats]:
        """(each prompt's continuation, the round's stats); ``seeds``: each row's, ``seed``: the round's."""
        raise NotImplementedError

    def generate(self, requests: Sequence[Request]) -> DecodeStats:
        """Decode every request to completion, in rounds of ragged batches; the stats of all rounds."""
        stats, turn = DecodeStats(batch=len(requests)), 0
        while True:
            live = [(r, p) for r in requests if (p := r.next_prompt()) is not None]
            if not live:
                return stats
            tokens, round_stats = self.decode_round([self.fit_prompt(p) for _, p in live],
                                                    [row_seed(self.seed, r.key, turn) for r, _ in live],
                                                    row_seed(self.seed, tuple(r.key for r, _ in live), turn))
            for (r, _), toks in zip(live, tokens):
                r.take(toks)
            stats, turn = stats.merge(round_stats), turn + 1

    def predict_step(self, batch: Sequence[Request], batch_idx: int = 0, dataloader_idx: int = 0) -> dict:
        t0 = time.perf_counter()
        stats = self.generate(batch)
        return {"requests": batch, "stats": stats, "seconds": time.perf_counter() - t0}


class SpeculativeGenerationModule(GenerationModule):
    """treedec's engine: :class:`SpeculativeDecoder` (or :class:`CompactingDecoder`) over each round."""

    def __init__(self, target: Transformer, draft: DraftHead, policy: TreePolicy,
                 sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
                 eos_ids: Sequence[int] | None = None, seed: int = 0, compile: bool = False, compact: bool = True,
                 slots: int | None = None):
        """``compact``: finished rows leave the batch (:class:`CompactingDecoder`; off with ``compile``, whose
        graphs are per batch shape); False: they ride along frozen, as in ``SpeculativeDecoder``. ``slots``: at
        most this many rows decode at once, the round's other prompts queueing for a finished row's slot
        (continuous batching, :meth:`~treedec.decoding.loop.Decoder.serve`); None: the whole batch at once."""
        super().__init__(max_new_tokens, seed, target.config.context_length)
        self.target, self.draft = target, draft
        self.policy, self.sampling = policy, sampling
        self.eos_ids, self.compile = eos_ids, bool(compile)
        self.compact = bool(compact) and not self.compile
        self.slots = check_slots(slots)  # (fails here, at construction, not at the first batch)
        self._decoder: SpeculativeDecoder | None = None

    @property
    def decoder(self) -> SpeculativeDecoder:
        """Built on first use, after Lightning has moved the stack to this rank's device."""
        if self._decoder is None or self._decoder.target.device != self.target.device:
            cls = CompactingDecoder if self.compact else SpeculativeDecoder
            self._decoder = cls(self.target, self.draft, self.policy, self.sampling, eos_ids=self.eos_ids,
                                compile=self.compile)
        return self._decoder

    def decode_round(self, prompts: list[list[int]], seeds: list[int], seed: int) -> tuple[list[list[int]], DecodeStats]:
        gen = RowSeededGenerator(seeds, self.target.device, seed=seed)
        res = self.decoder.serve(prompts, self.max_new_tokens, self.slots, gen)
        return res.tokens, res.stats


__all__ = ["GenerationModule", "Prompt", "Request", "SpeculativeGenerationModule", "row_seed"]
