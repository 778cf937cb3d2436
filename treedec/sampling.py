"""The target's sampling distribution, shared by vanilla decoding and verification.

Lossless speculative sampling means "the same distribution vanilla sampling draws from",
so temperature, top-k and top-p are defined once, here (:func:`target_probs`), and both paths
draw through :func:`draw` (then :func:`read_settled` / :func:`settle` for the rare rows whose
top-p candidates all missed the nucleus).

Randomness comes from :class:`RowStreams`: one generator per batch row, split off the
caller's generator once per ``generate``, so a row's draws never depend on the other rows.
"""
from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from treedec.conf_defaults import shipped_defaults

CANDIDATES = 2  # top-p candidates per draw: all miss with probability <= (1 - top_p)^2 (2 were as fast as 4)
BLOCK = 64  # the blocked inverse CDF: a sum per BLOCK weights, then a cumsum inside one block
BLOCKED_FROM = 1 << 16  # weights in a draw from which the blocked inverse CDF is the faster (8 rows of 8192)
_TINY = torch.finfo(torch.float32).tiny
_MASK63 = (1 << 63) - 1
_GREEDY = shipped_defaults("sampling/greedy")  # the default: greedy, as sampling=greedy (written once there)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = _GREEDY["temperature"]  # 0 = greedy
    top_k: int = _GREEDY["top_k"]  # 0 = off
    top_p: float = _GREEDY["top_p"]  # 1 = off

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise ValueError(f"top_k must be a whole number (0 = off), got {self.top_k!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def candidates(self) -> int:
        """Uniforms a draw takes: one without top-p, :data:`CANDIDATES` with it (greedy: none)."""
        return 0 if self.greedy else 1 if self.top_p >= 1.0 else CANDIDATES


def as_sampling(value: SamplingParams | Mapping | None) -> SamplingParams:
    """A decoder's ``sampling`` argument as :class:`SamplingParams`: one as is, a mapping of its fields
    (``{"temperature": 0.8}``) converted, None the default (greedy). Anything else is a TypeError at
    construction, not an AttributeError deep in the first decoding step."""
    names = [f.name for f in fields(SamplingParams)]
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        unknown = [str(k) for k in value if k not in names]
        if unknown:
            raise TypeError(f"sampling={dict(value)!r} has unknown key(s) {', '.join(unknown)}; "
                            f"SamplingParams takes {', '.join(names)}")
        return SamplingParams(**value)
    raise TypeError(f"sampling must be a SamplingParams (or a dict of its fields: {', '.join(names)}), "
                    f"got {type(value).__name__} {value!r}")


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token over the last dim (first index among equal maxima).

    ``max(-1).indices`` rather than ``argmax``: the same choice, but about 4x faster for bf16
    logits on CPU, and every greedy path (vanilla, verification) calls this one function.
    """
    return logits.max(-1).indices


# ------------------------------------------------------------------------------ random streams
def _mix(x: int) -> int:
    """SplitMix64's finaliser: nearby inputs (base seed + row) -> unrelated 63-bit seeds."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) & _MASK63


def row_seeds(generator: torch.Generator | None, batch: int) -> list[int]:
    """Each row's stream seed: a :class:`RowSeededGenerator`'s own, else a hash of (one base draw, row)."""
    seeds = getattr(generator, "row_seeds", None)  # a RowSeededGenerator names each row's seed itself
    if seeds is None:
        dev = generator.device if generator is not None else "cpu"
        base = int(torch.randint(_MASK63, (), generator=generator, device=dev))
        return [base + 0x9E3779B97F4A7C15 * (b + 1) for b in range(batch)]
    if len(seeds) != batch:
        raise ValueError(f"the generator names {len(seeds)} row seeds for a batch of {batch} prompts")
    return list(seeds)


class RowStreams:
    """One random stream per batch row, on ``device``.

    The caller's ``generator`` (None: torch's global one) gives one base seed per ``generate``;
    row b's generator is seeded with a hash of (base, b). So a seeded run is reproducible, rows
    never share random numbers, and row b's draws depend on nothing but (base, b) and row b's
    own steps: not on the batch size or on what the other rows do (their misses, their
    finishing). Every draw a step makes for row b comes from ``generators[b]``.
    """

    def __init__(self, generator: torch.Generator | None, batch: int, device):
        self.device = torch.device(device)
        seeds = row_seeds(generator, batch)
        self.generators = [torch.Generator(self.device).manual_seed(_mix(s)) for s in seeds]

    @property
    def batch(self) -> int:
        return len(self.generators)

    def rand(self, *shape: int) -> torch.Tensor:
        """[B, *shape] uniforms in [0, 1), row b from row b's stream."""
        return torch.stack([self.row(b, *shape) for b in range(self.batch)])

    def row(self, b: int, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.generators[b], device=self.device)

    def keep_rows(self, order: Sequence[int]) -> None:
        """The batch was cut to rows ``order`` (old rows, in their new order): each stream follows its row."""
        self.generators = [self.generators[i] for i in order]

    def put_rows(self, slots: Sequence[int], other: "RowStreams") -> None:
        """New rows (``other``'s, prefilled) took batch slots ``slots``: their streams go with them."""
        for j, g in zip(slots, other.generators):
            self.generators[j] = g


class RowSeededGenerator(torch.Generator):
    """A generator that also names each batch row's seed: row b draws from a stream seeded by
    ``row_seeds[b]`` alone, so a record decodes the same in any batch, at any position, on any
    process (batch jobs seed a row by its record's id). Shared draws (sampled drafts) use the
    generator itself, seeded with ``seed``."""

    def __new__(cls, row_seeds, device="cpu", seed: int = 0):
        self = super().__new__(cls, torch.device(device))
        self.manual_seed(seed)
        self.row_seeds = [int(s) for s in row_seeds]
        return self

    def __init__(self, *args, **kwargs):  # all set in __new__ (torch.Generator takes the device there)
        pass


# ------------------------------------------------------------------------------ the distribution
def _workspace(shape: tuple[int, ...], device: torch.device, n: int) -> list[torch.Tensor]:
    """``n`` fp32 buffers of ``shape``: on a CPU reused across calls (per thread), elsewhere fresh.

    On a CPU every fresh [T, V] buffer costs page faults (a 26 x 8192 fp32 buffer: ~40 us, as much
    as the pass that fills it); a GPU's caching allocator already reuses its memory.
    """
    size = math.prod(shape)
    if device.type != "cpu" or size > _REUSE_MAX:  # (huge draws: fresh buffers rather than hold them forever)
        return [torch.empty(shape, device=device) for _ in range(n)]
    bufs = getattr(_WORK, "bufs", [])
    if len(bufs) < n or bufs[0].numel() < size:
        keep = max([size] + [b.numel() for b in bufs])
        bufs = _WORK.bufs = [torch.empty(keep) for _ in range(max(n, len(bufs)))]
    return [b[:size].view(shape) for b in bufs[:n]]


_WORK = threading.local()
_REUSE_MAX = 1 << 24  # floats per reused buffer (64 MiB): e.g. 64 rows x 32 nodes x 8192


def _weights(logits: torch.Tensor, params: SamplingParams, out: torch.Tensor | None = None) -> torch.Tensor:
    """exp((l - max l) / temperature) in fp32 after top-k: the target's tempered distribution up to its sum.

    Into ``out`` [..., W >= V] (the columns past V get weight 0; default a fresh fp32 tensor shaped
    like ``logits``). No normalising pass: every user divides by the sum or scales its uniforms by it.
    """
    V = logits.shape[-1]
    out = torch.empty(logits.shape, device=logits.device) if out is None else out
    x = out[..., :V].copy_(logits)
    x.sub_(x.amax(-1, keepdim=True))
    if params.temperature != 1:
        x.mul_(1 / params.temperature)
    if params.top_k and params.top_k < V:
        x.masked_fill_(x < x.topk(params.top_k, dim=-1).values[..., -1:], float("-inf"))
    if out.shape[-1] > V:
        out[..., V:] = float("-inf")
    return out.exp_()


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask of the top-p nucleus: x is kept iff the tokens strictly more likely than x hold
    less than ``top_p`` of the mass (the smallest most-likely set reaching top_p, ties kept)."""
    desc, order = probs.sort(dim=-1, descending=True)
    before = desc.cumsum(-1) - desc  # mass strictly before each sorted position (non-decreasing)
    start = torch.ones_like(desc, dtype=torch.bool)
    start[..., 1:] = desc[..., 1:] != desc[..., :-1]  # first position of each run of equal values
    above = torch.where(start, before, -1.0).cummax(-1).values  # mass strictly above each value
    return torch.zeros_like(start).scatter(-1, order, above < top_p)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 probabilities [..., V] after temperature, top-k and top-p (greedy: one-hot argmax)."""
    if params.greedy:
        return torch.nn.functional.one_hot(greedy_pick(logits), logits.shape[-1]).float()
    w = _weights(logits, params)
    probs = w / w.sum(-1, keepdim=True)
    return _renormalised_nucleus(probs, params.top_p) if params.top_p < 1.0 else probs


def _renormalised_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    probs = probs * nucleus(probs, top_p)
    return probs / probs.sum(-1, keepdim=True)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens [..., n] for uniforms ``u`` [..., n] in [0, 1) against ``probs`` [..., V] (any positive scale).

    Token i is picked with probability p_i exactly (up to the uniforms' 2^-24 grid) and a
    zero-probability token never, for any u in [0, 1].
    """
    return _search(probs.float().cumsum(-1), u)


def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose ``cdf`` reaches (1 - u) * total: that target lies in (0, total] (u in [0, 1]), so the
    index has positive weight and exists, with no guard against rounding past the end."""
    return torch.searchsorted(cdf, _target(cdf, u))


def _target(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (1 - u).clamp_(min=2 ** -24) * cdf[..., -1:]


def _blocked_search(w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_search` over the CDF of weights ``w`` [..., W] (W a multiple of :data:`BLOCK`) without scanning W.

    The block is found in the CDF of the block sums, the token in the CDF inside that one block,
    at the target's distance from the block's end. The same law, P(token) = P(block) P(token | block);
    one vectorised reduction over W instead of a sequential scan writing W (5-10x slower on a CPU).
    """
    blocks = w.unflatten(-1, (-1, BLOCK))  # [..., W / BLOCK, BLOCK]
    cdf = blocks.sum(-1).cumsum(-1)  # [..., W / BLOCK]
    x = _target(cdf, u)
    b = torch.searchsorted(cdf, x)  # [..., n] a block of positive mass
    inner = blocks.gather(-2, b[..., None].expand(*b.shape, BLOCK)).cumsum(-1)  # [..., n, BLOCK]
    end = inner[..., -1]
    rest = (x - cdf.gather(-1, b)).add_(end).clamp_(min=_TINY)  # in (0, end] but for rounding
    tok = torch.searchsorted(inner, torch.minimum(rest, end)[..., None]).squeeze(-1).add_(b, alpha=BLOCK)
    return tok, cdf[..., -1:]


def _candidates(w: torch.Tensor, u: torch.Tensor, scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF tokens [..., n] for uniforms ``u`` [..., n] and the total weight [..., 1]: blocked for many
    rows, by a plain cumsum (into ``scratch``) for few, where the blocked search's ~15 more small ops cost more."""
    if w.numel() >= BLOCKED_FROM:
        return _blocked_search(w, u)
    cdf = torch.cumsum(w, -1, out=scratch)
    return _search(cdf, u), cdf[..., -1:]


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, draws: int | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` [..., V] -> LongTensor [...]; ``draws=n``: n draws each, [..., n]."""
    u = torch.rand(probs.shape[:-1] + (draws or 1,), generator=generator, device=probs.device)
    idx = inverse_cdf(probs, u)
    return idx.squeeze(-1) if draws is None else idx


# ------------------------------------------------------------------------------------ the draws
@dataclass
class Draws:
    """One draw per row of a batch of logits, as :func:`draw` leaves it.

    ``miss`` marks the rows (rare: all top-p candidates fell outside the nucleus) whose ``token``
    is a placeholder until :func:`settle` draws them exactly; None when no row can miss.
    """

    token: torch.Tensor  # [B, ...] long
    miss: torch.Tensor | None = None  # [B, ...] bool
    probs: torch.Tensor | None = None  # [B, ..., V] the tempered, top-k'd weights, unnormalised (for settle)


def draw(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor | None = None) -> Draws:
    """A draw from :func:`target_probs` for every row of ``logits`` [B, ..., V], batched, no host reads.

    ``u`` [B, ..., params.candidates] uniforms (from :class:`RowStreams`). Top-p is applied without
    a vocabulary sort, by rejection: the candidates come from the tempered, top-k'd weights by
    inverse CDF; the first inside the nucleus (mass strictly above it < top_p, one compare and one
    multiply-sum over V) is the draw, which is then distributed exactly as the nucleus-renormalised
    p. Each candidate is inside with probability mass(nucleus) >= top_p, so all miss with
    probability <= (1 - top_p)^candidates; such rows are marked in ``miss`` for :func:`settle`.
    Two [.., V] buffers, reused (``Draws.probs`` is valid until the next draw on this thread).
    """
    if params.greedy:
        return Draws(greedy_pick(logits))
    V = logits.shape[-1]
    w, scratch = _workspace((*logits.shape[:-1], -(-V // BLOCK) * BLOCK), logits.device, 2)  # V rounded up
    w = _weights(logits, params, w)
    cand, total = _candidates(w, u, scratch)  # [B, ..., C]
    if params.top_p >= 1.0:
        return Draws(cand.squeeze(-1))
    limit = total * params.top_p  # (before the compare overwrites the CDF's buffer)
    w_c = w.gather(-1, cand)
    # Mass strictly above each candidate, one candidate at a time (no [.., C, V] tensor).
    above = [torch.gt(w, w_c[..., i:i + 1], out=scratch).mul_(w).sum(-1, keepdim=True) for i in range(cand.shape[-1])]
    inside = torch.cat(above, -1) < limit
    first = inside.to(torch.uint8).argmax(-1, keepdim=True)  # the first inside (0 when none is)
    return Draws(cand.gather(-1, first).squeeze(-1), ~inside.any(-1), w[..., :V])


def settle(d: Draws, params: SamplingParams, streams: RowStreams, rows: Sequence[int]) -> torch.Tensor:
    """``d.token`` with the missed entries of ``rows`` drawn exactly from the renormalised nucleus.

    The rare path (host reads, a sort per missed entry); each row draws from its own stream, so a
    row's randomness does not depend on whether another row missed.
    """
    token = d.token.clone()
    if d.miss is None:
        return token
    B, V = token.shape[0], d.probs.shape[-1]
    flat, miss, probs = token.view(B, -1), d.miss.reshape(B, -1), d.probs.reshape(B, -1, V)
    for b in rows:
        idx = miss[b].nonzero().flatten()
        if len(idx):
            w = probs[b, idx]
            exact = _renormalised_nucleus(w / w.sum(-1, keepdim=True), params.top_p)
            flat[b, idx] = inverse_cdf(exact, streams.row(b, len(idx), 1)).squeeze(-1)
    return token


def draw_from(logits: torch.Tensor, params: SamplingParams, streams: RowStreams | None) -> Draws:
    """:func:`draw` with one set of uniforms per row of ``logits`` [B, ..., V] from ``streams``."""
    u = None if params.greedy else streams.rand(*logits.shape[1:-1], params.candidates)
    return draw(logits, params, u)


def read_settled(d: Draws, active: Sequence[bool]) -> tuple[list[int], list[int]]:
    """One token per row (``d.token`` [B]) on the host in one read, with the ``active`` rows that missed."""
    if d.miss is None:
        return d.token.tolist(), []
    packed = torch.stack([d.token, d.miss.long()], 1).tolist()
    return [r[0] for r in packed], [b for b, r in enumerate(packed) if r[1] and active[b]]


def next_token(logits: torch.Tensor, params: SamplingParams, streams: RowStreams | None = None) -> torch.Tensor:
    """The token vanilla decoding emits after ``logits`` [B, V] (the draw verification makes at a node)."""
    d = draw_from(logits, params, streams)
    if d.miss is not None and bool(d.miss.any()):
        return settle(d, params, streams, d.miss.nonzero().flatten().tolist())
    return d.token
