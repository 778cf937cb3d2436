"""A multirun's summary: every job's ``metrics.json`` under the sweep dir gathered into ``summary.csv`` (one row
per job: the job's overrides as columns, then τ, tokens/s, speedup, new tokens, timings, acceptance by depth and
rank) and drawn by :mod:`treedec.bench.sweep_plots` (``tree_size.png``, ``acceptance.png``). It reads metrics files
only: a sweep's summary needs no torch."""
from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any, Sequence

from hydra.utils import instantiate
from omegaconf import OmegaConf

from treedec.bench.sweep_plots import plot

log = logging.getLogger("treedec.sweep")  # the command's own name, as in its other messages

SCALARS = ("tau", "tokens_per_s", "speedup", "new_tokens", "steps", "prompt_tokens", "identical_to_vanilla")
# Overrides that set the tree size (x axis) rather than a separate line in tree_size.png.
SIZE_KEYS = ("tree.total_tokens", "tree/shape", "tree.shape", "tree.path", "tree.choices")


def _policy_name(target: str | None) -> str:
    if not target:
        return "?"
    name = str(target).rsplit(".", 1)[-1]
    if name.endswith("Policy"):
        name = name[: -len("Policy")]
    return name.lower() or "?"


def _tree_size(tree_cfg: dict | None) -> int | None:
    """T (root included) of a job's tree config: instantiate the policy (cheap, no model) and read max_size."""
    if not tree_cfg:
        return None
    try:
        return int(instantiate(OmegaConf.create(tree_cfg)).max_size)
    except Exception:  # a custom or broken policy config: leave the column empty
        total = tree_cfg.get("total_tokens")
        return int(total) if isinstance(total, int) else None


def _parse_overrides(job_dir: Path) -> dict[str, str]:
    f = job_dir / ".hydra" / "overrides.yaml"
    if not f.is_file():
        return {}
    out = {}
    for item in OmegaConf.to_container(OmegaConf.load(f)) or []:
        key, _, value = str(item).partition("=")
        out[key.lstrip("+~")] = value
    return out


def _job_dirs(sweep_dir: Path) -> list[Path]:
    dirs = {p.parent for p in sweep_dir.rglob("metrics.json")}

    def key(p: Path):
        rel = p.relative_to(sweep_dir).parts
        return tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in rel)

    return sorted(dirs, key=key)


def collect(sweep_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """Rows of summary.csv (flat dicts) and the raw metrics of every job under ``sweep_dir``."""
    sweep_dir = Path(sweep_dir)
    rows, raw = [], []
    for job_dir in _job_dirs(sweep_dir):
        try:
            m = json.loads((job_dir / "metrics.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            log.warning("skipping %s: %s", job_dir / "metrics.json", e)
            continue
        cfg = m.get("config") or {}
        tree = cfg.get("tree") if isinstance(cfg.get("tree"), dict) else None
        row: dict[str, Any] = {"job": job_dir.relative_to(sweep_dir).as_posix()}
        row.update(_parse_overrides(job_dir))
        row["policy"] = _policy_name(tree.get("_target_") if tree else None)
        row["tree_size"] = _tree_size(tree)
        for k in SCALARS:
            row[k] = m.get(k)
        van = m.get("vanilla") or {}
        row["vanilla_tokens_per_s"] = van.get("tokens_per_s")
        for k, v in (m.get("time_split") or {}).items():
            row[f"time_{k}"] = v
        for d, v in (m.get("accept_by_depth") or {}).items():
            row[f"accept_depth_{d}"] = v
        for r, v in (m.get("accept_by_rank") or {}).items():
            row[f"accept_rank_{r}"] = v
        rows.append(row)
        raw.append(m)
    return rows, raw


def _is_metric(c: str) -> bool:
    return c in ("policy", "tree_size") or c in SCALARS or c.startswith(("vanilla_", "time_", "accept_"))


def override_columns(rows: Sequence[dict]) -> tuple[list[str], list[str]]:
    """(overrides that vary across jobs, overrides shared by every job), in first-seen order."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and k != "job" and not _is_metric(k)]
    varying = [c for c in cols if len({str(r.get(c)) for r in rows}) > 1]
    return varying, [c for c in cols if c not in varying]


def _columns(rows: Sequence[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    varying, shared = override_columns(rows)

    def order(c: str):
        head, _, tail = c.rpartition("_")
        return (head, int(tail)) if tail.isdigit() else (c, -1)

    metrics = ["policy", "tree_size", *SCALARS, "vanilla_tokens_per_s"]
    tail = sorted((c for c in cols if c.startswith(("time_", "accept_"))), key=order)
    return [c for c in ["job", *varying, *metrics, *tail, *shared] if c in cols]


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def write_csv(rows: list[dict], path: Path) -> Path:
    cols = _columns(rows)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: _fmt(r.get(c)) for c in cols})
    return path


def summarize(sweep_dir: str | Path, filename: str = "summary.csv", plots: bool = True,
              average_over: Sequence[str] = ("seed", "prompt", "prompt_file")) -> Path | None:
    """Write ``summary.csv`` (and the plots) for the sweep dir; None when no job left metrics.json."""
    sweep_dir = Path(sweep_dir)
    rows, _ = collect(sweep_dir)
    if not rows:
        log.warning("no metrics.json under %s: nothing to summarise", sweep_dir)
        return None
    path = write_csv(rows, sweep_dir / filename)
    if plots:
        try:
            varying, _ = override_columns(rows)  # only what varies labels a line
            plot(rows, sweep_dir, varying, SIZE_KEYS, average_over)
        except ImportError:
            log.warning("matplotlib is not installed (pip install 'treedec[plots]'): skipping sweep plots")
    return path
