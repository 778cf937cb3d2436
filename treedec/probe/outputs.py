"""The files ``python -m treedec.calibrate`` writes, every one atomically: ``acceptance.json``, the learned tree
(``out``, default ``<run dir>/learned_tree.yaml``), ``calibration.yaml`` beside it, ``reliability.json`` and
``reliability.png``, and ``metrics.json`` with the resolved config."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from treedec.atomic import write_text_atomic
from treedec.probe.acceptance import fit_calibration
from treedec.probe.learn import LearnedTree
from treedec.probe.plot import reliability_plot
from treedec.tree.calibration import save_calibration
from treedec.tree.policies.learned import save_learned
from treedec.tree.sequoia import AcceptanceCounts


def write_outputs(cfg: DictConfig, target, sampling, pset: list, counts: AcceptanceCounts, probe_stats: dict,
                  reliability, learned: LearnedTree, t_start: float) -> dict:
    """Write every output of a calibrate run (``pset``: its prompts) and return its metrics."""
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    dp, pick, timing, n_prompts = cfg.dp, learned.pick, learned.timing, len(pset)
    acc = {**counts.as_dict(), "rates_used": np.round(learned.rates, 6).tolist(), "per_depth": bool(dp.per_depth),
           "prior_strength": float(dp.prior_strength), "spec_stats": {
               k: probe_stats[k] for k in ("steps", "new_tokens", "tau", "accept_by_depth", "accept_by_rank")}}
    write_text_atomic(run_dir / "acceptance.json", json.dumps(acc, indent=2) + "\n")

    trees = {n: c.choices for n, c in learned.per_budget.items()}
    meta = {
        "name": f"learned_T{pick.n}_d{pick.depth}",
        "budget": pick.n,
        "depth": pick.depth,
        "depth_limit": pick.depth_limit,
        "expected_tau": round(pick.expected_tau, 4),
        "expected_tokens_per_s": round(pick.tokens_per_s, 2) if timing else None,
        "acceptance": {"per_depth": bool(dp.per_depth), "by_rank": np.round(counts.pooled(), 4).tolist(),
                       "by_depth_rank": np.round(learned.rates, 4).tolist(),
                       "trials_by_depth_rank": counts.matrix(counts.trials).tolist()},
        "timing": None if timing is None else {
            "t_draft_ms": round(timing["t_draft_s"] * 1e3, 4), "t_overhead_ms": round(timing["t_overhead_s"] * 1e3, 4),
            "t_verify_ms": {int(n): round(t * 1e3, 4) for n, t in sorted(timing["t_verify_s"].items())},
            "t_verify_raw_ms": {int(n): round(t * 1e3, 4) for n, t in sorted(learned.raw_verify.items())},
            "prefix_len": int(cfg.timing.prefix_len), "device": str(target.device), "dtype": str(target.dtype),
            "threads": torch.get_num_threads(), "backend": str(cfg.model.attn_backend), "machine": platform.node()},
        "calibration": {"model": str(cfg.model.path), "draft": str(cfg.draft.path),
                        "sampling": OmegaConf.to_container(cfg.sampling), "prompts": n_prompts,
                        "max_new_tokens": int(cfg.max_new_tokens), "probe": OmegaConf.to_container(cfg.probe),
                        "probe_tau": round(probe_stats["tau"], 4), "steps": counts.steps,
                        "date": time.strftime("%Y-%m-%d %H:%M:%S")},
    }
    out = save_learned(cfg.out, pick.choices, meta, trees)

    cal_out, plot = write_calibration(cfg, sampling, n_prompts, reliability, out.with_name("calibration.yaml"))
    metrics = {
        "out": str(out), "calibration": str(cal_out), "reliability_plot": str(plot) if plot else None,
        "budget": pick.n, "depth": pick.depth, "expected_tau": pick.expected_tau,
        "expected_tokens_per_s": pick.tokens_per_s if timing else None, "probe_tau": probe_stats["tau"],
        "probe_tokens_per_s": probe_stats["tokens_per_s"], "steps": counts.steps,
        "new_tokens": probe_stats["new_tokens"], "prompts": n_prompts, "frontier": learned.frontier,
        "accept_by_rank": probe_stats["accept_by_rank"], "accept_by_depth": probe_stats["accept_by_depth"],
        "time_s": time.perf_counter() - t_start,
    }
    record = {**metrics, "prompt_sources": {p.id: p.source for p in pset},
              "config": OmegaConf.to_container(cfg, resolve=True)}
    write_text_atomic(run_dir / "metrics.json", json.dumps(record, indent=2) + "\n")
    return metrics


def write_calibration(cfg: DictConfig, sampling, n_prompts: int, reliability, cal_path: Path):
    """Fit and write ``calibration.yaml`` at ``cal_path``, and the reliability bins and plot in the run dir ->
    (the calibration file, the plot or None)."""
    run_dir = Path(cfg.paths.run_dir)
    cal, bins = fit_calibration(reliability, sampling, float(cfg.calibration.prior_strength), {
        "draft": str(cfg.draft.path), "model": str(cfg.model.path), "prompts": n_prompts,
        "prompt_source": str(cfg.prompts.source), "max_new_tokens": int(cfg.max_new_tokens),
        "date": time.strftime("%Y-%m-%d %H:%M:%S")}, str(cfg.calibration.map))
    cal_out = save_calibration(cal_path, cal)
    write_text_atomic(run_dir / "reliability.json", json.dumps({**bins, "grid": cal.grid, "values": cal.values},
                                                                indent=1) + "\n")
    return cal_out, reliability_plot(cal, bins, run_dir / "reliability.png")


def write_one_pass_outputs(cfg: DictConfig, target, sampling, pset: list, probe_stats: dict, reliability,
                           t_start: float) -> dict:
    """A one-pass head's calibrate run: ``calibration.yaml`` (beside ``out``), the reliability files and
    ``metrics.json``; no learned tree (its trees are best-first trees of its marginals)."""
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cal_out, plot = write_calibration(cfg, sampling, len(pset), reliability, Path(cfg.out).with_name("calibration.yaml"))
    metrics = {"out": None, "calibration": str(cal_out), "reliability_plot": str(plot) if plot else None,
               "probe_tau": probe_stats["tau"], "probe_tokens_per_s": probe_stats["tokens_per_s"],
               "steps": probe_stats["steps"], "new_tokens": probe_stats["new_tokens"], "prompts": len(pset),
               "accept_by_depth": probe_stats["accept_by_depth"], "time_s": time.perf_counter() - t_start}
    record = {**metrics, "prompt_sources": {p.id: p.source for p in pset},
              "config": OmegaConf.to_container(cfg, resolve=True)}
    write_text_atomic(run_dir / "metrics.json", json.dumps(record, indent=2) + "\n")
    return metrics


def summary(metrics: dict) -> str:
    """The lines calibrate prints: the learned tree, the calibration, and the overrides that use them."""
    out, cal_out = metrics["out"], metrics["calibration"]
    if out is None:  # a one-pass head: its calibration alone
        return (f"draft calibration (probe tau {metrics['probe_tau']:.2f} over {metrics['steps']} steps) -> {cal_out}\n"
                f"use it: python -m treedec.generate tree=best_first tree.calibration={cal_out} (or tree=auto; a "
                f"calibration.yaml beside the head is read by both)")
    tps = metrics["expected_tokens_per_s"]
    tps = f", est. {tps:.1f} tok/s" if tps is not None else ""
    return (f"learned tree: T={metrics['budget']} depth {metrics['depth']}, expected tau {metrics['expected_tau']:.2f}"
            f"{tps} (probe tau {metrics['probe_tau']:.2f} over {metrics['steps']} steps) -> {out}\n"
            f"draft calibration -> {cal_out} (tree=dynamic tree.calibration={cal_out})\n"
            f"use it: python -m treedec.generate tree=learned tree.path={out}")
