"""This machine's timings for the learned tree: the median verify pass per tree budget, one draft level."""
from __future__ import annotations

import statistics
import time

import torch

from treedec.decoding.drafter import Drafter
from treedec.tree.tree import Tree

DEFAULT_TIMING_GRID = (2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)


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
    dev = target.device
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
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
            verify[n] = _median_time(lambda toks=toks, pos=pos, anc=anc: target(toks, cache, position_ids=pos,
                                                                             tree_mask=anc), repeats, warmup, sync)
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
