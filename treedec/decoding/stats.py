"""What decoding reports: :class:`DecodeStats` (τ, acceptance per depth and rank, times; ``merge`` adds runs),
:class:`GenerateResult`, the per-step :class:`StepInfo` a hook and a policy see, and the opt-in :class:`Timer`.

τ is defined once, in :class:`DecodeStats`: tokens actually emitted by the target's decoding passes (after EOS
and the budget cut them) divided by the (row, pass) pairs that produced them. The prefill's first token is not a
decoding pass and counts in neither. Vanilla decoding has τ = 1 by this definition.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

TIME_KEYS = ("prefill", "draft", "verify", "accept", "commit")


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
    prepare_time: float = 0.0  # one-time work before decoding (tree=auto's profile): never in total_time or tok/s

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
        for name in ("new_tokens", "target_passes", "row_steps", "step_tokens", "prefills", "tree_nodes", "total_time",
                     "prepare_time"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted", "depth_hits", "depth_trials", "rank_hits", "rank_trials"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.time = {k: self.time.get(k, 0.0) + other.time.get(k, 0.0) for k in {*self.time, *other.time}}
        return out

    def as_dict(self) -> dict:
        rate = lambda h, t: {int(k): h[k] / t[k] for k in sorted(t) if t[k]}
        timed = sum(self.time.values())
        forwards = self.target_passes + self.prefills
        return {
            "steps": self.target_passes, "row_steps": self.row_steps, "new_tokens": self.new_tokens,
            "tau": self.tau, "tokens_per_s": self.tokens_per_s, "prepare_s": self.prepare_time,
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
    seconds: float | None = None  # the step's wall time, draft to host read (policies that time their shapes)

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
