"""The bench tests' configs: `python -m treedec.bench` over the session's ``stack`` (tests/conftest.py), small enough
to run in seconds."""
from __future__ import annotations

from tests.helpers import compose_config


def bench_overrides(stack, run_dir, *extra) -> list[str]:
    """The tiny stack's overrides; a key in ``extra`` replaces the base one (Hydra refuses a key given twice)."""
    base = [f"model.path={stack / 'target'}", "model.dtype=float32", "model.device=cpu", "kernel=sdpa",
            f"draft.path={stack / 'draft'}", f"bench.prompts={stack / 'prompts.jsonl'}", "bench.max_new_tokens=12",
            "bench.repeats=2", "bench.warmup=1", "bench.num_threads=1", f"bench.learned_path={stack / 'learned.yaml'}",
            "tree/shape@bench.trees.static.shape=balanced_2x3", "bench.trees.dynamic.total_tokens=8",
            "bench.trees.dynamic.depth=3", "bench.trees.dynamic.top_k=3", "bench.trees.chain.depth=3",
            "bench.trees.dynamic_raw.total_tokens=8", "bench.trees.dynamic_raw.depth=3", "bench.trees.dynamic_raw.top_k=3",
            "bench.trees.auto.max_depth=3", "bench.trees.auto.top_k=3",
            f"bench.assistant_path={stack / 'assistant'}", "bench.plots=false", f"paths.run_dir={run_dir}"]
    keys = {e.split("=", 1)[0] for e in extra}
    return [o for o in base if o.split("=", 1)[0] not in keys] + list(extra)


def bench_cfg(stack, run_dir, *extra):
    """The bench config of :func:`bench_overrides`."""
    return compose_config("bench", bench_overrides(stack, run_dir, *extra))
