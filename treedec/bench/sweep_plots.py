"""τ and tokens/s against tree size, drawn once (:func:`draw_size_curves`) for both callers: a sweep summary
(:mod:`treedec.sweep`: :func:`plot`, also acceptance by depth and rank; rows are ``summary.csv``'s flat dicts) and the
bench's budget sweeps (:func:`budget_sweep_plot`: ``bench.dynamic_sweep`` / ``bench.best_first_sweep``, one curve per
tree and head, tree=auto as a star at its mean T).

Imports on first use: matplotlib (the ``plots`` extra, absent from a plain install) in :func:`plot`, and
:mod:`treedec.bench.methods` (which loads torch, about 2.5 s) in :func:`budget_sweep_plot`, so a sweep's summary
(:mod:`treedec.sweep`, which reads metrics files only) draws without torch.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Sequence


def _num(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _line_label(row: dict, override_cols: Sequence[str]) -> str:
    parts = [row.get("policy") or "?"]
    parts += [f"{c}={row[c]}" for c in override_cols if row.get(c) not in (None, "")]
    return " ".join(parts)


def plot(rows: list[dict], out_dir: Path, overrides: Sequence[str], size_keys: Sequence[str] = (),
         average_over: Sequence[str] = ()) -> list[Path]:
    """Draw tree_size.png and acceptance.png into ``out_dir``; ``overrides``: the override columns that vary
    (they label the lines), ``size_keys``: those that set the tree size (the x axis, not a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    line_cols = [c for c in overrides if c not in size_keys and c not in average_over and c != "tree"]
    # (line label) -> tree size -> list of (tau, tokens/s); averaged over `average_over` columns
    lines: dict[str, dict[int, list[tuple[float | None, float | None]]]] = {}
    for r in rows:
        if r.get("tree_size") is None:
            continue
        lines.setdefault(_line_label(r, line_cols), {}).setdefault(int(r["tree_size"]), []).append(
            (_num(r.get("tau")), _num(r.get("tokens_per_s"))))
    out = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    draw_size_curves(axes, {label: {x: (_mean(v[0] for v in vs), _mean(v[1] for v in vs)) for x, vs in by_size.items()}
                            for label, by_size in lines.items()},
                     vanilla=_mean(_num(r.get("vanilla_tokens_per_s")) for r in rows), legend=len(lines) <= 16)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"sweep: {len(rows)} jobs")
    fig.tight_layout()
    out.append(out_dir / "tree_size.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        label = _line_label(r, [c for c in overrides if c not in average_over])
        for ax, prefix in zip(axes, ("accept_depth_", "accept_rank_")):
            pts = sorted((int(k[len(prefix):]), _num(v)) for k, v in r.items()
                         if k.startswith(prefix) and _num(v) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
    axes[0].set_xlabel("depth (steps that reached it)")
    axes[0].set_ylabel("acceptance rate")
    axes[1].set_xlabel("sibling rank (given lower ranks rejected)")
    axes[1].set_ylabel("acceptance rate")
    for ax in axes:
        ax.set_ylim(-0.02, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if len(rows) <= 16:
        axes[1].legend(fontsize=7)
    fig.tight_layout()
    out.append(out_dir / "acceptance.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)
    return out


def draw_size_curves(axes, curves: dict[str, dict[float, tuple[float | None, float | None]]],
                     stars: dict[str, tuple[float, float | None, float | None]] | None = None,
                     vanilla: float | None = None, legend: bool = True) -> None:
    """τ (``axes[0]``) and tokens/s (``axes[1]``) against tree size T: one line per ``curves`` label ({T: (τ, tok/s)}),
    one star per ``stars`` label ((mean T, τ, tok/s): a per-step-sized tree), vanilla's tok/s as a dashed line."""
    for label, by_size in sorted(curves.items()):
        xs = sorted(by_size)
        for ax, i in zip(axes, (0, 1)):
            pts = [(x, by_size[x][i]) for x in xs if by_size[x][i] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    for label, (t, *ys) in sorted((stars or {}).items()):
        for ax, y in zip(axes, ys):
            if y is not None:
                ax.plot([t], [y], "*", ms=13, label=label)
    if vanilla is not None:
        axes[1].axhline(vanilla, color="gray", linestyle="--", label="vanilla")
    for ax, name in zip(axes, ("τ (tokens per target pass)", "tokens / s")):
        ax.set_xlabel("tree size T (nodes verified per step, root included)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    if legend and (curves or stars):
        for ax in axes:
            ax.legend(fontsize=7)


def budget_sweep_plot(metrics: dict, out_dir: Path, plt) -> Path | None:
    """budget_sweep.png of a bench run: each ``<tree>_T<n>`` row of bench.dynamic_sweep / bench.best_first_sweep at
    its mean verified tree size, one curve per tree and head (``dynamic``, ``best_first@tiny_code_parallel``), tree=auto
    per head as a star; None when the run swept nothing."""
    from treedec.bench.methods import SWEEPS, parse_sweep

    ms = metrics["methods"]
    curves: dict[str, dict[float, tuple]] = {}
    stars: dict[str, tuple] = {}
    for opt in SWEEPS:
        sw = metrics.get(opt) or {}
        for name in sw.get("methods", []):
            e = ms.get(name)
            run, _, head = name.partition("@")
            if e is None or e.get("mean_tree_size") is None or not parse_sweep(run):
                continue
            label = parse_sweep(run)[0] + (f"@{head} ({e.get('head_kind')})" if head else "")
            curves.setdefault(label, {})[e["mean_tree_size"]] = (e["tau"], e["tokens_per_s"])
        for name in sw.get("auto") or []:
            e = ms.get(name)
            if e is not None and e.get("mean_tree_size") is not None:
                stars[f"{name} (mean T)"] = (e["mean_tree_size"], e["tau"], e["tokens_per_s"])
    if not curves:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    draw_size_curves(axes, curves, stars, (ms.get("vanilla") or {}).get("tokens_per_s"))
    fig.suptitle("tree budget sweep: fixed T per tree and head, tree=auto as a star", fontsize=10)
    fig.tight_layout()
    path = Path(out_dir) / "budget_sweep.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _mean(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else None
