"""What a speculative step costs on this machine: a short measured profile, kept per machine, refined online.

A step of B rows that drafts a width-k tree of D levels and verifies T tokens costs about
draft(B, k, D) + verify(B, T) (T = 1: a plain decoding step, no draft). Both are timed the first time a
(device, target, head, dtype, threads, torch) combination decodes a batch of B rows, at the row counts
(powers of 4) around B (:func:`treedec.decoding.profile.measure`, a few tenths of a second each, logged with their
duration), and kept in a JSON file in :func:`cache_dir`, so later processes load them. Between measured points
the cost is linear in T, in D and in B. Online, every measured step refines its own (B, shape) cell (an EMA
started at the prediction) and, for the shapes not yet played at B, the step's rest (measured minus profiled
seconds: acceptance, commit, the loop) per row count. A corrupt or stale file is measured again with a
warning. The cost only sizes trees: it never changes the output.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from treedec.atomic import write_text_atomic

log = logging.getLogger(__name__)

VERSION = 2  # 2: drafts timed with their catch-up, after a verify; the online rest is additive
ALPHA = 0.3  # weight of one measured step in its cell's EMA (a one-off hiccup moves a cell by a third at most)
MOST_ROWS = 64  # the widest batch profiled (wider: extended linearly, so a profile stays a few seconds)
Shape = tuple[int, int, int]  # (width k, depth D, verified tokens T); (1, 0, 1) is a plain decoding step


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where step-cost profiles live: ``override`` (``tree.cost_cache``), else ``$TREEDEC_CACHE``, else
    ``$XDG_CACHE_HOME/treedec``, else ``~/.cache/treedec``."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("TREEDEC_CACHE"):
        return Path(os.environ["TREEDEC_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "treedec"


def _line(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through ``points`` (x -> y), extended linearly beyond both ends."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    i = min(max(int(np.searchsorted(xs, x)), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return max(points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0), 0.0)


def _rising(points: dict[int, float]) -> dict[int, float]:
    """A pass never costs less for more tokens or depth: a point above a later one (a disturbed run) is lowered."""
    xs = sorted(points)
    low = np.minimum.accumulate([points[x] for x in reversed(xs)])[::-1]
    return dict(zip(xs, low))


def _buckets(rows: int) -> list[int]:
    """The measured row counts (powers of 4 up to :data:`MOST_ROWS`) whose profiles bracket ``rows``, or the two
    largest, extended linearly past them (a wide batch's passes are compute-bound: linear in rows)."""
    if rows > MOST_ROWS:
        return [MOST_ROWS // 4, MOST_ROWS]
    lo = 1
    while lo * 4 <= rows:
        lo *= 4
    return [lo] if lo == rows else [lo, lo * 4]


class StepCost:
    """Predicted seconds of every candidate shape of one policy at B rows, from a per-machine profile."""

    def __init__(self, shapes: Sequence[Shape], key: dict, measure: Callable[[int], dict],
                 folder: str | os.PathLike | None = None, clock: Callable[[], float] = time.perf_counter):
        """``shapes``: the policy's candidates; ``key``: what the profile is valid for (device, models, threads,
        torch); ``measure(rows)`` -> ``{"verify": {T: s}, "draft": {k: {D: s}}}`` for one row count."""
        self.shapes, self.key, self.measure, self.clock = list(shapes), dict(key, version=VERSION), measure, clock
        name = hashlib.sha1(json.dumps({k: v for k, v in self.key.items() if k not in ("threads", "torch")},
                                       sort_keys=True).encode()).hexdigest()[:16]
        self.path = cache_dir(folder) / f"step-cost-{name}.json"
        self.rows: dict[int, dict] = self._load()
        self.profile_s = 0.0  # seconds spent measuring in this process (reported apart from decoding)
        self._raw: dict[int, np.ndarray] = {}
        self._overhead: dict[int, float] = {}  # rows -> EMA of measured minus profiled seconds (the step's rest)
        self._cells: dict[int, dict[int, float]] = {}  # rows -> shape index -> EMA of measured seconds
        self._last_overhead = 0.0

    def _load(self) -> dict[int, dict]:
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if data["key"] != self.key:
                log.warning("%s was measured for another setup (%s); measuring again", self.path,
                            ", ".join(k for k in self.key if data["key"].get(k) != self.key[k]))
                return {}
            return {int(b): {"verify": {int(t): float(s) for t, s in e["verify"].items()},
                             "draft": {int(k): {int(d): float(s) for d, s in v.items()} for k, v in e["draft"].items()}}
                    for b, e in data["rows"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("%s is not a readable step-cost profile (%s); measuring again", self.path, e)
            return {}

    def _covers(self, entry: dict | None) -> bool:
        """Whether a row count's profile reaches every shape (a larger T, width or depth than measured: no)."""
        if entry is None:
            return False
        need_t = max(t for _, _, t in self.shapes)
        widths = {k for k, d, _ in self.shapes if d}
        depth = max(d for _, d, _ in self.shapes)
        return (max(entry["verify"]) >= need_t and widths <= set(entry["draft"])
                and all(max(entry["draft"][k]) >= depth or k > 1 for k in widths))

    def _profile(self, rows: int) -> dict:
        if not self._covers(self.rows.get(rows)):
            t0 = self.clock()
            self.rows[rows] = self.measure(rows)
            took = self.clock() - t0
            self.profile_s += took
            log.info("measured this machine's step costs at %d rows in %.2f s (kept in %s)", rows, took, self.path)
            self._save()
        return self.rows[rows]

    def _save(self) -> None:
        rows = {str(b): {"verify": {str(t): s for t, s in e["verify"].items()},
                         "draft": {str(k): {str(d): s for d, s in v.items()} for k, v in e["draft"].items()}}
                for b, e in sorted(self.rows.items())}
        try:
            write_text_atomic(self.path, json.dumps({"key": self.key, "rows": rows}, indent=1) + "\n")
        except OSError as e:  # a read-only cache: measured again next time, never a failed run
            log.warning("could not keep the step-cost profile in %s (%s); set tree.cost_cache or $TREEDEC_CACHE "
                        "to a writable folder", self.path, e)

    def _at(self, entry: dict, k: int, d: int, t: int) -> float:
        return _line(_rising(entry["verify"]), t) + (_line(_rising(entry["draft"][k]), d) if d else 0.0)

    def profiled(self, rows: int) -> np.ndarray:
        """Seconds of every shape at ``rows`` rows by the profile alone (linear between row buckets)."""
        if rows not in self._raw:
            bs = _buckets(rows)
            per = [np.array([self._at(self._profile(b), *s) for s in self.shapes]) for b in bs]
            w = 0.0 if len(bs) == 1 else (rows - bs[0]) / (bs[1] - bs[0])
            self._raw[rows] = (1 - w) * per[0] + w * per[-1]
        return self._raw[rows]

    def seconds(self, rows: int) -> np.ndarray:
        """Predicted seconds of every shape at ``rows`` rows: measured cells, else the profile plus the step's rest
        (acceptance, commit, the loop: what no pass of the profile holds)."""
        out = self.profiled(rows) + self._overhead.get(rows, self._last_overhead)
        for i, s in self._cells.get(rows, {}).items():
            out[i] = s
        return out

    def observe(self, rows: int, shape: int, seconds: float) -> None:
        """A step of shape index ``shape`` at ``rows`` rows took ``seconds``."""
        predicted = self.seconds(rows)[shape]
        rest = self._overhead.get(rows, self._last_overhead)
        self._overhead[rows] = self._last_overhead = rest + ALPHA * (seconds - self.profiled(rows)[shape] - rest)
        cells = self._cells.setdefault(rows, {})
        cells[shape] = predicted + ALPHA * (seconds - predicted)


__all__ = ["StepCost", "cache_dir"]
