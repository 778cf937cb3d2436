"""Reports of a bench run: the Markdown table (results.md) and plots (matplotlib, when installed).

matplotlib (the ``plots`` extra) is imported by :func:`plots` only, so the Markdown report needs none.
"""
from __future__ import annotations

import logging
from pathlib import Path

from treedec.bench.batched import markdown as batched_markdown
from treedec.bench.batched import plot as batched_plot
from treedec.bench.sweep_plots import budget_sweep_plot

log = logging.getLogger("treedec.bench")

PHASES = ("prefill", "draft", "verify", "accept", "commit", "decode", "other")


def _f(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _identical(e: dict) -> str:
    v = e.get("identical_to_vanilla")
    if v is None:
        return "n/a (sampled)" if not e.get("greedy", True) else "–"
    if v:
        return f"yes (= {e['checked_against']})" if e.get("checked_against") else "yes"
    n, ties = len(e.get("mismatches") or []), e.get("tie_flips", 0)
    if n and ties == n:
        return f"no: {n} prompt(s) part at a numerical tie (top-2 logits within rounding)"
    first = (e.get("mismatches") or [{}])[0]
    gap = first.get("logit_gap")
    gap = f", target logit gap {gap:.3g}" if gap is not None else ""
    return f"**NO** (from token {first.get('position')} of {first.get('prompt')}{gap})"


def all_rows(metrics: dict) -> dict[str, dict]:
    """Greedy rows, then every sampled row as ``NAME@T`` (for plots)."""
    rows = dict(metrics["methods"])
    for t, group in (metrics.get("sampled") or {}).items():
        rows.update({f"{n}@{t}": e for n, e in group["methods"].items()})
    return rows


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def sampled_tables(sampled: dict) -> list[str]:
    """One table per temperature: τ, tok/s, × vanilla_sample at that temperature, the accept phase's share."""
    lines = []
    for t, g in sampled.items():
        top_k = g.get("top_k") or "off"
        lines += ["", f"### Sampled at temperature {t} (top-p {g.get('top_p')}, top-k {top_k})", "",
                  "Seeded per prompt; outputs are random, so they are not compared with vanilla. Speedups are against "
                  f"`vanilla_sample` at temperature {t}; accept: the accept phase's share of wall time.", "",
                  "| method | tok/s | τ | × vanilla_sample | speedup ÷ τ | accept | new tokens |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name, e in g["methods"].items():
            lines.append(f"| {name} | {_f(e['tokens_per_s'], '.1f')} | {_f(e['tau'], '.2f')} | "
                         f"{_f(e['speedup'], '.2f')}× | {_f(e['speedup_over_tau'], '.2f')} | "
                         f"{_pct(e.get('accept_share'))} | {e['new_tokens']} |")
    return lines


def _hist(h: dict) -> str:
    """Accepted-length histogram {length: steps} as ``n0, n1, …`` (every length from 0 to the longest)."""
    h = {int(k): v for k, v in h.items()}
    return ", ".join(str(h.get(k, 0)) for k in range(max(h) + 1)) if h else "–"


def tree_table(methods: dict) -> list[str]:
    """Speculative methods by tree: τ, tok/s, the mean tree size actually verified, the accepted-length histogram."""
    rows = [(n, e) for n, e in methods.items() if e.get("accepted_hist") and e.get("policy")]
    if not rows:
        return []
    lines = ["", "Trees: mean tree size verified per step (T, root included) and how many steps accepted 0, 1, 2, … "
             "drafts (auto: the most used (T, depth) arms; lookup: the share of steps that verified the copies alone):", "",
             "| method | τ | tok/s | mean T | accepted length histogram (0, 1, 2, …) |", "|---|---:|---:|---:|---|"]
    for n, e in rows:
        arms = e.get("auto_arms")
        note = (" — auto: " + ", ".join(f"T{a['total_tokens']}/d{a['depth']} ×{a['steps']}" for a in arms[:3])
                if arms else "")
        if e.get("copy_alone_share") is not None:
            note += f" — copies alone on {100 * e['copy_alone_share']:.0f} % of steps"
        lines.append(f"| {n} | {_f(e['tau'], '.2f')} | {_f(e['tokens_per_s'], '.1f')} | "
                     f"{_f(e.get('mean_tree_size'), '.1f')} | {_hist(e['accepted_hist'])}{note} |")
    return lines


def step_table(methods: dict) -> list[str]:
    """Speculative methods: tok/s, × vanilla and τ, acceptance by position (the share of steps reaching depth d that
    accepted a node there) and the decode time's split (wall time less the prefill) by phase."""
    rows = [(n, e) for n, e in methods.items() if e.get("policy") and e.get("step_split")]
    if not rows:
        return []
    depth = max((max(e.get("accept_by_depth") or {0: 0}) for _, e in rows), default=0)
    depth = min(int(depth), 8)
    lines = ["", "Acceptance by position (dN: of the steps whose path reached depth N, the share accepting a node there) "
             "and where a step's time goes (t: share of the median pass's decode time, prefill excluded, by the "
             "decoder's own clocks):", "",
             "| method | tok/s | × vanilla | τ | " + " | ".join(f"d{d}" for d in range(1, depth + 1))
             + " | t draft | t verify | t accept | t commit |", "|---|" + "---:|" * (3 + depth + 4)]
    for n, e in rows:
        acc = {int(k): v for k, v in (e.get("accept_by_depth") or {}).items()}
        sp = e["step_split"]
        lines.append(f"| {n} | {_f(e['tokens_per_s'], '.1f')} | {_f(e['speedup'], '.2f')}× | {_f(e['tau'], '.2f')} | "
                     + " | ".join(_pct(acc.get(d)) for d in range(1, depth + 1)) + " | "
                     + " | ".join(_pct(sp.get(p)) for p in ("draft", "verify", "accept", "commit")) + " |")
    return lines


def _draft(cfg: dict, mach: dict) -> str:
    out = f"draft `{cfg.get('draft', {}).get('path')}`"
    if mach.get("draft_dtype"):
        w = mach.get("draft_wide_rows")
        out += (f" ({mach['draft_dtype']}{', int8 weights' if mach.get('draft_int8') else ''}"
                f"{f', bf16 from batch {w}' if w else ''})")
    return out


def _heads(heads: dict) -> str:
    """bench.draft_heads: each head's short name, kind (block size) and dtype."""
    parts = []
    for k, h in heads.items():
        block = f" block {h['block_size']}" if h.get("block_size") else ""
        parts.append(f"`{k}` ({h['kind']}{block}, {h['dtype']})")
    return "draft heads " + ", ".join(parts)


def markdown(metrics: dict) -> str:
    """The results table plus a header naming the model, the prompts and the machine."""
    cfg, mach, pr = metrics.get("config", {}), metrics.get("machine", {}), metrics.get("prompts", {})
    bench, model = cfg.get("bench", {}), cfg.get("model", {})
    hw = mach.get("gpu") or mach.get("cpu", "?")
    lines = [
        "# treedec benchmark",
        "",
        f"- model: `{model.get('path')}` ({mach.get('dtype')}, {mach.get('device')}, attention `{mach.get('attn_backend')}`), "
        + (_heads(metrics["heads"]) if metrics.get("heads") else _draft(cfg, mach)),
        f"- prompts: {pr.get('n')} ({pr.get('source')}), max_new_tokens {bench.get('max_new_tokens')}, "
        f"median of {bench.get('repeats')} passes after {bench.get('warmup')} warm-up run(s), batch 1",
        f"- machine: {hw}, {mach.get('threads')} threads, torch {mach.get('torch')}"
        + (f", transformers {mach['transformers']}" if mach.get("transformers") else "")
        + (f", commit {mach['git_commit']}" if mach.get("git_commit") else ""),
        "",
        "| method | tok/s | τ | speedup | speedup ÷ τ | identical to vanilla | new tokens |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for name, e in metrics["methods"].items():
        lines.append(f"| {name} | {_f(e['tokens_per_s'], '.1f')} | {_f(e['tau'], '.2f')} | "
                     f"{_f(e['speedup'], '.2f')}× | {_f(e['speedup_over_tau'], '.2f')} | {_identical(e)} | "
                     f"{e['new_tokens']} |")
    # Where the time of treedec's methods goes (the median pass, by phase), and what one step costs in ops.
    rows = [(n, e) for n, e in metrics["methods"].items() if e.get("family") == "treedec"]
    phases = [p for p in PHASES if any(p in e["time_split"] for _, e in rows)]
    compiled = any("compile_s" in e for _, e in rows)
    if rows and phases:
        extra = ["total s", "host reads/step", "aten ops/step"] + (["compile s"] if compiled else [])
        lines += ["", "Time split of the median pass (% of wall time; phases timed by the decoder itself), and per "
                  "decoding step the host reads and aten ops of one untimed run on the first prompt:", "",
                  "| method | " + " | ".join(phases + extra) + " |", "|---|" + "---:|" * (len(phases) + len(extra))]
        for n, e in rows:
            ts, total = e["time_split"], e["time_split"].get("total") or 0.0
            cells = [f"{100 * ts.get(p, 0.0) / total:.0f}%" if total else "–" for p in phases]
            cells += [f"{total:.2f}", _f(e.get("host_reads_per_step"), ".1f"), _f(e.get("aten_ops_per_step"), ".0f")]
            if compiled:
                cells.append(_f(e.get("compile_s"), ".1f"))
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        if compiled:
            lines += ["", "compile s: the first warm-up run of a compiled method (compilation included); it is "
                          "never part of tok/s."]
        leaked = [n for n, e in rows if e.get("graphs_compiled_in_timed_runs")]
        if leaked:
            lines += ["", "**Compiled during the timed runs** (their tok/s includes compilation): "
                      + ", ".join(leaked)]
    lines += step_table(metrics["methods"])
    lines += tree_table(metrics["methods"])
    if metrics.get("sampled"):
        lines += sampled_tables(metrics["sampled"])
    if metrics.get("batched"):  # bench.batch_sizes (treedec/bench/batched.py)
        lines += batched_markdown(metrics["batched"])
    if metrics.get("skipped"):
        why: dict[str, list[str]] = {}  # one line per reason: a head skips the same trees at every budget
        for name, reason in metrics["skipped"].items():
            why.setdefault(reason, []).append(f"`{name}`")
        lines += [""] + [f"Skipped {', '.join(names)}: {reason}" for reason, names in why.items()]
    if metrics.get("failures"):
        lines += ["", "**FAILURES**:", *[f"- {f}" for f in metrics["failures"]]]
    return "\n".join(lines) + "\n"


def plots(metrics: dict, out_dir: str | Path) -> list[Path]:
    """tokens_per_s.png, tau.png, time_split.png (and budget_sweep.png, batch_throughput.png); returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    out_dir = Path(out_dir)
    ms = all_rows(metrics)
    names = list(ms)
    colors = ["#4c72b0" if ms[n].get("family") == "treedec" else "#dd8452" for n in names]
    written = []
    try:
        fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(names), 3.6))
        vals = [ms[n]["tokens_per_s"] for n in names]
        bars = ax.bar(names, vals, color=colors)
        for b, n in zip(bars, names):
            s = ms[n].get("speedup")
            if s is not None:
                ax.annotate(f"{s:.2f}×", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                            fontsize=8)
        if "vanilla" in ms:
            ax.axhline(ms["vanilla"]["tokens_per_s"], color="gray", lw=0.8, ls="--")
        ax.set_ylabel("tokens / s (median)")
        ax.set_title("throughput (blue: treedec, orange: transformers); label: speedup vs vanilla "
                     "(NAME@T: vs vanilla_sample@T)", fontsize=9)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "tokens_per_s.png", dpi=120)
        plt.close(fig)
        written.append(out_dir / "tokens_per_s.png")

        fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(names), 3.6))
        ax.bar(names, [ms[n]["tau"] for n in names], color=colors)
        ax.set_ylabel("τ (tokens per target forward)")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.tick_params(axis="x", rotation=30, labelsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "tau.png", dpi=120)
        plt.close(fig)
        written.append(out_dir / "tau.png")

        spec = [n for n in names if ms[n].get("family") == "treedec"]
        phases = [p for p in PHASES if any(ms[n]["time_split"].get(p) for n in spec)]
        if spec and phases:
            fig, ax = plt.subplots(figsize=(1.0 + 0.9 * len(spec), 3.6))
            bottom = [0.0] * len(spec)
            for p in phases:
                v = [ms[n]["time_split"].get(p, 0.0) for n in spec]
                ax.bar(spec, v, bottom=bottom, label=p)
                bottom = [a + b for a, b in zip(bottom, v)]
            ax.set_ylabel("seconds (median pass, all prompts)")
            ax.legend(fontsize=7)
            ax.tick_params(axis="x", rotation=30, labelsize=8)
            fig.tight_layout()
            fig.savefig(out_dir / "time_split.png", dpi=120)
            plt.close(fig)
            written.append(out_dir / "time_split.png")
        if metrics.get("batched"):  # bench.batch_sizes: batch_throughput.png
            written.append(batched_plot(metrics["batched"], out_dir, plt))
        sweep = budget_sweep_plot(metrics, out_dir, plt)
        if sweep is not None:
            written.append(sweep)
    except Exception as exc:  # a plot is never worth failing a benchmark for
        log.warning("plotting failed: %s: %s", type(exc).__name__, exc)
    return written


__all__ = ["all_rows", "markdown", "plots", "sampled_tables", "step_table", "tree_table"]
