"""The plots of a sweep summary (:mod:`treedec.sweep`): τ and tokens/s against tree size, acceptance by depth and rank.

Rows are ``summary.csv``'s (flat dicts); matplotlib is imported here only (the ``plots`` extra).
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
    for label, by_size in sorted(lines.items()):
        xs = sorted(by_size)
        for ax, i in zip(axes, (0, 1)):
            ys = [_mean(v[i] for v in by_size[x]) for x in xs]
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    vanilla = _mean(_num(r.get("vanilla_tokens_per_s")) for r in rows)
    if vanilla is not None:
        axes[1].axhline(vanilla, color="gray", linestyle="--", label="vanilla (mean)")
        axes[1].legend(fontsize=7)
    for ax, name in zip(axes, ("τ (tokens per target pass)", "tokens / s")):
        ax.set_xlabel("tree size T (nodes verified per step, root included)")
        ax.set_ylabel(name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if lines and len(lines) <= 16:
        axes[0].legend(fontsize=7)
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


def _mean(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else None
