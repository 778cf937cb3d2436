"""Multirun sweeps: the :class:`SweepSummary` Hydra callback (``hydra.callbacks.sweep_summary`` of generate).

At the end of a multirun it gathers every job's ``metrics.json`` under the sweep dir into
``summary.csv`` (one row per job: the job's overrides as columns, then τ, tokens/s, speedup, new
tokens, timings, acceptance by depth and rank) and draws ``tree_size.png`` (τ and tokens/s against
tree size, one line per policy and setting) and ``acceptance.png`` (acceptance rate by depth and by
sibling rank, one line per job): :mod:`treedec.bench.sweep_summary`, drawn by :mod:`treedec.bench.sweep_plots`.

``python -m treedec.sweep <sweep dir>`` rebuilds the summary of a sweep by hand (for
example after a job failed, which stops Hydra before ``on_multirun_end``).
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from treedec.bench.sweep_summary import summarize

log = logging.getLogger(__name__)


class SweepSummary(Callback):
    """Collect a multirun's ``metrics.json`` files into ``summary.csv`` and plots in the sweep dir."""

    def __init__(self, filename: str = "summary.csv", plots: bool = True,
                 average_over: Sequence[str] = ("seed", "prompt", "prompt_file")):
        self.filename, self.plots, self.average_over = filename, plots, tuple(average_over)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            path = summarize(sweep_dir, self.filename, self.plots, self.average_over)
        except Exception as e:  # a report must never turn a finished sweep into a failure
            log.warning("sweep summary failed for %s: %s", sweep_dir, e)
            return
        if path is not None:
            log.info("sweep summary: %s", path)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m treedec.sweep <sweep dir>   (rebuilds summary.csv and the plots)")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = summarize(argv[0])
    if path is None:
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
