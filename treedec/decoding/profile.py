"""Times the passes a speculative step is made of, on this machine, for :class:`~treedec.tree.cost.StepCost`.

One row count takes a few tenths of a second on a CPU: the target's verify pass over a chain of T tokens
(T = 1: the plain decoding pass) after a 192-token prefix, and the policy's own draft of every width at
its shallowest and deepest depth (with its catch-up), each the shortest of three runs after a warm-up, on
caches of their own (the decoder's state is never touched).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from typing import Callable

import torch

from treedec.decoding.drafter import Drafter
from treedec.tree.cost import StepCost

PREFIX = 192  # tokens of context the profile's passes attend over (a prompt and part of its continuation)
REPEATS = 3
CATCH_UP = 4  # accepted tokens the head catches up on before each timed draft, as after a step


def _seconds(fn: Callable[[], object], setup: Callable[[], object], device: torch.device) -> float:
    """Shortest wall time of ``fn`` over :data:`REPEATS` runs after a warm-up, each after an untimed ``setup`` that
    leaves the machine as a step would (a draft's caches cold after a verify, and the other way round)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    times = []
    for _ in range(REPEATS + 1):
        setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


@torch.inference_mode()
def measure(target, head, policy, rows: int) -> dict:
    """``{"verify": {T: s}, "draft": {k: {D: s}}}`` at ``rows`` rows for ``policy``'s shapes (``draft_shape``).

    A draft is timed with its catch-up (the head's pass over the tokens the last step accepted) and after a
    verify, a verify after a draft: so each costs what it does inside a step, not warm and alone."""
    dev, layers = target.device, head.feature_layers_needed
    sizes = sorted({t for _, _, t in policy.shapes} & {1, 2, 4, 8, 16, 32, 64, 128} | {max(t for *_, t in policy.shapes)})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, target.config.vocab_size, (rows, PREFIX + max(sizes)), generator=gen).to(dev)
    cache = target.new_cache(rows, PREFIX + max(sizes) + 1)
    pre = target(ids[:, :PREFIX], cache, logits=torch.full((rows, 1), PREFIX - 1, device=dev), layer_inputs=layers)
    cache.rollback(PREFIX)
    room = PREFIX + CATCH_UP + policy.max_inputs + policy.max_depth + 1 + Drafter.MAX_PENDING
    drafter = Drafter(head.for_batch(rows), rows, room)
    feats = head.features(pre)  # [rows, PREFIX, F]: any target features serve for timing
    drafter.catch_up(ids[:, 1:PREFIX + 1], feats, None, [PREFIX] * rows, ids[:, PREFIX])
    drafter.flush()

    def verify(t: int):
        if t == 1:
            return lambda: target(ids[:, :1], cache, logits="last", layer_inputs=layers)
        pos = cache.lengths[:, None] + torch.arange(t, device=dev)
        mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(rows, t, t)
        return lambda: target(ids[:, :t], cache, position_ids=pos, tree_mask=mask, layer_inputs=layers)

    def after_a_step():  # a verify, then the accepted tokens recorded for the head to catch up on
        verify(min(8, max(sizes)))()
        drafter.cache.rollback(PREFIX - CATCH_UP)
        drafter.catch_up(ids[:, :CATCH_UP], feats[:, :CATCH_UP], None, [CATCH_UP] * rows, ids[:, 0])

    draft = {}
    for k in sorted({k for k, d, _ in policy.shapes if d}):
        depths = sorted(d for kk, d, _ in policy.shapes if kk == k and d)
        draft[k] = {d: _seconds(lambda: policy.draft_shape(drafter, k, d), after_a_step, dev)
                    for d in {depths[0], depths[-1]}}
    deepest = max(d for _, d, _ in policy.shapes)
    verify_s = {t: _seconds(verify(t), lambda: policy.draft_shape(drafter, 1, deepest), dev) for t in sizes}
    return {"verify": verify_s, "draft": draft}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.processor() or platform.machine()} x{os.cpu_count()}"


def _identity(module: torch.nn.Module, config) -> str:
    """A model's shape and dtype (two checkpoints of one architecture cost the same)."""
    text = json.dumps(vars(config), sort_keys=True, default=str) + str(next(module.parameters()).dtype)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def step_cost(target, head, policy, folder=None) -> StepCost:
    """The step-cost model of ``policy`` decoding ``target`` with ``head`` here, loaded from or kept in ``folder``."""
    key = {"device": device_name(target.device), "target": _identity(target, target.config),
           "head": _identity(head, head.config), "backend": str(getattr(target, "attn_backend", "")),
           "threads": torch.get_num_threads(), "torch": torch.__version__}
    return StepCost(policy.shapes, key, lambda rows: measure(target, head, policy, rows), folder)


__all__ = ["measure", "step_cost"]
