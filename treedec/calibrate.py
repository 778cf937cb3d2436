"""Learn a tree shape: ``python -m treedec.calibrate [hydra overrides]``.

1. **Probe**: speculative decoding with a wide probe tree (default: a "comb", see
   :func:`treedec.tree.sequoia.comb_choices`) on calibration prompts (held-out stdlib code,
   code of installed third-party packages, or a prompt file: treedec/data/prompts.py) records,
   for every verified node with children, which sibling ranks were tried
   and which was accepted, by depth: the acceptance rates ``p[depth][rank]`` of the Sequoia
   model (DecodeStats' ``rank_hits / rank_trials``, split by depth).
2. **Timing** (``timing.enabled``): the median target verify pass for trees of each budget on
   this machine, with ``timing.prefix_len`` tokens in the KV cache, and the median draft-head
   step (one tree level).
3. **DP**: :func:`treedec.tree.sequoia.solve` gives the tree of every budget and depth limit that
   maximises the expected accepted length; :func:`~treedec.tree.sequoia.choose` picks the budget
   and depth with the most expected tokens/s (or the fixed ``dp.budget`` / ``dp.depth``).
4. **Calibration**: every edge the probe verified whose parent was accepted is binned by its draft
   probability and depth with its outcome (greedy: argmax match; sampling: the target's processed
   probability of the child); per-depth power and isotonic maps (tree/calibration.py) are fitted and written
   as ``calibration.yaml`` beside the shape file (``tree=dynamic tree.calibration=...``), with a
   reliability diagram ``reliability.png`` (and its bins, ``reliability.json``) in the run dir.
5. **Output**: the shape file ``out`` (default ``<run dir>/learned_tree.yaml``; use it with
   ``tree=learned tree.path=...``), ``acceptance.json`` and ``metrics.json`` in the run dir.
"""
from __future__ import annotations

import json
import logging
import math
import platform
import statistics
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import treedec.config.schema  # noqa: F401  (registers schema/calibrate before Hydra composes)
from treedec.atomic import write_text_atomic
from treedec.cli import entry, launch, load_stack

log = logging.getLogger(__name__)

DEFAULT_TIMING_GRID = (2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


# ------------------------------------------------------------------------------------------ prompts
def prompt_set(cfg: DictConfig, tok) -> list:
    """The calibration prompts (:class:`treedec.data.prompts.PromptText`) of ``prompts.source``."""
    from treedec.data.prompts import load_prompt_set, read_prompt_file

    p = cfg.prompts
    if p.source == "file":
        return read_prompt_file(p.file, "prompts.file")[: int(p.n)]
    source = "stdlib" if p.source == "heldout" else p.source
    return load_prompt_set(source, int(p.n), int(p.prompt_tokens), tok, seed=int(cfg.seed), root=p.root,
                           val_fraction=float(p.val_fraction), packages=p.packages,
                           hint="pass prompts.source=file prompts.file=<prompts.jsonl>")


def prompt_texts(cfg: DictConfig, tok) -> list[str]:
    return [p.text for p in prompt_set(cfg, tok)]


def encode_prompts(cfg: DictConfig, tok, texts: list[str]) -> list[list[int]]:
    from treedec.data.chat import chat_prompt_ids

    out = []
    for t in texts:
        ids = chat_prompt_ids(tok, t, "pass chat=false") if cfg.chat else tok.encode(t)
        ids = ids[-int(cfg.prompts.prompt_tokens):]
        if ids:
            out.append(ids)
    if not out:
        raise ValueError("every calibration prompt encoded to zero tokens")
    return out


# -------------------------------------------------------------------------------------------- probe
def edge_labels(step, sampling):
    """One step's edges -> (draft log-prob, acceptance label, child depth, tried), all [B, T] on the device.

    An edge is *tried* when its parent is on the accepted path (the target's choice there is real).
    Its label is the target's processed probability of the child at the parent (greedy: 1 for the
    argmax, else 0): the chance the acceptance rule takes that edge, given the parent was accepted.
    """
    import torch

    from treedec.sampling import target_probs

    tree = step.tree
    B, T = tree.tokens.shape
    par = tree.parents.expand(B, T).clamp(min=0)
    depth = tree.depth.expand(B, T)
    logq = tree.scores - tree.scores.gather(1, par)
    n = torch.tensor(step.n_accept, device=par.device)
    path = step.path
    on_path = torch.zeros(B, T, dtype=torch.bool, device=par.device)
    on_path.scatter_(1, torch.where(torch.arange(path.shape[1], device=par.device) < n[:, None], path, 0), True)
    on_path &= (n > 0)[:, None]
    tried = on_path.gather(1, par) & (depth > 0)
    probs = target_probs(step.logits, sampling)  # [B, T, V]
    rows = torch.arange(B, device=par.device)[:, None]
    label = probs[rows, par, tree.tokens]
    return logq, label, depth, tried


def probe_acceptance(target, draft, probe, sampling, prompts, max_new_tokens: int, eos_ids, seed: int, stream=None):
    """Run speculative decoding with ``probe`` on each prompt -> (AcceptanceCounts, merged stats dict, Reliability)."""
    import torch

    from treedec.decoding.speculative import SpeculativeDecoder
    from treedec.tree.calibration import Reliability
    from treedec.tree.sequoia import AcceptanceCounts

    counts = AcceptanceCounts()
    reliability = Reliability(probe.max_depth, target.device)

    def record(step) -> None:  # the decoder's per-step hook: what each row's walk tried, and every edge's outcome
        for b, on in enumerate(step.active):
            if on:
                counts.add(step.tried_ranks(b))
        if step.tree is not None and step.tree.scores is not None:
            reliability.add(*edge_labels(step, sampling))

    dec = SpeculativeDecoder(target, draft, probe, sampling, eos_ids=eos_ids)
    total = None
    for i, ids in enumerate(prompts):
        gen = torch.Generator(device=target.device).manual_seed(seed + i)
        s = dec.generate([ids], max_new_tokens, generator=gen, stream=stream, hook=record, timing=True).stats
        total = s if total is None else total.merge(s)
    return counts, total.as_dict(), reliability


def fit_calibration(reliability, sampling, prior_strength: float, meta: dict, map: str = "power"):
    """The per-depth power and isotonic maps of a probe run -> (Calibration applying ``map``, the measured bins)."""
    from treedec.tree.calibration import Calibration, fit, fit_power

    conf, label, count = reliability.result()
    values = fit(conf, label, count, prior_strength=prior_strength)
    power = fit_power(conf, label, count, prior_strength=prior_strength)
    greedy = bool(sampling.greedy)
    mode = {"rule": "greedy" if greedy else "sampling",
            "acceptance": "target argmax == child" if greedy else "target processed probability of the child",
            **({} if greedy else {"temperature": float(sampling.temperature), "top_k": int(sampling.top_k),
                                  "top_p": float(sampling.top_p)}),
            "draft_temperature": 1.0}
    bins = {"conf_sum": conf, "accept_sum": label, "count": count}
    meta = {**meta, "mode": mode, "trials_by_depth": [int(sum(c)) for c in count]}
    return Calibration(values, meta=meta, power=power, map=map), bins


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


# ------------------------------------------------------------------------------------------- timing
def _median_time(fn, repeats: int, warmup: int, sync) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(max(repeats, 1)):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def time_hardware(target, draft, table, budgets, depth_limit: int, prefix_len: int, repeats: int, warmup: int,
                  width: int) -> tuple[dict[int, float], float]:
    """(median verify seconds per budget, median seconds of one draft level of ``width`` nodes)."""
    import torch

    from treedec.decoding.drafter import Drafter
    from treedec.tree.tree import Tree

    dev = target.device
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)  # noqa: E731
    ctx = getattr(target.config, "context_length", target.config.max_position_embeddings)
    prefix_len = max(1, min(prefix_len, ctx - max(budgets) - 2))
    gen = torch.Generator(device="cpu").manual_seed(0)
    V = target.config.vocab_size
    ids = torch.randint(0, V, (1, prefix_len), generator=gen).to(dev)
    verify: dict[int, float] = {}
    with torch.inference_mode():
        cache = target.new_cache(1, prefix_len + max(budgets) + 2)
        pre = target(ids, cache, logits="none", layer_inputs=draft.feature_layers_needed)
        cache.advance(prefix_len)
        for n in sorted(set(budgets)):
            tree = Tree.from_choices(table.choices(n, depth_limit))
            toks = torch.randint(0, V, (1, n), generator=gen).to(dev)
            pos = cache.lengths[:, None] + tree.depth.to(dev)[None]
            anc = tree.ancestors().to(dev)
            verify[n] = _median_time(lambda: target(toks, cache, position_ids=pos, tree_mask=anc),  # noqa: B023
                                     repeats, warmup, sync)
        head = draft.bind(target)
        drafter = Drafter(head, 1, prefix_len + width + 4)
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1)
        drafter.catch_up(nxt, draft.features(pre), torch.tensor([prefix_len], device=dev), [prefix_len], nxt[:, -1])
        w_toks = torch.randint(0, V, (1, width), generator=gen).to(dev)
        feats = drafter.root_feat[:, None].expand(-1, width, -1)
        eye = torch.eye(width, dtype=torch.bool, device=dev)
        t_draft = _median_time(lambda: drafter.expand(w_toks, feats, depth=1, anc_rows=eye, n_prev=0),
                               repeats, warmup, sync)
    return verify, t_draft


# ---------------------------------------------------------------------------------------------- run
def refuse_one_pass(one_pass: bool, path) -> None:
    """calibrate measures an autoregressive head (its ranks per depth, for the learned tree and calibration.yaml):
    a one-pass head is refused with what serves it, before the probe tree would refuse it in generate's terms."""
    if one_pass:
        from treedec.errors import ConfigError

        raise ConfigError(f"draft.path={path} is a one-pass (P-EAGLE, kind parallel) head: calibrate measures an EAGLE "
                         f"or EAGLE-3 head's acceptance by depth and sibling rank for tree=learned and tree=dynamic, "
                         f"which a one-pass head cannot draft, and its own trees (tree=chain, tree=best_first, "
                         f"tree=auto in generate) read its raw marginals, so it needs no calibration; calibrate an "
                         f"autoregressive head instead (draft=tiny_code or draft=tiny_code_eagle3, or draft.path=DIR)")


def run(cfg: DictConfig) -> dict:
    """Probe, time, solve and write the learned tree; every option is checked before the model loads."""
    from treedec.config_checks import instantiate_checked, validate

    validate(cfg, "calibrate")  # also the probe node by its _target_, before anything loads
    path = OmegaConf.select(cfg, "draft.path")
    if path is not None:
        from treedec.heads.checkpoint import head_summary

        refuse_one_pass(head_summary(path)["kind"] == "parallel", path)
    probe = instantiate_checked(cfg.probe, "probe")
    if hasattr(probe, "scores"):  # a static probe records its nodes' draft log-probs for the reliability diagram
        probe.scores = True
    sampling = instantiate_checked(cfg.sampling, "sampling")
    import numpy as np
    import torch

    from treedec.tree import sequoia
    from treedec.tree.policies.learned import save_learned

    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    torch.manual_seed(int(cfg.seed))
    t_start = time.perf_counter()
    target, tok, draft = load_stack(cfg)
    refuse_one_pass(getattr(draft, "one_pass", False), path)  # (a draft group of another loader)
    pset = prompt_set(cfg, tok)
    prompts = encode_prompts(cfg, tok, [p.text for p in pset])
    log.info("probing acceptance: %d prompts x %d new tokens, probe tree of %d nodes (depth %d)",
             len(prompts), cfg.max_new_tokens, probe.max_size, probe.max_depth)
    counts, probe_stats, reliability = probe_acceptance(target, draft, probe, sampling, prompts, int(cfg.max_new_tokens),
                                           tok.eos_ids or None, int(cfg.seed))
    if not counts.trials:
        raise RuntimeError("the probe run verified no node with children; raise max_new_tokens or check the probe")

    dp = cfg.dp
    rates = counts.rates(per_depth=bool(dp.per_depth), prior_strength=float(dp.prior_strength))
    if dp.per_depth and counts.depth < int(dp.max_depth):
        log.warning("dp.max_depth=%d is deeper than the probe's trials reached (depth %d): deeper levels reuse "
                    "depth %d's rates", dp.max_depth, counts.depth, counts.depth)
    width = int(dp.max_width) if dp.max_width else counts.width
    table = sequoia.solve(rates, int(dp.max_budget), int(dp.max_depth), width)

    budgets = [int(dp.budget)] if dp.budget else None  # in range: checked by validate()
    depths = [int(dp.depth)] if dp.depth else None
    timing = None
    if cfg.timing.enabled:
        tb = cfg.timing.budgets or [n for n in DEFAULT_TIMING_GRID if n < table.max_budget] + [table.max_budget]
        tb = sorted({int(n) for n in tb if 2 <= int(n) <= table.max_budget} | set(budgets or []))
        tb = [n for n in tb if np.isfinite(table.value[table.max_depth, n])]  # width x depth may cap the size
        if not tb:
            raise ValueError(f"no timing budget fits dp.max_depth={dp.max_depth} with width {width}")
        t_verify, t_draft = time_hardware(target, draft, table, tb, table.max_depth, int(cfg.timing.prefix_len),
                                          int(cfg.timing.repeats), int(cfg.timing.warmup), width)
        steps = max(probe_stats["steps"], 1)
        split = probe_stats["time_split"]
        # accept + commit per step; the commit includes one draft catch-up pass, counted in depth * t_draft
        overhead = max((split["accept"] + split["commit"]) / steps - t_draft, 0.0) if cfg.timing.overhead else 0.0
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
    frontier = [{"budget": n, "depth": c.depth, "expected_tau": round(c.expected_tau, 4),
                 **({"step_ms": round(c.step_s * 1e3, 3), "expected_tokens_per_s": round(c.tokens_per_s, 2)}
                    if timing else {})}
                for n, c in per_budget.items() if not timing or n in timing["t_verify_s"]]

    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    acc = {**counts.as_dict(), "rates_used": np.round(rates, 6).tolist(), "per_depth": bool(dp.per_depth),
           "prior_strength": float(dp.prior_strength), "spec_stats": {
               k: probe_stats[k] for k in ("steps", "new_tokens", "tau", "accept_by_depth", "accept_by_rank")}}
    write_text_atomic(run_dir / "acceptance.json", json.dumps(acc, indent=2) + "\n")

    trees = {n: c.choices for n, c in per_budget.items()}
    meta = {
        "name": f"learned_T{pick.n}_d{pick.depth}",
        "budget": pick.n,
        "depth": pick.depth,
        "depth_limit": pick.depth_limit,
        "expected_tau": round(pick.expected_tau, 4),
        "expected_tokens_per_s": round(pick.tokens_per_s, 2) if timing else None,
        "acceptance": {"per_depth": bool(dp.per_depth), "by_rank": np.round(counts.pooled(), 4).tolist(),
                       "by_depth_rank": np.round(rates, 4).tolist(),
                       "trials_by_depth_rank": counts.matrix(counts.trials).tolist()},
        "timing": None if timing is None else {
            "t_draft_ms": round(timing["t_draft_s"] * 1e3, 4), "t_overhead_ms": round(timing["t_overhead_s"] * 1e3, 4),
            "t_verify_ms": {int(n): round(t * 1e3, 4) for n, t in sorted(timing["t_verify_s"].items())},
            "t_verify_raw_ms": {int(n): round(t * 1e3, 4) for n, t in sorted(raw_verify.items())},
            "prefix_len": int(cfg.timing.prefix_len), "device": str(target.device), "dtype": str(target.dtype),
            "threads": torch.get_num_threads(), "backend": str(cfg.model.attn_backend), "machine": platform.node()},
        "calibration": {"model": str(cfg.model.path), "draft": str(cfg.draft.path),
                        "sampling": OmegaConf.to_container(cfg.sampling), "prompts": len(prompts),
                        "max_new_tokens": int(cfg.max_new_tokens), "probe": OmegaConf.to_container(cfg.probe),
                        "probe_tau": round(probe_stats["tau"], 4), "steps": counts.steps,
                        "date": time.strftime("%Y-%m-%d %H:%M:%S")},
    }
    out = save_learned(cfg.out, pick.choices, meta, trees)
    from treedec.tree.calibration import save_calibration

    cal, bins = fit_calibration(reliability, sampling, float(cfg.calibration.prior_strength), {
        "draft": str(cfg.draft.path), "model": str(cfg.model.path), "prompts": len(prompts),
        "prompt_source": str(cfg.prompts.source), "max_new_tokens": int(cfg.max_new_tokens),
        "date": time.strftime("%Y-%m-%d %H:%M:%S")}, str(cfg.calibration.map))
    cal_out = save_calibration(out.with_name("calibration.yaml"), cal)
    write_text_atomic(run_dir / "reliability.json", json.dumps({**bins, "grid": cal.grid, "values": cal.values},
                                                                indent=1) + "\n")
    plot = reliability_plot(cal, bins, run_dir / "reliability.png")
    metrics = {
        "out": str(out), "calibration": str(cal_out), "reliability_plot": str(plot) if plot else None,
        "budget": pick.n, "depth": pick.depth, "expected_tau": pick.expected_tau,
        "expected_tokens_per_s": pick.tokens_per_s if timing else None, "probe_tau": probe_stats["tau"],
        "probe_tokens_per_s": probe_stats["tokens_per_s"], "steps": counts.steps,
        "new_tokens": probe_stats["new_tokens"], "prompts": len(prompts), "frontier": frontier,
        "accept_by_rank": probe_stats["accept_by_rank"], "accept_by_depth": probe_stats["accept_by_depth"],
        "time_s": time.perf_counter() - t_start,
    }
    record = {**metrics, "prompt_sources": {p.id: p.source for p in pset},
              "config": OmegaConf.to_container(cfg, resolve=True)}
    write_text_atomic(run_dir / "metrics.json", json.dumps(record, indent=2) + "\n")
    tps = f", est. {pick.tokens_per_s:.1f} tok/s" if timing else ""
    print(f"learned tree: T={pick.n} depth {pick.depth}, expected tau {pick.expected_tau:.2f}{tps} "
          f"(probe tau {probe_stats['tau']:.2f} over {counts.steps} steps) -> {out}\n"
          f"draft calibration -> {cal_out} (tree=dynamic tree.calibration={cal_out})\n"
          f"use it: python -m treedec.generate tree=learned tree.path={out}")
    return metrics


@hydra.main(version_base="1.3", config_path="pkg://treedec.conf", config_name="calibrate")
@entry
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    launch("calibrate", main)
