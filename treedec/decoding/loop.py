"""The decoding loop shared by vanilla and speculative decoding.

:class:`Decoder` owns everything both have in common: prompt checks (once per ``generate``),
EOS and ``max_new_tokens`` rules, streaming, one result type and one stats type, an opt-in
timer and a per-step hook. Subclasses implement two methods: ``_prefill`` (prompt -> first
token per row) and ``_step`` (one target pass -> the tokens it produced per row).

τ is defined once, in :class:`DecodeStats`: tokens actually emitted by the target's decoding
passes (after EOS and the budget cut them) divided by the (row, pass) pairs that produced
them. The prefill's first token is not a decoding pass and counts in neither. Vanilla
decoding has τ = 1 by this definition.
"""
from __future__ import annotations

import numbers
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from treedec.sampling import RowSeededGenerator, SamplingParams, row_seeds

TIME_KEYS = ("prefill", "draft", "verify", "accept", "commit")


# ----------------------------------------------------------------------------------- prompt checks
def _token_row(r, b: int) -> list[int]:
    if torch.is_tensor(r):
        if r.is_floating_point() or r.is_complex():
            raise ValueError(f"prompt {b} holds {r.dtype} token ids; token ids must be integers")
        return r.tolist()
    out = []
    for t in r:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt {b} holds token id {t!r} ({type(t).__name__}); token ids must be integers")
        out.append(int(t))
    return out


def normalize_prompts(prompt_ids) -> list[list[int]]:
    """LongTensor [B, L] | [L], list[int] or list[list[int]] -> list of non-empty integer rows."""
    if torch.is_tensor(prompt_ids):
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids[None]
        if prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids must be [B, L] or [L]; got shape {tuple(prompt_ids.shape)}")
        rows = [_token_row(r, b) for b, r in enumerate(prompt_ids)]
    else:
        rows = list(prompt_ids)
        if rows and not isinstance(rows[0], (list, tuple)) and not torch.is_tensor(rows[0]):
            rows = [rows]
        elif rows and torch.is_tensor(rows[0]) and rows[0].dim() == 0:
            rows = [rows]
        rows = [_token_row(r, b) for b, r in enumerate(rows)]
    if not rows:
        raise ValueError("empty batch: pass at least one prompt")
    for b, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"prompt {b} is empty: a prompt needs at least one token (e.g. the BOS token)")
    return rows


def check_budget(max_new_tokens) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise ValueError(f"max_new_tokens must be a whole number, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    return int(max_new_tokens)


def check_context(model, rows: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """Raise a clear error, before any work, when the prompts or the generation cannot fit."""
    max_new_tokens = check_budget(max_new_tokens)
    cfg = model.config
    ctx = getattr(cfg, "context_length", cfg.max_position_embeddings)
    longest = max(len(r) for r in rows)
    if longest > ctx:
        raise ValueError(
            f"prompt of {longest} tokens is longer than the model's context of {ctx} tokens; shorten the prompt"
        )
    if longest + max_new_tokens > ctx:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of {ctx} "
            f"tokens; lower max_new_tokens to at most {ctx - longest}"
        )
    V = cfg.vocab_size
    for b, r in enumerate(rows):
        bad = [t for t in r if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt {b} holds token id {bad[0]}, outside the vocabulary [0, {V})")
    return longest


def normalize_eos(eos_ids, default: Sequence[int]) -> set[int]:
    """None -> the model's EOS ids; an int or a sequence of ints -> that set; [] never stops early."""
    if eos_ids is None:
        return set(default)
    if isinstance(eos_ids, numbers.Integral) and not isinstance(eos_ids, bool):
        return {int(eos_ids)}
    ids = list(eos_ids)
    if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
        raise ValueError(f"eos_ids must be an int or a list of ints, got {eos_ids!r}")
    return {int(t) for t in ids}


def check_slots(slots) -> int | None:
    """``serve``'s ``slots``: None (every prompt at once) or a whole number >= 1."""
    if slots is not None and (isinstance(slots, bool) or not isinstance(slots, numbers.Integral) or slots < 1):
        raise ValueError(f"slots must be a whole number >= 1 (batch rows decoding at once) or None, got {slots!r}")
    return None if slots is None else int(slots)


def static_room(need: int, cap: int) -> int:
    """Cache length for a compiled decoder: a power-of-two bucket (at least 256, at most ``cap``).

    A compiled static-shape pass attends over the whole cache and compiles once per cache shape,
    so buckets keep both the graphs few and the attention little longer than the generation.
    """
    size = 256
    while size < need:
        size *= 2
    return max(need, min(size, cap))


def pad_prompts(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated prompt rows -> right-padded ids [B, L] and lengths [B] on ``device``."""
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    return ids.to(device), torch.tensor([len(r) for r in rows], device=device)


# ------------------------------------------------------------------------------------------ stats
@dataclass
class DecodeStats:
    """What one or more ``generate`` calls did; ``merge`` adds runs together."""

    batch: int = 0
    new_tokens: int = 0
    target_passes: int = 0  # decoding passes of the target (prefill excluded)
    row_steps: int = 0  # (row, pass) pairs in which the row was still decoding
    step_tokens: int = 0  # tokens those pairs emitted (after EOS / budget cuts)
    prefills: int = 0
    accepted: Counter = field(default_factory=Counter)  # accepted draft tokens per row-step -> count
    depth_hits: Counter = field(default_factory=Counter)  # child depth -> row-steps that accepted a node there
    depth_trials: Counter = field(default_factory=Counter)  # child depth -> row-steps whose path reached a parent with children
    rank_hits: Counter = field(default_factory=Counter)  # sibling rank -> accepted
    rank_trials: Counter = field(default_factory=Counter)  # sibling rank -> tried (lower ranks failed first)
    tree_nodes: int = 0  # verified tree nodes summed over passes (root included)
    time: dict = field(default_factory=lambda: dict.fromkeys(TIME_KEYS, 0.0))
    total_time: float = 0.0

    @property
    def steps(self) -> int:
        """Target decoding passes (a batch of B rows verified together is one pass)."""
        return self.target_passes

    @property
    def tau(self) -> float:
        """Tokens emitted per (row, decoding pass): 1.0 for vanilla decoding."""
        return self.step_tokens / self.row_steps if self.row_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    def record(self, active: Sequence[bool], accepted: Sequence[int], emitted: Sequence[int], tree_size: int) -> None:
        self.target_passes += 1
        self.tree_nodes += tree_size
        for b, on in enumerate(active):
            if on:
                self.row_steps += 1
                self.step_tokens += emitted[b]
                self.accepted[accepted[b]] += 1

    def add_counts(self, depth_hits, depth_trials, rank_hits, rank_trials) -> None:
        for name, values in (("depth_hits", depth_hits), ("depth_trials", depth_trials),
                             ("rank_hits", rank_hits), ("rank_trials", rank_trials)):
            c = getattr(self, name)
            for k, v in enumerate(values):
                if v:
                    c[k] += int(v)

    def merge(self, other: "DecodeStats") -> "DecodeStats":
        """A new stats object holding both runs."""
        out = DecodeStats(batch=max(self.batch, other.batch))
        for name in ("new_tokens", "target_passes", "row_steps", "step_tokens", "prefills", "tree_nodes", "total_time"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted", "depth_hits", "depth_trials", "rank_hits", "rank_trials"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.time = {k: self.time.get(k, 0.0) + other.time.get(k, 0.0) for k in {*self.time, *other.time}}
        return out

    def as_dict(self) -> dict:
        rate = lambda h, t: {int(k): h[k] / t[k] for k in sorted(t) if t[k]}  # noqa: E731
        timed = sum(self.time.values())
        forwards = self.target_passes + self.prefills
        return {
            "steps": self.target_passes, "row_steps": self.row_steps, "new_tokens": self.new_tokens,
            "tau": self.tau, "tokens_per_s": self.tokens_per_s,
            "target_forwards": forwards,
            "target_forwards_per_token": forwards / self.new_tokens if self.new_tokens else None,
            "mean_tree_size": self.tree_nodes / self.target_passes if self.target_passes else 0.0,
            "accepted_hist": {int(k): v for k, v in sorted(self.accepted.items())},
            "accept_by_depth": rate(self.depth_hits, self.depth_trials),
            "accept_by_rank": rate(self.rank_hits, self.rank_trials),
            "time_split": {**self.time, "other": max(self.total_time - timed, 0.0) if timed else 0.0,
                           "total": self.total_time},
        }


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per row (EOS included when a row stopped on it)
    stats: DecodeStats


@dataclass
class StepInfo:
    """What one decoding pass did, for a ``hook`` (calibration, tracing, custom stats).

    ``tokens[b]`` are the tokens the pass produced for row b (before EOS / budget cuts),
    ``path`` [B, D+1] the accepted node ids (device), ``n_accept[b]`` how many of them count
    (0 for a finished row). ``tree`` and ``logits`` are None for vanilla decoding.
    ``inner_n_accept``: the same count for the policy's own nodes alone, when others were verified
    beside them (``Tree.inner_size``: prompt lookup's copy), read in the same transfer.
    """

    index: int
    active: list[bool]
    tokens: list[list[int]]
    n_accept: list[int]
    tree: object | None = None
    path: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    inner_n_accept: list[int] | None = None

    def tried_ranks(self, row: int) -> list[tuple[int, int, int]]:
        """(child depth, siblings tried, accepted sibling index or -1) along row's path (reads the device)."""
        if self.tree is None or not self.active[row]:
            return []
        n = self.n_accept[row]
        path = self.path[row, :n].tolist()
        kids = self.tree.children(row)
        out = []
        for d, node in enumerate(path):
            if not kids[node]:
                continue
            if d + 1 < n:
                hit = kids[node].index(path[d + 1])
                out.append((d + 1, hit + 1, hit))
            else:
                out.append((d + 1, len(kids[node]), -1))
        return out


class Timer:
    """Opt-in phase timing: ``perf_counter`` on CPU, CUDA events on a GPU (read once at the end)."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled, self.cuda = enabled, device.type == "cuda"
        self.events: list[tuple[str, object, object]] = []
        self.totals = dict.fromkeys(TIME_KEYS, 0.0)
        self._last = self._now()

    def _now(self):
        if not self.enabled:
            return None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def lap(self, key: str) -> None:
        if not self.enabled:
            return
        now = self._now()
        if self.cuda:
            self.events.append((key, self._last, now))
        else:
            self.totals[key] += now - self._last
        self._last = now

    def result(self) -> dict:
        for key, a, b in self.events:  # one synchronisation, at the end
            b.synchronize()
            self.totals[key] += a.elapsed_time(b) / 1000.0
        self.events.clear()
        return dict(self.totals)


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
    return StepInfo(info.index, active, tokens, n_accept)


def _row_generators(generator, n_prompts: int, sampling: SamplingParams, width: int):
    """prompt ids -> the generator a prefill of those prompts draws its row streams from. With every prompt in
    the first batch, the caller's own (so ``generate`` is unchanged); else one naming each prompt's seed."""
    if sampling.greedy or width == n_prompts:
        return lambda ids: generator
    seeds = row_seeds(generator, n_prompts)
    dev = generator.device if generator is not None else "cpu"
    return lambda ids: RowSeededGenerator([seeds[b] for b in ids], dev)
