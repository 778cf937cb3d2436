"""Draft confidence -> acceptance: a monotone per-depth map, measured by ``python -m treedec.calibrate``.

The dynamic policy (EAGLE-2) ranks nodes by the draft's cumulative probability, i.e. it assumes
the draft's confidence q of an edge is the chance the target accepts it. For a small head it is
not: the bundled head's top-1 child is accepted ~0.87 of the time at every depth while its
confidence decays with depth, so a raw-probability tree is too shallow. A :class:`Calibration`
maps (depth, q) to the measured acceptance of an edge given its parent was accepted.

Two monotone maps are fitted per depth from the same binned measurements, and the file says which one
the policy uses (``map``):

* ``power`` (the default): acceptance = min(1, e^a q^b), b > 0, a weighted least-squares line in
  log-log space over the bins (q >= ``POWER_QMIN``), i.e. a per-depth temperature (b = 1/t) with a scale.
  On the device it is ``min(0, a + b log q)`` per edge: a multiply-add and a clamp on the log-probs the
  draft already has, where the isotonic lookup takes seven kernels per depth, and on this CPU a
  kernel right after a head pass costs 20-40 us whatever its size (docs/design.md §8).
* ``isotonic``: pool-adjacent-violators on the bins, shrunk towards the identity where a bin has few
  trials, stored on a fixed grid of q; no parametric shape imposed (a piecewise-linear lookup with
  ``torch.bucketize`` on the device). It draws the reliability diagram's lines, and stays selectable.

On the bundled head both keep the same trees to within 2 % of τ (docs/benchmarks.md), and only the power
map made the calibrated tree faster than the raw one. Either is batched, with no host reads, and
clamped to [``FLOOR``, 1], so log-acceptance is finite and never positive: a child's path score never
exceeds its parent's.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import yaml

from treedec.atomic import write_text_atomic
from treedec.heads.config import BUNDLED_DRAFTS
from treedec.tree.tree import TreeError
from treedec.tree.yaml_files import Dumper, read_yaml

GRID = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
FLOOR = 1e-4  # smallest acceptance a map returns: log stays finite
LOG_FLOOR = math.log(FLOOR)
POWER_QMIN = 0.02  # the power map is fitted on bins of mean confidence >= this (a tree keeps no rarer edge)
MAPS = ("power", "isotonic")
HEADER = "# Draft calibration written by `python -m treedec.calibrate`: acceptance of an edge vs the draft's probability.\n"


def isotonic(y: Sequence[float], w: Sequence[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit of ``y`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [value, weight, count]
    for v, wt in zip(y, w):
        blocks.append([float(v), float(wt), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks[-1]
            tot = w1 + w2
            blocks[-1] = [(v1 * w1 + v2 * w2) / tot if tot > 0 else (v1 + v2) / 2, tot, n1 + n2]
    return [b[0] for b in blocks for _ in range(b[2])]


def fit(conf_sum, label_sum, count, grid: Sequence[float] = GRID, prior_strength: float = 2.0) -> list[list[float]]:
    """Per-depth isotonic maps on ``grid`` from binned measurements ``[depth][bin]`` (bins: grid intervals).

    Each bin's acceptance is shrunk towards its mean confidence with ``prior_strength`` pseudo-trials
    (an empty bin is the identity), then made non-decreasing, then read at the grid points by linear
    interpolation between bin centres. Returns ``values[depth][grid point]`` in [FLOOR, 1].
    """
    nb = len(grid) - 1
    out = []
    for cs, ls, n in zip(conf_sum, label_sum, count):
        if len(cs) != nb:
            raise ValueError(f"calibration bins: expected {nb} per depth (grid {len(grid)} points), got {len(cs)}")
        centre = [cs[i] / n[i] if n[i] else (grid[i] + grid[i + 1]) / 2 for i in range(nb)]
        acc = [(ls[i] + prior_strength * centre[i]) / (n[i] + prior_strength) for i in range(nb)]
        acc = isotonic(acc, [n[i] + prior_strength for i in range(nb)])
        xs, ys = [0.0] + centre + [1.0], [0.0] + acc + [acc[-1]]  # a token the draft rules out is not accepted
        vals = []
        for g in grid:  # piecewise-linear through the bin centres, flat beyond the last one
            j = next((j for j in range(1, len(xs)) if xs[j] >= g), len(xs) - 1)
            x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
            vals.append(y0 if x1 <= x0 else y0 + (y1 - y0) * (g - x0) / (x1 - x0))
        run = 0.0
        out.append([round(min(max(run := max(run, v), FLOOR), 1.0), 6) for v in vals])
    return out


def fit_power(conf_sum, label_sum, count, prior_strength: float = 2.0,
              qmin: float = POWER_QMIN) -> list[list[float]]:
    """Per-depth ``[a, b]`` of acceptance = e^a q^b from binned measurements ``[depth][bin]``: weighted least squares of
    log acceptance on log confidence over the bins of mean confidence >= ``qmin`` (each bin's acceptance shrunk
    towards its confidence as in :func:`fit`, weights its trials). A depth with fewer than two such bins, or a
    slope <= 0, gets the identity ``[0, 1]`` (the raw draft probability)."""
    out = []
    for cs, ls, n in zip(conf_sum, label_sum, count):
        pts = [(c / k, (hits + prior_strength * c / k) / (k + prior_strength), k) for c, hits, k in zip(cs, ls, n)
               if k > 0 and c / k >= qmin]
        ab = [0.0, 1.0]
        if len(pts) >= 2:
            W = sum(w for _, _, w in pts)
            x = [math.log(q) for q, _, _ in pts]
            y = [math.log(max(acc, FLOOR)) for _, acc, _ in pts]
            mx = sum(w * xi for (_, _, w), xi in zip(pts, x)) / W
            my = sum(w * yi for (_, _, w), yi in zip(pts, y)) / W
            sxx = sum(w * (xi - mx) ** 2 for (_, _, w), xi in zip(pts, x))
            b = sum(w * (xi - mx) * (yi - my) for (_, _, w), xi, yi in zip(pts, x, y)) / sxx if sxx > 0 else 0.0
            if b > 0:
                ab = [round(my - b * mx, 6), round(b, 6)]
        out.append(ab)
    return out


class Calibration:
    """A per-depth monotone map from an edge's draft probability to its acceptance probability.

    ``values[d - 1]`` are the isotonic map's acceptances at the ``grid`` points for child depth d; ``power[d - 1]``
    the power map's ``[a, b]`` (acceptance = min(1, e^a q^b)); ``map`` the one :meth:`log_accept` applies (``power``
    when given). Depths beyond a table reuse its deepest row. ``mode`` records the acceptance rule it was measured
    under.
    """

    def __init__(self, values: Sequence[Sequence[float]], grid: Sequence[float] = GRID,
                 meta: Mapping[str, Any] | None = None, power: Sequence[Sequence[float]] | None = None,
                 map: str | None = None):
        g = [float(x) for x in grid]
        if len(g) < 2 or g[0] != 0.0 or g[-1] != 1.0 or any(b <= a for a, b in zip(g, g[1:])):
            raise TreeError(f"calibration grid must rise strictly from 0 to 1, got {grid}")
        vals = [[float(v) for v in row] for row in values]
        if not vals:
            raise TreeError("calibration has no depths: recalibrate with `python -m treedec.calibrate`")
        for d, row in enumerate(vals, 1):
            if len(row) != len(g):
                raise TreeError(f"calibration depth {d} has {len(row)} values for a grid of {len(g)} points")
            if any(not (0.0 < v <= 1.0) for v in row) or any(b < a for a, b in zip(row, row[1:])):
                raise TreeError(f"calibration depth {d} must be non-decreasing values in (0, 1], got {row}")
        self.power = None if power is None else [[float(a), float(b)] for a, b in power]
        for d, (a, b) in enumerate(self.power or [], 1):
            if not (math.isfinite(a) and math.isfinite(b) and b > 0):
                raise TreeError(f"calibration depth {d}: the power map needs a finite scale and an exponent > 0, got "
                                f"{[a, b]}; recalibrate with `python -m treedec.calibrate`")
        self.map = map or ("power" if self.power else "isotonic")
        if self.map not in MAPS or (self.map == "power" and not self.power):
            raise TreeError(f"calibration map {self.map!r}: use one of {list(MAPS)} (power needs a 'power' table: "
                            "recalibrate with `python -m treedec.calibrate`)")
        if self.power is not None and len(self.power) != len(vals):
            raise TreeError(f"calibration has {len(vals)} isotonic depths but {len(self.power)} power ones")
        self.grid, self.values, self.meta = g, vals, dict(meta or {})
        self._dev: dict = {}

    @property
    def depth(self) -> int:
        return len(self.values)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
        """(grid [G], intercepts a and slopes b [depths, G + 1], and each depth's (a, b) rows) on ``device``:
        acceptance = a[i] + b[i] * q for ``i = bucketize(q, grid)``, the bin (grid[i-1], grid[i]] (the
        piecewise-linear map as two lookups and one multiply-add per edge). Columns 0 and G repeat the first
        and last bins, so q = 0 and q rounded past 1 need no clamp of the index (one op fewer a depth)."""
        key = str(device)
        if key not in self._dev:
            g, v = torch.tensor(self.grid, dtype=torch.float64), torch.tensor(self.values, dtype=torch.float64)
            b = torch.zeros_like(v)
            b[:, 1:] = (v[:, 1:] - v[:, :-1]) / (g[1:] - g[:-1])
            a = v - b * g
            pad = lambda t: torch.cat([t[:, 1:2], t[:, 1:], t[:, -1:]], 1).float().to(device)
            a, b = pad(a), pad(b)
            self._dev[key] = (g.float().to(device), a, b, list(zip(a.unbind(0), b.unbind(0))))
        return self._dev[key]

    def _power(self, device) -> torch.Tensor:
        """[depths, 2] the power map's (a, b) on ``device``."""
        key = ("power", str(device))
        if key not in self._dev:
            self._dev[key] = torch.tensor(self.power, dtype=torch.float32, device=device)
        return self._dev[key]

    def log_accept(self, logq: torch.Tensor, depth: int | torch.Tensor) -> torch.Tensor:
        """log of the calibrated acceptance of edges at child ``depth`` with draft log-probs ``logq`` (any shape);
        ``depth`` may be a tensor of depths broadcastable to ``logq`` (a chain's edges in one call)."""
        x = logq if logq.dtype == torch.float32 else logq.float()
        if self.map == "power":  # min(0, a + b log q): two kernels, no exp/log
            if torch.is_tensor(depth):
                ab = self._power(x.device)[depth.clamp(1, len(self.power)) - 1]
                return torch.addcmul(ab[..., 0], ab[..., 1], x).clamp_(LOG_FLOOR, 0.0)
            a, b = self.power[min(depth, len(self.power)) - 1]
            return x.mul(b).add_(a).clamp_(LOG_FLOOR, 0.0)
        grid, a, b, rows = self._tables(logq.device)
        q = x.exp()  # <= 1 up to rounding: the clamp below
        hi = torch.bucketize(q, grid)  # the bin (grid[hi-1], grid[hi]] holding q (0 and G: the padded end bins)
        if torch.is_tensor(depth):  # per-element rows of the table
            at = ((depth.clamp(1, self.depth) - 1) * a.shape[1]).expand_as(hi) + hi
            a, b = a.flatten()[at], b.flatten()[at]
        else:
            a, b = rows[min(depth, self.depth) - 1]
            a, b = a[hi], b[hi]
        return torch.addcmul(a, b, q).clamp(FLOOR, 1.0).log()

    def __call__(self, q: float, depth: int) -> float:
        """Host-side acceptance of one edge (tests, reports)."""
        return math.exp(self.log_accept(torch.tensor(math.log(max(q, 1e-30))), depth).item())

    def to_dict(self) -> dict:
        power = {} if self.power is None else {"map": self.map, "power": self.power}
        return {**self.meta, **power, "grid": self.grid, "values": self.values}


def save_calibration(path: str | Path, cal: Calibration) -> Path:
    """Write ``cal`` as YAML (atomic: temp file + rename)."""
    return write_text_atomic(path, HEADER + yaml.dump(cal.to_dict(), Dumper=Dumper, sort_keys=False, width=140))


def load_calibration(path: str | Path) -> Calibration:
    p, data = read_yaml(path, "calibration file", "`python -m treedec.calibrate` writes one (calibration.yaml "
                        "beside learned_tree.yaml); pass tree.calibration=<that file>, auto or null")
    if not isinstance(data, dict) or not isinstance(data.get("values"), list):
        raise TreeError(f"calibration file {p} has no 'values' table (per depth, acceptance at each grid point)")
    meta = {k: v for k, v in data.items() if k not in ("grid", "values", "power", "map")}
    try:
        return Calibration(data["values"], data.get("grid", GRID), meta, data.get("power"), data.get("map"))
    except TreeError as e:
        raise TreeError(f"calibration file {p}: {e}") from e


def resolve(calibration, draft_path=None) -> Calibration | None:
    """``tree.calibration``: a Calibration, a file, None (raw draft probabilities) or ``auto``.

    ``auto`` is the ``calibration.yaml`` next to the draft head (``draft_path``: a bundled head's
    name or a head directory) when there is one, else None.
    """
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    if str(calibration) != "auto":
        return load_calibration(calibration)
    if draft_path is None:
        return None
    head_dir = BUNDLED_DRAFTS.get(str(draft_path), Path(str(draft_path)).expanduser())
    f = head_dir / "calibration.yaml"
    return load_calibration(f) if f.is_file() else None


class Reliability:
    """Binned (confidence, acceptance) sums per child depth, accumulated on the device, read once.

    ``add`` takes one verified tree's edges: the draft log-prob of each edge, its acceptance label
    (greedy: 1 when the target's argmax at the parent is the child; sampling: the target's processed
    probability of the child, the chance the one-draw rule accepts it), the child depth, and which
    edges were tried (the parent was on the accepted path, so the target's choice there is real).
    """

    def __init__(self, max_depth: int, device, grid: Sequence[float] = GRID):
        self.grid = torch.tensor(grid, device=device)
        self.sums = torch.zeros(3, max_depth, len(grid) - 1, dtype=torch.float64, device=device)

    def add(self, logq: torch.Tensor, label: torch.Tensor, depth: torch.Tensor, tried: torch.Tensor) -> None:
        D, nb = self.sums.shape[1:]
        q = logq.float().exp().clamp(0.0, 1.0)
        b = torch.bucketize(q, self.grid[1:-1], right=True)  # bin i holds grid[i] <= q < grid[i + 1]
        ok = tried & (depth >= 1) & (depth <= D)
        flat = ((depth.clamp(1, D) - 1) * nb + b)[ok]
        for i, v in enumerate((q[ok], label.float()[ok], torch.ones_like(q[ok]))):
            self.sums[i].view(-1).index_add_(0, flat, v.double())

    def result(self) -> tuple[list, list, list]:
        """(confidence sums, acceptance sums, counts) as ``[depth][bin]`` lists (the one host read)."""
        conf, label, count = self.sums.tolist()
        return conf, label, count
