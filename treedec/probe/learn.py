"""The learned tree: the Sequoia DP over a probe's acceptance rates, sized by this machine's timings.

:func:`learn_tree` solves the table of every budget and depth limit (:func:`treedec.tree.sequoia.solve`), times
the verify pass of every budget it can fill and one draft level (``timing.enabled``), and picks the tree with the
most expected tokens/s (or the fixed ``dp.budget`` / ``dp.depth``), with the best tree of every budget beside it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from omegaconf import DictConfig

from treedec.probe.timing import DEFAULT_TIMING_GRID, time_hardware
from treedec.tree import sequoia
from treedec.tree.sequoia import AcceptanceCounts, Choice, SequoiaTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LearnedTree:
    rates: np.ndarray  # the acceptance rates the DP used, [depth, rank]
    table: SequoiaTable
    pick: Choice  # the tree to use
    per_budget: dict[int, Choice]  # the best tree of every feasible budget
    timing: dict | None  # t_verify_s (monotone), t_draft_s, t_overhead_s; None without timing.enabled
    raw_verify: dict | None  # the verify times as measured

    @property
    def frontier(self) -> list[dict]:
        """Expected τ (and, timed, step time and tokens/s) of every budget's best tree, for metrics.json."""
        timing = self.timing
        return [{"budget": n, "depth": c.depth, "expected_tau": round(c.expected_tau, 4),
                 **({"step_ms": round(c.step_s * 1e3, 3), "expected_tokens_per_s": round(c.tokens_per_s, 2)}
                    if timing else {})}
                for n, c in self.per_budget.items() if not timing or n in timing["t_verify_s"]]


def learn_tree(counts: AcceptanceCounts, probe_stats: dict, dp: DictConfig, timing_cfg: DictConfig, target,
               draft) -> LearnedTree:
    """Solve the DP for ``counts`` (``dp``), time this machine (``timing_cfg``), and pick the tree."""
    rates = counts.rates(per_depth=bool(dp.per_depth), prior_strength=float(dp.prior_strength))
    if dp.per_depth and counts.depth < int(dp.max_depth):
        log.warning("dp.max_depth=%d is deeper than the probe's trials reached (depth %d): deeper levels reuse "
                    "depth %d's rates", dp.max_depth, counts.depth, counts.depth)
    width = int(dp.max_width) if dp.max_width else counts.width
    table = sequoia.solve(rates, int(dp.max_budget), int(dp.max_depth), width)

    budgets = [int(dp.budget)] if dp.budget else None  # in range: checked by validate()
    depths = [int(dp.depth)] if dp.depth else None
    timing = raw_verify = None
    if timing_cfg.enabled:
        tb = timing_cfg.budgets or [n for n in DEFAULT_TIMING_GRID if n < table.max_budget] + [table.max_budget]
        tb = sorted({int(n) for n in tb if 2 <= int(n) <= table.max_budget} | set(budgets or []))
        tb = [n for n in tb if np.isfinite(table.value[table.max_depth, n])]  # width x depth may cap the size
        if not tb:
            raise ValueError(f"no timing budget fits dp.max_depth={dp.max_depth} with width {width}")
        t_verify, t_draft = time_hardware(target, draft, table, tb, table.max_depth, int(timing_cfg.prefix_len),
                                          int(timing_cfg.repeats), int(timing_cfg.warmup), width)
        steps = max(probe_stats["steps"], 1)
        split = probe_stats["time_split"]
        # accept + commit per step; the commit includes one draft catch-up pass, counted in depth * t_draft
        overhead = max((split["accept"] + split["commit"]) / steps - t_draft, 0.0) if timing_cfg.overhead else 0.0
        raw_verify, t_verify = t_verify, sequoia.monotone(t_verify)  # noise must not make big trees look cheaper
        timing = {"t_verify_s": t_verify, "t_draft_s": t_draft, "t_overhead_s": overhead}
        pick = sequoia.choose(table, t_verify, t_draft, overhead, budgets=budgets, depths=depths)
    else:
        n = budgets[0] if budgets else table.max_budget
        pick = sequoia.choose(table, budgets=[n], depths=depths)

    # The best tree of every budget (by expected tokens/s with timings, else by expected tau), for
    # tree.total_tokens=... and for the frontier table.
    t_args = (timing["t_verify_s"], timing["t_draft_s"], timing["t_overhead_s"]) if timing else (None, 0.0, 0.0)
    per_budget = {}
    for n in range(2, table.max_budget + 1):
        try:
            per_budget[n] = sequoia.choose(table, *t_args, budgets=[n], depths=depths)
        except ValueError:  # infeasible at the fixed depth
            continue
    return LearnedTree(rates, table, pick, per_budget, timing, raw_verify)
