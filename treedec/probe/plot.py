"""The reliability diagram: measured acceptance against draft confidence per depth, with the fitted maps.

matplotlib is optional (the ``plots`` extra): it is imported when a diagram is drawn, and without it there is none.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)


def reliability_plot(cal, bins: dict, path) -> Path | None:
    """Reliability diagram: measured acceptance vs draft confidence per depth (dots), the fitted map (lines)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no reliability diagram (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    ax.plot([0, 1], [0, 1], color="0.6", lw=0.8, ls=":", label="perfectly calibrated")
    for d, (cs, ls, n) in enumerate(zip(bins["conf_sum"], bins["accept_sum"], bins["count"]), 1):
        pts = [(c / k, a / k, k) for c, a, k in zip(cs, ls, n) if k]
        if not pts:
            continue
        line, = ax.plot(cal.grid, cal.values[d - 1], lw=1.2, label=f"depth {d} ({int(sum(n))} edges)")
        if cal.power:  # the power map, dashed (the one applied unless calibration.map=isotonic)
            a, b = cal.power[d - 1]
            xs = [i / 100 for i in range(1, 101)]
            ax.plot(xs, [min(1.0, math.exp(a) * x ** b) for x in xs], lw=0.9, ls="--", color=line.get_color())
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=[8 + 40 * (p[2] / max(n)) for p in pts],
                   color=line.get_color(), alpha=0.8)
    ax.set_xlabel("draft probability of the edge")
    ax.set_ylabel("measured acceptance (parent accepted)")
    ax.set_title(f"reliability ({cal.meta['mode']['rule']}; lines: isotonic, dashed: power)")
    ax.set_xlim(0, 1), ax.set_ylim(0, 1.02)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
