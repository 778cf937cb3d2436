"""Seconds of a step of each shape (width k, depth D, T tokens): verify(T) + draft(k, D), from a table profiled
once per key (machine, models, backend, threads, compile, torch) at the batch's rows and at one row, linear between
its points and non-decreasing, kept in :func:`cache_dir`. A bad file (unreadable, empty, non-finite, non-positive)
is measured again with a warning naming it; a run needing more T or depth measures only the missing points. The
timed steps scale it per row count; a scale off by STALE marks it for re-measurement at the next run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from treedec.atomic import write_text_atomic

log = logging.getLogger(__name__)

DECAY = 0.05  # weight of one step in every online estimate (acceptance, reach, cost): they weigh the last ~20 steps
STALE = 2.0  # a table the timed steps keep beating or missing by this factor is measured again

Shape = tuple[int, int, int]  # (width k, depth D, verified tokens T); (1, 0, 1) is a plain decoding step
Table = dict  # {"verify": {T: s}, "draft": {k: {D: s}}}


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """``override`` (``AutoPolicy(cost_cache=...)``), else ``$TREEDEC_CACHE``, else ``$XDG_CACHE_HOME/treedec``, else
    ``~/.cache/treedec``."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("TREEDEC_CACHE"):
        return Path(os.environ["TREEDEC_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "treedec"


def _curve(points: dict[int, float], xs: np.ndarray) -> np.ndarray:
    """Piecewise-linear through ``points``, flat past the ends, non-decreasing (a disturbed high point is lowered)."""
    keys = sorted(points)
    ys = np.minimum.accumulate(np.array([points[k] for k in keys])[::-1])[::-1]
    return np.interp(xs, keys, ys)


def _keyed(obj, key: Callable):
    """Nested dicts with their keys through ``key`` (JSON keeps only string keys)."""
    return {key(k): _keyed(v, key) for k, v in obj.items()} if isinstance(obj, dict) else obj


def _sane(table) -> bool:
    """A table of positive finite seconds with at least one point per curve (a hand-edited or cut file: no)."""
    try:
        values = [*table["verify"].values(), *(s for d in table["draft"].values() for s in d.values())]
        return bool(table["verify"]) and bool(table["draft"]) and all(table["draft"].values()) and all(
            isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in values)
    except (AttributeError, KeyError, TypeError):
        return False


class StepCost:
    """Predicted seconds of every candidate shape at B rows."""

    def __init__(self, shapes: Sequence[Shape], key: dict, measure: Callable[[int, Table], Table],
                 folder: str | os.PathLike | None = None):
        """``measure(rows, have)`` -> the table at ``rows`` rows, given the points ``have`` already holds."""
        self.shapes, self.measure = list(shapes), measure
        self.key = {k: str(v) for k, v in key.items()}
        name = hashlib.sha1(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = cache_dir(folder) / f"step-cost-{name}.json"
        self.tables: dict[int, Table] = self._load()
        # (rows, drafts?) -> EMA of measured / table seconds: the plain step and the drafted ones apart, since the
        # acceptance, commit and catch-up a drafted step adds (top-p sorts under sampling) are in no timed pass
        self.ratio: dict[tuple[int, bool], float] = {}
        self.stale, self._seen, self._remeasured = None, 0, set()  # stale: a row count to measure again
        a = np.array(self.shapes)
        self._k, self._d, self._t = a[:, 0], a[:, 1], a[:, 2]
        self._cache: dict[int, np.ndarray] = {}

    def _load(self) -> dict[int, Table]:
        if not self.path.exists():
            return {}
        try:
            tables = _keyed(json.loads(self.path.read_text())["rows"], lambda k: int(k) if k.isdigit() else k)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("%s is not a readable step-cost profile (%s); measuring again", self.path, e)
            return {}
        bad = [b for b, t in tables.items() if not _sane(t)]
        if bad:
            log.warning("%s holds empty, non-finite or implausible step costs (rows %s); measuring again",
                        self.path, bad)
        return {b: t for b, t in tables.items() if b not in bad}

    def _missing(self, table: Table | None) -> bool:
        if table is None:
            return True
        widths = {int(k) for k, d in zip(self._k, self._d) if d}
        return (max(table["verify"]) < self._t.max() or not widths <= set(table["draft"])
                or any(max(table["draft"][k]) < self._d[self._k == k].max() for k in widths))

    def prepare(self, rows: int) -> None:
        """Measure what the table lacks at ``rows`` rows and one row, and a stale row count's table again (once a
        process: a disagreement that outlives a fresh table is the steps' own, which the online scale holds)."""
        stale = set() if self.stale is None else {self.stale}
        need = [b for b in sorted({1, rows} | stale) if b in stale or self._missing(self.tables.get(b))]
        if stale:
            log.warning("the steps timed disagreed with %s by more than %gx; measuring this machine's step costs "
                        "again", self.path, STALE)
        for b in need:
            self.tables[b] = self.measure(b, {} if b in stale else self.tables.get(b, {}))
            self.ratio.pop((b, False), None), self.ratio.pop((b, True), None)  # the new table is the steps' scale
        self._remeasured |= stale
        self.stale, self._seen = None, 0
        if need:
            self._cache.clear()
            self._save()

    def _save(self) -> None:
        try:
            write_text_atomic(self.path, json.dumps({"key": self.key, "rows": self.tables}, indent=1) + "\n")
        except OSError as e:  # a read-only cache: measured again next time, never a failed run
            log.warning("could not keep the step-cost profile in %s (%s); set $TREEDEC_CACHE to a writable "
                        "folder", self.path, e)

    def _table(self, rows: int) -> np.ndarray:
        """Table seconds of every shape at ``rows`` rows: linear in rows between the measured row counts."""
        if rows not in self._cache:
            have = sorted(self.tables)
            per = []
            for b in have:
                t = self.tables[b]
                draft = np.zeros(len(self.shapes))
                for k, curve in t["draft"].items():
                    on = (self._k == k) & (self._d > 0)
                    draft[on] = _curve(curve, self._d[on])
                per.append(_curve(t["verify"], self._t) + draft)
            lo = max([b for b in have if b <= rows] or have[:1])
            hi = min([b for b in have if b >= rows] or have[-1:])
            w = 0.0 if hi == lo else (rows - lo) / (hi - lo)
            self._cache[rows] = (1 - w) * per[have.index(lo)] + w * per[have.index(hi)]
        return self._cache[rows]

    def seconds(self, rows: int) -> np.ndarray:
        """Predicted seconds of every shape at ``rows`` rows: the table, scaled by what the steps measured."""
        return self._table(rows) * np.where(self._d > 0, self._ratio(rows, True), self._ratio(rows, False))

    def _ratio(self, rows: int, drafts: bool) -> float:
        if (rows, drafts) not in self.ratio:  # not timed yet: the nearest row count's of its kind, else the table's
            near = min((k for k in self.ratio if k[1] == drafts), key=lambda k: abs(k[0] - rows), default=None)
            self.ratio[rows, drafts] = 1.0 if near is None else self.ratio[near]
        return self.ratio[rows, drafts]

    def observe(self, rows: int, shape: int, seconds: float) -> None:
        """A step of shape index ``shape`` at ``rows`` rows took ``seconds``."""
        table = self._table(rows)[shape]
        if not (math.isfinite(seconds) and seconds > 0):
            return
        # in log space, one step's ratio clipped to [1/STALE^2, STALE^2]: a hiccup (a long catch-up, the machine
        # busy for a moment) moves the scale by a few per cent at most
        key = (rows, bool(self._d[shape] > 0))
        step = np.clip(seconds / table, STALE ** -2, STALE ** 2)
        r = self.ratio[key] = self._ratio(*key) ** (1 - DECAY) * step ** DECAY
        self._seen += 1
        if self._seen > 1 / DECAY and not 1 / STALE < r < STALE and rows in self.tables and rows not in self._remeasured:
            self.stale = rows  # steady disagreement at a measured row count: the next generate measures it again


__all__ = ["StepCost", "cache_dir"]
