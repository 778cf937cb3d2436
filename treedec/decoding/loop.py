"""The decoding loop shared by vanilla and speculative decoding.

:class:`Decoder` owns everything both have in common: prompt checks (once per ``generate``),
EOS and ``max_new_tokens`` rules, streaming, one result type and one stats type, an opt-in
timer and a per-step hook. Subclasses implement two methods: ``_prefill`` (prompt -> first
token per row) and ``_step`` (one target pass -> the tokens it produced per row). The prompt checks are in
:mod:`treedec.decoding.prompt_checks`; the stats, result and timer types (and τ's definition) in
:mod:`treedec.decoding.stats`.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Sequence

import torch

from treedec.decoding.prompt_checks import check_budget, check_context, check_slots, normalize_prompts
from treedec.decoding.stats import DecodeStats, GenerateResult, StepInfo, Timer
from treedec.sampling import RowSeededGenerator, SamplingParams, row_seeds


class Emitter:
    """Applies EOS and the budget per row, streams, and says which rows are done."""

    def __init__(self, batch: int, limit: int, eos: set[int], stream: Callable[[int, list[int]], None] | None):
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.done = [limit <= 0] * batch
        self.limit, self.eos, self.stream = limit, eos, stream

    def emit(self, new: Sequence[Sequence[int]], rows: Sequence[int] | None = None) -> list[int]:
        """Append each row's new tokens up to EOS / the budget -> how many each kept (``new[i]`` belongs to row
        ``rows[i]``; default: row i)."""
        kept = [0] * len(new)
        for i, toks in enumerate(new):
            b = i if rows is None else rows[i]
            if self.done[b]:
                continue
            toks = list(toks[: self.limit - len(self.tokens[b])])
            for k, t in enumerate(toks):
                if t in self.eos:
                    toks = toks[: k + 1]
                    self.done[b] = True
                    break
            self.tokens[b].extend(toks)
            kept[i] = len(toks)
            if len(self.tokens[b]) >= self.limit:
                self.done[b] = True
            if self.stream is not None and toks:
                self.stream(b, toks)
        return kept

    @property
    def all_done(self) -> bool:
        return all(self.done)


# ---------------------------------------------------------------------------------------- decoder
class Decoder:
    """One loop for every decoder: validate once, prefill, then ``_step`` until every row is done.

    :meth:`serve` runs a queue of prompts through a fixed number of batch slots (continuous batching,
    as serving engines do): when a row finishes, the next prompt is prefilled on its own and takes the
    row's slot (``_admit``), so the batch stays full until the queue runs dry; with ``compact`` a slot
    that no prompt refills leaves the batch (``_keep_rows``), so the passes run over the live rows only.
    :meth:`generate` is :meth:`serve` with one slot per prompt. Subclasses implement ``_prefill``,
    ``_step``, and for refills and compaction ``_admit`` and ``_keep_rows``.
    """

    target: torch.nn.Module
    sampling: SamplingParams
    eos: set[int]
    compact = False  # default for serve(): finished rows ride along frozen (static shapes) rather than leave

    def _prefill(self, rows: list[list[int]], max_new_tokens: int, generator, longest: int = 0) -> list[int]:
        """Fresh state for a batch of ``rows`` -> each row's first token. ``longest``: room for prompts of this many
        tokens to be admitted later."""
        raise NotImplementedError

    def _step(self, active: list[bool], generator, timer: Timer) -> tuple[StepInfo, int]:
        """One target pass -> (StepInfo, tree size verified) ; must not read the device more than once."""
        raise NotImplementedError

    def _admit(self, slots: list[int], rows: list[list[int]], generator) -> list[int]:
        """Prefill ``rows`` into batch slots ``slots`` (whose rows are done) -> their first tokens."""
        raise NotImplementedError(f"{type(self).__name__} cannot refill a batch slot (serve with slots >= prompts)")

    def _keep_rows(self, order: list[int]) -> None:
        """Cut the batch to slots ``order`` (slot j gets old slot ``order[j]``): per-row state follows."""
        raise NotImplementedError(f"{type(self).__name__} cannot drop rows (serve with compact=False)")

    def _prepare(self, rows: int, context: int) -> None:
        """One-time work before decoding a batch of ``rows`` rows attending over about ``context`` tokens is timed
        (a tree policy measuring this machine): reported apart, as ``stats.prepare_time``."""

    def _check_serve(self, compact: bool) -> None:
        """Refuse, before any work, a ``serve`` this decoder cannot run."""

    def generate(self, prompts, max_new_tokens: int, generator: torch.Generator | None = None,
                 stream: Callable[[int, list[int]], None] | None = None,
                 hook: Callable[[StepInfo], None] | None = None, timing: bool = False) -> GenerateResult:
        """Generate up to ``max_new_tokens`` per row (stopping after an EOS token), all rows in one batch.

        ``stream(row, tokens)`` sees every token once, as it is accepted; ``hook(step)`` sees
        each decoding pass; ``timing`` fills ``stats.time`` (phase split) at no cost when off.
        """
        return self.serve(prompts, max_new_tokens, None, generator, stream, hook, timing)

    def serve(self, prompts, max_new_tokens: int, slots: int | None = None, generator: torch.Generator | None = None,
              stream: Callable[[int, list[int]], None] | None = None, hook: Callable[[StepInfo], None] | None = None,
              timing: bool = False, compact: bool | None = None) -> GenerateResult:
        """Decode every prompt, at most ``slots`` at a time (None: all at once); results in prompt order.

        A prompt's tokens do not depend on ``slots`` (rows of a batched pass do not interact; greedy fp32
        and seeded sampling are tested token for token): a sampled row draws from its own stream, named
        by the generator's row seeds (:class:`~treedec.sampling.RowSeededGenerator`, one per
        prompt) or derived from one base draw and the prompt's index. (Sampled: with a tree of fixed
        shape per row; tree=auto's T depends on the batch, sampled drafts share the generator, and
        in bf16 another batch shape may round a near-tie the other way.) ``compact`` (default: the class's
        ``compact``): a slot nothing refills leaves the batch. ``hook`` sees every pass; when slots are
        refilled or cut, its ``StepInfo`` is in prompt order and carries no tree, path or logits (their
        rows are slots).
        """
        rows = normalize_prompts(prompts)
        max_new_tokens = check_budget(max_new_tokens)
        check_context(self.target, rows, max_new_tokens)
        slots = check_slots(slots)
        width = len(rows) if slots is None else min(slots, len(rows))
        compact = self.compact if compact is None else bool(compact)
        self._check_serve(compact)
        mapped = compact or width < len(rows)  # slots and prompts part ways: StepInfo goes to prompt order
        stats = DecodeStats(batch=width)
        out = Emitter(len(rows), max_new_tokens, self.eos, stream)
        if max_new_tokens == 0:
            return GenerateResult(out.tokens, stats)
        rowgen = _row_generators(generator, len(rows), self.sampling, width)
        dev = self.target.device
        t_start = time.perf_counter()
        self._prepare(width, max(map(len, rows)) + max_new_tokens // 2)
        stats.prepare_time = time.perf_counter() - t_start
        timer = Timer(dev, timing)
        t_start = time.perf_counter()
        live, queue = list(range(width)), deque(range(width, len(rows)))
        self._live = live  # live[j]: the prompt in batch slot j (for hooks and tests)
        with torch.inference_mode():
            first = self._prefill(rows[:width], max_new_tokens, rowgen(live), max(len(r) for r in rows))
            timer.lap("prefill")
            stats.prefills += 1
            out.emit([[t] for t in first], live)
            while True:
                free = [j for j, b in enumerate(live) if out.done[b]]
                if free and queue:  # finished rows hand their slots to waiting prompts
                    new = [queue.popleft() for _ in free[:len(queue)]]
                    first = self._admit(free[:len(new)], [rows[b] for b in new], rowgen(new))
                    timer.lap("prefill")
                    stats.prefills += 1
                    for j, b in zip(free, new):
                        live[j] = b
                    out.emit([[t] for t in first], new)
                    continue  # (a prompt may be done at its first token)
                if len(free) == len(live):
                    break
                if compact and free:
                    order = _compaction([not out.done[b] for b in live])
                    self._keep_rows(order)
                    live = self._live = [live[j] for j in order]
                active = [not out.done[b] for b in live]
                info, size = self._step(active, generator, timer)
                kept = out.emit(info.tokens, live)
                stats.record(active, [max(n - 1, 0) for n in info.n_accept], kept, size)
                if hook is not None:
                    hook(_in_prompt_order(info, live, out.done) if mapped else info)
            self._finish(stats)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        stats.total_time = time.perf_counter() - t_start
        if timing:
            stats.time = timer.result()
        stats.new_tokens = sum(len(r) for r in out.tokens)
        return GenerateResult(out.tokens, stats)

    def _finish(self, stats: DecodeStats) -> None:
        """Fold per-run device-side counters into ``stats`` (one read at the end)."""


def _compaction(alive: list[bool]) -> list[int]:
    """The slots to keep, in their new order, when the rows not ``alive`` leave: a live row past the new width
    moves into a finished row's slot (one row copied per finished row, not every row behind it)."""
    n = sum(alive)
    order = list(range(n))
    movers = [j for j in range(n, len(alive)) if alive[j]]
    for hole, mover in zip([j for j in range(n) if not alive[j]], movers):
        order[hole] = mover
    return order


def _in_prompt_order(info: StepInfo, live: list[int], done: list[bool]) -> StepInfo:
    """A step's tokens and counts mapped from batch slots to prompts (prompts not in the batch: nothing)."""
    tokens, n_accept = [[] for _ in done], [0] * len(done)
    active = [False] * len(done)
    for j, b in enumerate(live):
        tokens[b], n_accept[b], active[b] = info.tokens[j], info.n_accept[j], info.active[j]
    return StepInfo(info.index, active, tokens, n_accept, seconds=info.seconds)


def _row_generators(generator, n_prompts: int, sampling: SamplingParams, width: int):
    """prompt ids -> the generator a prefill of those prompts draws its row streams from. With every prompt in
    the first batch, the caller's own (so ``generate`` is unchanged); else one naming each prompt's seed."""
    if sampling.greedy or width == n_prompts:
        return lambda ids: generator
    seeds = row_seeds(generator, n_prompts)
    dev = generator.device if generator is not None else "cpu"
    return lambda ids: RowSeededGenerator([seeds[b] for b in ids], dev)
