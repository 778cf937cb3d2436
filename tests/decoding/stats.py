"""A chi-square goodness-of-fit check without scipy."""
from __future__ import annotations

import math
from collections import Counter

import torch


def chi2_threshold(df: int, z: float = 3.72) -> float:
    """Wilson–Hilferty upper quantile of chi-square(df); z = 3.72 is p ~ 1e-4 (one-sided)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(samples: list, probs: dict) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom; cells with expectation < 5 are pooled."""
    n = len(samples)
    counts = Counter(samples)
    stat, df, pool_e, pool_o = 0.0, -1, 0.0, 0
    for cell, p in probs.items():
        e = n * p
        if e < 5:
            pool_e, pool_o = pool_e + e, pool_o + counts.get(cell, 0)
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        df += 1
    unexpected = sum(c for cell, c in counts.items() if cell not in probs)
    pool_o += unexpected
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / max(pool_e, 1e-9)
        df += 1
    elif unexpected:
        stat = float("inf")
    return stat, max(df, 1)


def fits(samples: list, probs: dict) -> bool:
    stat, df = chi2_stat(samples, probs)
    return stat < chi2_threshold(df)


def as_dict(p: torch.Tensor) -> dict:
    return {i: float(v) for i, v in enumerate(p.tolist()) if v > 0}


def two_sample_fits(a: list, b: list) -> bool:
    """Chi-square test of homogeneity: could samples ``a`` and ``b`` come from one distribution?

    Cells are pooled until each holds >= 10 draws of both samples together (so no expected count < 5
    for equal-sized samples); the statistic is compared with the same p ~ 1e-4 threshold as :func:`fits`.
    """
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    cells, pool = [], [0, 0]
    for cell in sorted(set(ca) | set(cb), key=lambda c: -(ca[c] + cb[c])):
        x, y = ca[cell], cb[cell]
        if x + y >= 10:
            cells.append((x, y))
        else:
            pool = [pool[0] + x, pool[1] + y]
    if sum(pool):
        cells.append(tuple(pool))
    if len(cells) < 2:
        return True
    stat = 0.0
    for x, y in cells:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat < chi2_threshold(len(cells) - 1)
